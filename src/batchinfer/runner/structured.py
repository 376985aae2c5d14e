"""Structured outputs: grammars compiled once per distinct spec, a matcher per sequence, and
one token bitmask for the whole batch per step (xgrammar).

- `compile(spec)` turns a `StructuredOutput` into xgrammar's compiled grammar, cached in a
  bounded LRU (`max_cached_grammars` distinct specs); the engine's processor calls it before a
  request is queued, off the engine thread where the server runs it, so a schema that does not
  compile is a `ParamError` (HTTP 400) and never reaches a step. The tokenizer's vocabulary is
  read once, at the first compile (xgrammar's `TokenizerInfo`, as wide as the model's logits).
- `fill(sequences)` gives each constrained row of a step its matcher, brings the matcher up to
  the sequence's output so far, and fills every row of one bitmask in one batched call (its
  threads are xgrammar's). The runner starts it (`start_fill`) on a worker thread before the
  step's forward and takes the mask after it: the host work of the masks overlaps the model's.
  The sampler applies the `GrammarMask` to the logits before anything else, so reported
  logprobs are those of the constrained distribution (vLLM's order).

A matcher is a cache of "the grammar's state after this sequence's output tokens": the
truth is the token history the scheduler sends with every constrained sampling row
(`ScheduledSequence.all_token_ids`). Each step the matcher accepts the tokens it has not seen
(normally the one sampled last step); when it is ahead of the history (a step that failed and
is rerun) or missing (dropped when the sequence left, including a preemption: its id is in
`finished_request_ids`), it is reset and replays the history. So recompute, swap, prefix
caching and failure reruns all leave it right, and `n > 1` sequences each have their own.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
import xgrammar as xgr
from xgrammar.builtin_structural_tag import get_model_structural_tag

from batchinfer.core.outputs import ScheduledSequence
from batchinfer.core.structured_output import StructuredOutput
from batchinfer.core.validation import ParamError

# xgrammar's C++ errors start with a timestamp, a source location and an assertion's text.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: \(.*?\) is false: )?")
# Tool-call syntaxes: ours -> xgrammar's structural-tag template of that syntax.
# `hermes`: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Qwen 2.5 / 3, Hermes);
# `llama3_json`: `{"name": ..., "parameters": {...}}` (Llama 3.1 - 3.3).
TOOL_FORMATS = {"hermes": "qwen_3", "llama3_json": "llama"}
# `json_object`: any JSON object.
_JSON_OBJECT = '{"type": "object"}'
# xgrammar (0.2.9) writes a JSON string's characters as classes of code points that let two
# kinds of invalid output through: a string with minLength / maxLength is
# `[^"\\\r\n]{m,n}` (raw control characters allowed, which `json.loads` refuses), and every
# class admits the UTF-16 surrogates U+D800-U+DFFF, whose UTF-8 form is no valid UTF-8 (a
# byte-level vocabulary can spell them; they decode to U+FFFD, one per byte, and a bounded
# string comes out too long). Both classes become "a code point but C0, quote, backslash and
# the surrogates". A bounded string thus holds no escapes (as xgrammar has it: each repetition
# one character); allowing them, `(char | escape){m,n}`, made each row's mask tens of times
# slower to fill (docs/server.md).
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_JSON_CODE_POINT = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


@dataclass(slots=True)
class GrammarMask:
    """The step's allowed tokens: `bitmask` `[num_rows, ceil(vocab / 32)]` int32 (bit j of row
    i set: token j allowed), aligned with the sampler's logits rows; only `rows` are
    constrained."""

    bitmask: torch.Tensor
    rows: list[int]
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens of the constrained rows to -inf, in place."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                        indices=self.rows)


@dataclass(slots=True)
class _SequenceGrammar:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher has accepted


class StructuredOutputs:
    """Grammar compilation (cached, thread-safe) and the per-sequence matchers of one model.

    `tokenizer` is the model's Hugging Face tokenizer, `vocab_size` the width of its logits,
    `eos_token_ids` the tokens that end a sequence (a complete grammar allows only them).
    `compile` may be called from any thread; `fill` and `forget` from the engine thread only.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Collection[int],
        max_cached_grammars: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_cached_grammars = max_cached_grammars
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._grammars: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._sequences: dict[str, _SequenceGrammar] = {}
        self._bitmask: torch.Tensor | None = None
        self._batch = xgr.BatchGrammarMatcher()
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    # ----------------------------------------------------------------- compilation
    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`, from the cache or compiled now; `ParamError`
        (param `structured_output`) when it does not compile or admits no output."""
        with self._lock:
            grammar = self._grammars.get(spec)
            if grammar is not None:
                self._grammars.move_to_end(spec)
                return grammar
        grammar = self._compile_uncached(spec)  # outside the lock: compiles run in parallel
        with self._lock:
            self._grammars[spec] = grammar
            self._grammars.move_to_end(spec)
            while len(self._grammars) > self.max_cached_grammars:
                self._grammars.popitem(last=False)
        return grammar

    @property
    def num_cached_grammars(self) -> int:
        return len(self._grammars)

    def _compile_uncached(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._compiler_once()
        try:
            if spec.json_schema is not None or spec.json_object:
                grammar = compiler.compile_grammar(_json_schema_grammar(
                    spec.json_schema or _JSON_OBJECT))
            elif spec.regex is not None:
                grammar = compiler.compile_regex(spec.regex)
            elif spec.choice is not None:
                # JSON string literals are EBNF string literals (the same escapes).
                grammar = compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            elif spec.structural_tag is not None:
                grammar = compiler.compile_structural_tag(_with_our_json(
                    json.loads(spec.structural_tag)))
            else:
                grammar = compiler.compile_grammar(spec.grammar or "")
        except (RuntimeError, ValueError, TypeError) as exc:
            detail = _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc) else "")
            raise ParamError(f"structured_output ({spec.kind}) does not compile: {detail}",
                             "structured_output") from None
        if not self._admits_a_token(grammar):
            raise ParamError(f"structured_output ({spec.kind}) admits no output: no token "
                             "of this model's vocabulary can start it", "structured_output")
        return grammar

    def _compiler_once(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                try:
                    info = xgr.TokenizerInfo.from_huggingface(
                        self.tokenizer, vocab_size=self.vocab_size,
                        stop_token_ids=self.eos_token_ids)
                except Exception as exc:  # a tokenizer xgrammar cannot read
                    raise ParamError(f"structured_output needs a Hugging Face tokenizer "
                                     f"xgrammar can read: {exc}", "structured_output") from None
                # Its own cache is off: `_grammars` is the one bounded cache.
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def _admits_a_token(self, grammar: xgr.CompiledGrammar) -> bool:
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    # ----------------------------------------------------------------- per step
    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the matchers of sequences that left (finished, aborted or preempted)."""
        for request_id in request_ids:
            self._sequences.pop(request_id, None)

    def start_fill(self, sequences: Sequence[ScheduledSequence]) -> Future[GrammarMask | None] \
            | None:
        """`fill(sequences)` started on this object's worker thread (xgrammar fills without
        the GIL, so it overlaps the step's forward); None when no row is constrained. At most
        one fill runs at a time: the caller waits for its result before the next step."""
        if not any(seq.sampling_params.structured_output is not None for seq in sequences):
            return None
        return self._filler.submit(self.fill, sequences)

    def fill(self, sequences: Sequence[ScheduledSequence]) -> GrammarMask | None:
        """The mask of one step's sampling rows (`sequences[i]` is logits row i); None when no
        row is constrained. `RuntimeError` names a sequence whose history breaks its grammar."""
        rows: list[int] = []
        matchers: list[xgr.GrammarMatcher] = []
        for row, seq in enumerate(sequences):
            spec = seq.sampling_params.structured_output
            if spec is None:
                continue
            state = self._sequences.get(seq.request_id)
            if state is None:
                state = _SequenceGrammar(xgr.GrammarMatcher(self.compile(spec)))
                self._sequences[seq.request_id] = state
            _catch_up(state, seq)
            rows.append(row)
            matchers.append(state.matcher)
        if not rows:
            return None
        bitmask = self._bitmask_rows(len(sequences))
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return GrammarMask(bitmask, rows, self.vocab_size)

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        """A view of `num_rows` rows of the bitmask buffer (grown, never shrunk)."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        return self._bitmask[:num_rows]

    @property
    def num_matchers(self) -> int:
        return len(self._sequences)


def _json_schema_grammar(schema: str) -> str:
    """The EBNF of a JSON schema, as xgrammar writes it, with strings' characters made JSON's
    (valid UTF-8, no raw control characters). No whitespace but xgrammar's `, ` and `: ` separators: free whitespace lets a
    small model spend its whole budget on spaces and newlines."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    text = str(grammar).replace(_BOUNDED_STRING_CHAR, _JSON_CODE_POINT)
    return text.replace(_STRING_CHAR, _JSON_CODE_POINT)


def _with_our_json(node: Any) -> Any:
    """A structural tag's format tree with each `json_schema` format replaced by the grammar
    `_json_schema_grammar` writes for it (JSON's strings, our whitespace), as plain data."""
    if isinstance(node, list):
        return [_with_our_json(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
        return {"type": "grammar", "grammar": _json_schema_grammar(json.dumps(node["json_schema"]))}
    return {key: _with_our_json(value) for key, value in node.items()}


def tool_call_tag(
    tool_format: str,
    tools: Sequence[dict[str, Any]],
    tool_choice: Literal["required"] | dict[str, Any],
    parallel_tool_calls: bool,
) -> dict[str, Any]:
    """The structural tag (plain data) that makes a model call tools in its own syntax:
    `tool_format` is one of `TOOL_FORMATS`' keys, `tools` OpenAI's function tools, `tool_choice`
    `"required"` (one call or more; one with `parallel_tool_calls` false) or a named function
    `{"type": "function", "function": {"name": ...}}` (exactly that one call). xgrammar writes
    the syntax of each format; `ValueError` for a choice it cannot build."""
    tag = get_model_structural_tag(
        TOOL_FORMATS[tool_format], tools=list(tools), tool_choice=tool_choice,
        reasoning="disabled", parallel_tool_calls=parallel_tool_calls)
    data: dict[str, Any] = tag.model_dump(mode="json")
    return data


def _catch_up(state: _SequenceGrammar, seq: ScheduledSequence) -> None:
    """Bring a matcher to the sequence's `sample_index` output tokens (its history)."""
    wanted = seq.sample_index
    if state.num_accepted == wanted:
        return
    if state.num_accepted > wanted:  # tokens of a step that did not count: replay
        state.matcher.reset()
        state.num_accepted = 0
    if seq.all_token_ids is None:
        raise RuntimeError(f"request {seq.request_id}: its grammar needs all_token_ids")
    start = seq.num_prompt_tokens
    for token_id in seq.all_token_ids[start + state.num_accepted : start + wanted]:
        if not state.matcher.accept_token(token_id):
            raise RuntimeError(f"request {seq.request_id}: token {token_id} of its output "
                               "breaks its grammar")
        state.num_accepted += 1
    if state.matcher.is_terminated():
        raise RuntimeError(f"request {seq.request_id}: its grammar has ended but the "
                           "sequence goes on")
