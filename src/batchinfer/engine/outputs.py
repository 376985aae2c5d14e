"""Results handed to users; shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from batchinfer.core.outputs import TokenLogprobs
from batchinfer.core.request import RequestMetrics

__all__ = [
    "CompletionOutput",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStats",
]


class RequestOutputKind(Enum):
    """What each `RequestOutput` of a request carries (vLLM's names).

    CUMULATIVE: after every step, everything so far (text, token ids, logprobs).
    DELTA: after every step that changed it, only what is new (what a stream sends).
    FINAL_ONLY: one output, everything, when the request finishes (what `LLM.generate` and
    non-streamed server requests need; the cheapest).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (`index` among the request's `n`). `text`, `token_ids` and
    `logprobs` are everything so far, or only the new part for `RequestOutputKind.DELTA`;
    `cumulative_logprob` is always the total."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Set when an elastic output cap (under KV pressure) ended it: the cap, in tokens.
    elastic_max_tokens: int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request after a step: its `n` sequences (for DELTA, only those that changed),
    `finished` when all are. `error` says why the engine failed it (finish reason "abort")
    and `error_code` what kind of failure it is (`core.outputs.QUEUE_TIMEOUT`, ...)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_code: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass(slots=True)
class RequestStats:
    """What one step (or an abort) did to one request, whatever its output kind: for metrics.

    `metrics` is the request's own record (read it on the thread that processes outputs);
    `finish_reasons` (one per sequence), `error_code` and `num_elastic_truncations` are set on
    the request's last stats.
    """

    request_id: str
    num_prompt_tokens: int
    num_new_tokens: int
    metrics: RequestMetrics
    priority_class: str = "interactive"
    finish_reasons: list[str] | None = None
    error_code: str | None = None
    num_elastic_truncations: int = 0
