"""Turns the engine core's `EngineCoreOutput`s into user-facing `RequestOutput`s.

One `OutputProcessor` serves `LLM.generate` (cumulative or final-only outputs) and `AsyncLLM`
(deltas for streams); it runs on the thread that consumes outputs, never on the engine thread
behind `AsyncLLM`. It detokenizes, finds stop strings, gathers the `n` sequences of a request,
and holds the only map from a request to its sequences' scheduler ids.

Work per request is linear in its output length for DELTA and FINAL_ONLY: each step handles only
that step's tokens and hands out only new text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from batchinfer.core.outputs import EngineCoreOutput, TokenLogprobs
from batchinfer.core.request import RequestMetrics
from batchinfer.engine.detokenizer import IncrementalDetokenizer
from batchinfer.engine.outputs import (
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    RequestStats,
)
from batchinfer.engine.processor import EngineRequest


@dataclass(slots=True)
class _Sequence:
    index: int
    child_id: str
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    # DELTA: tokens and logprobs since the last output; otherwise everything so far.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    elastic_max_tokens: int | None = None
    changed: bool = False


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    sequences: list[_Sequence]
    metrics: RequestMetrics
    priority_class: str
    error: str | None = None
    error_code: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


@dataclass(slots=True)
class ProcessedOutputs:
    """The result of one step's core outputs (or of an abort).

    `outputs`: what to hand to each request's consumer (by its output kind);
    `stats`: one entry per request the step touched, for metrics;
    `stopped`: `(scheduler id, stop string)` of sequences a stop string ended, and
    `to_abort`: scheduler ids of the other sequences of requests that failed; the caller must
    finish both in the engine core. `failed`: request id -> (error message, error code).
    """

    outputs: list[RequestOutput] = field(default_factory=list)
    stats: list[RequestStats] = field(default_factory=list)
    stopped: list[tuple[str, str]] = field(default_factory=list)
    to_abort: list[str] = field(default_factory=list)
    failed: dict[str, tuple[str, str | None]] = field(default_factory=dict)


class OutputProcessor:
    """Per-request detokenizers, output assembly, and the request -> sequences map."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._parent_of: dict[str, tuple[_RequestState, _Sequence]] = {}

    def add_request(
        self, request: EngineRequest, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    ) -> None:
        """Register a processed request; `ValueError` if its id is in use."""
        if request.request_id in self._states:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if any(child.request_id in self._parent_of for child in request.sequences):
            raise RuntimeError(f"request {request.request_id!r}: a sequence id is in use")
        params = request.params
        sequences = []
        for index, child in enumerate(request.sequences):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            seq = _Sequence(index, child.request_id, detokenizer)
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            sequences.append(seq)
        state = _RequestState(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            kind,
            sequences,
            RequestMetrics(request.arrival_s),
            request.priority_class,
        )
        self._states[request.request_id] = state
        for seq in sequences:
            self._parent_of[seq.child_id] = (state, seq)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def child_ids(self, request_id: str) -> list[str]:
        """Scheduler ids of a request's unfinished sequences ([] if unknown or finished)."""
        state = self._states.get(request_id)
        if state is None:
            return []
        return [s.child_id for s in state.sequences if s.finish_reason is None]

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._states)

    def parent_ids(self, core_outputs: list[EngineCoreOutput]) -> list[str]:
        """The (unfinished) requests the given core outputs belong to."""
        parents = (self._parent_of.get(o.request_id) for o in core_outputs)
        return list(dict.fromkeys(located[0].request_id for located in parents if located))

    # ----------------------------------------------------------------- processing
    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's core outputs."""
        result = ProcessedOutputs()
        touched: dict[str, tuple[_RequestState, int]] = {}
        for core_output in core_outputs:
            located = self._parent_of.get(core_output.request_id)
            if located is None:
                continue  # aborted or failed meanwhile
            state, seq = located
            if seq.finish_reason is not None:
                continue
            num_before = seq.num_tokens
            stop_string = self._apply(seq, core_output)
            if stop_string is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_string
                result.stopped.append((seq.child_id, stop_string))
            elif core_output.finished:
                seq.detokenizer.flush()
                seq.finish_reason = core_output.finish_reason.value  # type: ignore[union-attr]
                seq.stop_reason = core_output.stop_reason
                seq.elastic_max_tokens = core_output.elastic_cap
            if core_output.error is not None and state.error is None:
                state.error, state.error_code = core_output.error, core_output.error_code
                result.failed[state.request_id] = (core_output.error, core_output.error_code)
            _record(state.metrics, core_output)
            _, num_new = touched.get(state.request_id, (state, 0))
            touched[state.request_id] = (state, num_new + seq.num_tokens - num_before)
        for state, num_new in touched.values():
            if state.error is not None:
                result.to_abort.extend(self._abort_unfinished(state))
            self._emit(state, num_new, result)
        return result

    def abort(self, request_id: str) -> ProcessedOutputs:
        """Mark every unfinished sequence of a request aborted; its final output (if the
        request was known) is in `outputs`, whatever its kind."""
        result = ProcessedOutputs()
        state = self._states.get(request_id)
        if state is not None:
            self._abort_unfinished(state)
            self._emit(state, 0, result)
        return result

    @staticmethod
    def _abort_unfinished(state: _RequestState) -> list[str]:
        """Finish the request's unfinished sequences as aborted; returns their scheduler ids."""
        child_ids = []
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.detokenizer.flush()
                seq.finish_reason = "abort"
                seq.changed = True
                child_ids.append(seq.child_id)
        return child_ids

    def _apply(self, seq: _Sequence, core_output: EngineCoreOutput) -> str | None:
        new_ids = core_output.new_token_ids
        stop_string = seq.detokenizer.add_tokens(new_ids)
        if stop_string is not None:
            # Several tokens in one step (speculative decoding): the output ends with the
            # token that completed the stop string, as it would one token a step.
            new_ids = new_ids[: seq.detokenizer.num_read]
        seq.num_tokens += len(new_ids)
        seq.token_ids.extend(new_ids)
        if seq.logprobs is not None:
            for entry in core_output.new_logprobs[: len(new_ids)]:
                seq.logprobs.append(entry)
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + entry.logprob
        seq.changed = True
        return stop_string

    def _emit(self, state: _RequestState, num_new_tokens: int, result: ProcessedOutputs) -> None:
        finished = state.finished
        stats = RequestStats(
            state.request_id, len(state.prompt_token_ids), num_new_tokens, state.metrics,
            state.priority_class,
        )
        result.stats.append(stats)
        if finished:
            stats.finish_reasons = [s.finish_reason or "abort" for s in state.sequences]
            stats.error_code = state.error_code
            stats.num_elastic_truncations = sum(
                s.elastic_max_tokens is not None for s in state.sequences)
            for seq in state.sequences:
                self._parent_of.pop(seq.child_id, None)
            del self._states[state.request_id]
        if state.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return
        delta = state.kind == RequestOutputKind.DELTA
        completions = []
        for seq in state.sequences:
            if delta and not seq.changed:
                continue
            completions.append(_completion(seq, delta))
            seq.changed = False
        result.outputs.append(
            RequestOutput(
                request_id=state.request_id,
                prompt=state.prompt,
                prompt_token_ids=state.prompt_token_ids,
                outputs=completions,
                finished=finished,
                metrics=dataclasses.replace(state.metrics),  # a snapshot: the state goes on
                error=state.error,
                error_code=state.error_code,
            )
        )


def _completion(seq: _Sequence, delta: bool) -> CompletionOutput:
    finished = seq.finish_reason is not None
    if delta:
        token_ids, seq.token_ids = seq.token_ids, []
        logprobs = seq.logprobs
        if logprobs is not None:
            seq.logprobs = []
        text = seq.detokenizer.take_delta(finished)
    else:
        token_ids = list(seq.token_ids)
        logprobs = list(seq.logprobs) if seq.logprobs is not None else None
        text = seq.detokenizer.text(finished)
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        elastic_max_tokens=seq.elastic_max_tokens,
    )


def _record(metrics: RequestMetrics, core_output: EngineCoreOutput) -> None:
    """Fold one sequence's timestamps into the request's: the first of its sequences' firsts,
    the latest finish."""
    if metrics.first_scheduled_s is None:
        metrics.first_scheduled_s = core_output.first_scheduled_s
    if metrics.first_token_s is None:
        metrics.first_token_s = core_output.first_token_s
    if core_output.last_token_s is not None:
        metrics.last_token_s = max(metrics.last_token_s or 0.0, core_output.last_token_s)
    metrics.num_preemptions = max(metrics.num_preemptions, core_output.num_preemptions)
    if core_output.finished_s is not None:
        metrics.finished_s = max(metrics.finished_s or 0.0, core_output.finished_s)
