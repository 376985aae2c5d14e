"""A generation request as the scheduler sees it: token ids, progress, status and timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from batchinfer.core.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    """Lifecycle: WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED_*."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


class FinishReason(StrEnum):
    """OpenAI's `finish_reason` values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(slots=True)
class RequestMetrics:
    """Monotonic timestamps (seconds; None until the event happens) and the preemption count of
    one request. The scheduler keeps one per sequence; the output processor one per request,
    filled from the plain values each `EngineCoreOutput` carries."""

    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time_s(self) -> float | None:
        if self.first_scheduled_s is None:
            return None
        return self.first_scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s


@dataclass(slots=True)
class Request:
    """One sequence to generate. `all_token_ids` = prompt + output; KV holds the first
    `num_computed_tokens` of them."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_s: float
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Token id (from stop_token_ids or EOS) that stopped the request, or a stop string set by the
    # engine's detokenizer.
    stop_reason: int | str | None = None
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_s=self.arrival_s)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_preemptions(self) -> int:
        return self.metrics.num_preemptions

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
