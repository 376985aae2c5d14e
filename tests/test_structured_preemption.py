"""Structured outputs through preemption, prefix caching and `n > 1` on a tiny random model: a
cache too small for the batch makes the scheduler preempt constrained sequences (recompute and
swap); their matchers are dropped and replayed from the token history, so every output is the
one a roomy cache gives, token for token, and still matches its spec."""

from __future__ import annotations

import json
import re

import pytest

from batchinfer import LLM, SamplingParams
from batchinfer.core.structured_output import StructuredOutput
from tests.tiny_models import make_tiny_llama

# 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes = 512 bytes a token, 8 KiB a 16-token block.
BLOCK_BYTES = 8192
LONG_REGEX = "[a-c]{70}-[0-9]{8}"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 20, "maxLength": 30},
                         "scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                               "maximum": 9},
                                    "minItems": 12, "maxItems": 12}},
          "required": ["name", "scores"], "additionalProperties": False}


def _requests() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(8):
        spec = StructuredOutput(regex=LONG_REGEX) if i % 2 else StructuredOutput(json_schema=SCHEMA)
        prompts.append(f"request {i} " * (1 + i % 3))
        params.append(SamplingParams(max_tokens=200, temperature=0, structured_output=spec))
    return prompts, params


def _check(text: str, spec: StructuredOutput) -> None:
    if spec.regex is not None:
        assert re.fullmatch(LONG_REGEX, text), text
    else:
        value = json.loads(text)
        assert 20 <= len(value["name"]) <= 30
        assert len(value["scores"]) == 12 and all(0 <= s <= 9 for s in value["scores"])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def reference(model):
    prompts, params = _requests()
    outs = LLM(model, max_model_len=256, kv_cache_memory=16 << 20).generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_sequences_resume_exactly(model, reference, mode):
    llm = LLM(model, max_model_len=256, kv_cache_memory=20 * BLOCK_BYTES, preemption_mode=mode,
              swap_space=64 * BLOCK_BYTES)
    prompts, params = _requests()
    outs = llm.generate(prompts, params)
    scheduler = llm.engine.core.scheduler
    assert scheduler.preemptions_by_mode[mode] > 0
    for out, want, p in zip(outs, reference, params, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop"
        assert completion.token_ids == want
        assert p.structured_output is not None
        _check(completion.text, p.structured_output)


def test_prefix_cache_hits_and_n_copies_keep_their_own_matchers(model):
    llm = LLM(model, max_model_len=256, enable_prefix_caching=True, kv_cache_memory=16 << 20)
    spec = StructuredOutput(json_schema=SCHEMA)
    prompt = "a shared prefix that fills more than one cache block of sixteen tokens " * 2
    first = llm.generate([prompt], SamplingParams(max_tokens=200, temperature=0,
                                                  structured_output=spec))[0].outputs[0]
    # the same prompt again reads its blocks from the prefix cache: the same constrained output
    again = llm.generate([prompt], SamplingParams(max_tokens=200, temperature=0,
                                                  structured_output=spec))[0].outputs[0]
    assert again.token_ids == first.token_ids
    _check(first.text, spec)
    sampled = llm.generate([prompt], SamplingParams(n=4, max_tokens=200, temperature=1.0, seed=7,
                                                    structured_output=spec))[0].outputs
    assert len(sampled) == 4 and len({tuple(c.token_ids) for c in sampled}) > 1
    for completion in sampled:
        assert completion.finish_reason == "stop"
        _check(completion.text, spec)
