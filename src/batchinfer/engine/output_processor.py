"""Turns the scheduler's token updates into user-facing `RequestOutput`s.

Runs wherever outputs are consumed (in the caller's thread for `LLM.generate`, off the step loop
for the server): detokenizes, finds stop strings, gathers the `n` sequences of a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchinfer.core.request import Request
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.core.scheduler import RequestUpdate
from batchinfer.engine.detokenizer import IncrementalDetokenizer
from batchinfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass(slots=True)
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The scheduler-side id of sequence `index` of a request with `n` sequences."""
    return request_id if n == 1 else f"{request_id}#{index}"


class OutputProcessor:
    """Per-request detokenizers and output assembly."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
    ) -> list[str]:
        """Register a request; returns the child ids the scheduler will know it by."""
        sequences = []
        child_ids = []
        for index in range(params.n):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            seq = _Sequence(index, detok)
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            sequences.append(seq)
            child_id = child_request_id(request_id, index, params.n)
            self._child_to_parent[child_id] = (request_id, index)
            child_ids.append(child_id)
        self._states[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, sequences, RequestMetrics(arrival_s)
        )
        return child_ids

    def child_ids(self, request_id: str) -> list[str]:
        state = self._states.get(request_id)
        if state is None:
            return []
        n = len(state.sequences)
        return [child_request_id(request_id, s.index, n) for s in state.sequences]

    def process(
        self, updates: list[RequestUpdate]
    ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Apply one step's updates. Returns the outputs of the requests that changed, and
        `(child_id, stop_string)` pairs the caller must finish in the scheduler."""
        touched: dict[str, RequestOutput | None] = {}
        new_ids: dict[str, dict[int, list[int]]] = {}
        stops: list[tuple[str, str]] = []
        for update in updates:
            located = self._child_to_parent.get(update.request.request_id)
            if located is None:
                continue
            parent_id, index = located
            state = self._states[parent_id]
            seq = state.sequences[index]
            if seq.finish_reason is not None:
                continue
            stop_string = self._apply(seq, update)
            if stop_string is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_string
                stops.append((update.request.request_id, stop_string))
            elif update.finished:
                seq.detokenizer.flush()
                reason = update.request.status.finish_reason
                seq.finish_reason = reason.value if reason is not None else "stop"
                seq.stop_reason = update.request.stop_reason
            self._record_metrics(state.metrics, update.request)
            new_ids.setdefault(parent_id, {})[index] = update.new_token_ids
            touched[parent_id] = None
        outputs = [self._snapshot(rid, new_ids.get(rid, {})) for rid in touched]
        return outputs, stops

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sequence of a request aborted; returns its final output."""
        state = self._states.get(request_id)
        if state is None:
            return None
        for seq in state.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return self._snapshot(request_id, {})

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def _apply(self, seq: _Sequence, update: RequestUpdate) -> str | None:
        seq.token_ids.extend(update.new_token_ids)
        if seq.logprobs is not None:
            for lp in update.new_logprobs:
                seq.logprobs.append(lp)
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + lp.logprob
        return seq.detokenizer.add_tokens(update.new_token_ids)

    @staticmethod
    def _record_metrics(metrics: RequestMetrics, request: Request) -> None:
        t = request.timings
        if metrics.first_scheduled_s is None:
            metrics.first_scheduled_s = t.first_scheduled_s
        if metrics.first_token_s is None:
            metrics.first_token_s = t.first_token_s
        metrics.last_token_s = t.last_token_s
        metrics.num_preemptions = max(metrics.num_preemptions, request.num_preemptions)
        if request.is_finished:
            metrics.finished_s = t.finished_s

    def _snapshot(self, request_id: str, new_ids: dict[int, list[int]]) -> RequestOutput:
        state = self._states[request_id]
        finished = state.finished
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detokenizer.visible_text(s.finish_reason is not None),
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in state.sequences
        ]
        if finished:
            for child_id in self.child_ids(request_id):
                self._child_to_parent.pop(child_id, None)
            del self._states[request_id]
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=state.metrics,
            new_token_ids=new_ids,
        )
