"""Structured outputs and logit_bias through `LLM.generate` on a tiny random model: constrained
requests in one batch with unconstrained ones always produce output that matches their
schema, choice or regex (a random model's own choices would not); a bad spec is a ValueError
naming the field before anything is queued; a +100 bias makes greedy decoding pick that token."""

from __future__ import annotations

import json
import re

import pytest

from batchinfer import LLM, SamplingParams
from batchinfer.core.structured_output import StructuredOutput
from tests.tiny_models import make_tiny_llama

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 3, "maximum": 900},
                         "tag": {"type": "string", "enum": ["alpha", "beta"]},
                         "items": {"type": "array", "items": {"type": "boolean"},
                                   "maxItems": 3}},
          "required": ["id", "tag", "items"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_tiny_llama(tmp_path_factory.mktemp("tiny"))), max_model_len=512,
               kv_cache_memory=16 << 20)


def test_constrained_requests_match_their_spec_beside_unconstrained_ones(llm):
    """One batch: a JSON schema (greedy and sampled), a choice, a regex and two unconstrained
    requests; every constrained output that stopped on its own parses against its spec."""
    specs = [StructuredOutput(json_schema=SCHEMA), StructuredOutput(json_schema=SCHEMA),
             StructuredOutput(choice=["red", "green", "blue"]),
             StructuredOutput(regex="[0-9]{3}-[a-c]+"), None, None]
    params = [SamplingParams(max_tokens=300, temperature=0 if i % 2 == 0 else 1.0, seed=i,
                             structured_output=spec) for i, spec in enumerate(specs)]
    outs = llm.generate(["hello", "hi there", "pick", "code", "free", "text"], params)
    for spec, out in zip(specs, outs, strict=True):
        completion = out.outputs[0]
        if spec is None:
            continue
        assert completion.finish_reason == "stop", (spec.kind, completion.text)
        if spec.kind == "json_schema":
            value = json.loads(completion.text)
            assert set(value) == {"id", "tag", "items"}
            assert isinstance(value["id"], int) and 3 <= value["id"] <= 900
            assert value["tag"] in ("alpha", "beta")
            assert len(value["items"]) <= 3 and all(isinstance(v, bool) for v in value["items"])
        elif spec.kind == "choice":
            assert completion.text in ("red", "green", "blue")
        else:
            assert re.fullmatch("[0-9]{3}-[a-c]+", completion.text)


def test_bad_specs_are_value_errors_naming_the_field(llm):
    with pytest.raises(ValueError, match="structured_output"):
        StructuredOutput(json_schema="{not json")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError):
        llm.generate(["x"], SamplingParams(
            max_tokens=5, structured_output=StructuredOutput(grammar="root ::= undefined_rule")))
    # the engine still serves after the refusal
    assert llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids


def test_logit_bias_moves_greedy_decoding(llm):
    plain = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    first = plain[0].outputs[0].token_ids
    target = next(t for t in range(5, 200) if t not in first)
    biased = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                    logit_bias={target: 100.0}))
    assert biased[0].outputs[0].token_ids == [target] * 4


def test_json_strings_take_only_valid_utf8_and_count_code_points():
    """A byte-level vocabulary can spell a UTF-16 surrogate's three UTF-8-like bytes, which
    xgrammar's own string classes admit; the schema grammar refuses them (so every string
    decodes without U+FFFD), and a bounded string counts one code point per repetition (so it
    holds no escapes; a free string does)."""
    import xgrammar as xgr

    from batchinfer.runner.structured import _json_schema_grammar

    vocab = [bytes([i]) for i in range(256)]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW))
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "minLength": 2, "maxLength": 3}, "b": {"type": "string"}},
        "required": ["a", "b"], "additionalProperties": False}
    grammar = compiler.compile_grammar(_json_schema_grammar(json.dumps(schema)))

    def accepts(text: bytes) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(b) for b in text) and matcher.is_completed()

    assert accepts('{"a": "é\U00102de7", "b": "\\u00e9\\n\\""}'.encode())
    assert not accepts(b'{"a": "x\\n", "b": ""}')  # no escapes in a bounded string
    assert not accepts(b'{"a": "x\xed\xb7\xa7", "b": ""}')  # a surrogate in a bounded string
    assert not accepts(b'{"a": "xy", "b": "\xed\xa0\x80"}')  # ... and in a free one
    assert not accepts(b'{"a": "x\x01", "b": ""}')  # raw control characters are not JSON
    assert not accepts(b'{"a": "abcd", "b": ""}')  # 4 > maxLength
