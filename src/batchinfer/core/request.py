"""A generation request as the scheduler sees it: token ids, progress, status and timings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from batchinfer.core.sampling_params import SamplingParams

# The two named priority classes (`service_tier`) and their default priorities: lower runs first
# (vLLM's meaning). A request without a tier is in the class its priority falls in.
PRIORITY_CLASSES = {"interactive": 0, "batch": 10}
INTERACTIVE_PRIORITY = PRIORITY_CLASSES["interactive"]
BATCH_PRIORITY = PRIORITY_CLASSES["batch"]
# The range a priority may take (32-bit): room for any ordering a deployment needs.
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class SchedulingOptions:
    """How the scheduler treats one request; every field is optional.

    `priority`: lower runs first, in [`PRIORITY_MIN`, `PRIORITY_MAX`] (default: the tier's,
    else 0). `service_tier`: "interactive" or "batch" (default: "batch" when `priority` >= the
    batch class's, else "interactive").
    `timeout_s`: the most time it may spend waiting in the queue, in all (default: the engine's
    `max_queue_time_ms`). `max_tokens_fixed`: False when the user did not choose `max_tokens`,
    so `elastic_max_tokens` may lower it under pressure.
    """

    priority: int | None = None
    service_tier: str | None = None
    timeout_s: float | None = None
    max_tokens_fixed: bool = True

    def __post_init__(self) -> None:
        if self.priority is not None and (
            isinstance(self.priority, bool) or not isinstance(self.priority, int)
        ):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.priority is not None and not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ValueError(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                             f"got {self.priority}")
        if self.service_tier is not None and self.service_tier not in PRIORITY_CLASSES:
            raise ValueError(f"service_tier must be one of {', '.join(PRIORITY_CLASSES)}; "
                             f"got {self.service_tier!r}")
        if self.timeout_s is not None and (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not math.isfinite(self.timeout_s)
            or self.timeout_s < 0
        ):
            raise ValueError(f"timeout must be a finite number of seconds >= 0, "
                             f"got {self.timeout_s!r}")

    @property
    def resolved_priority(self) -> int:
        if self.priority is not None:
            return self.priority
        return PRIORITY_CLASSES[self.service_tier or "interactive"]

    @property
    def priority_class(self) -> str:
        if self.service_tier is not None:
            return self.service_tier
        return "batch" if self.resolved_priority >= BATCH_PRIORITY else "interactive"


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
    `num_computed_tokens` of them (in device blocks, or while swapped out in `swap_blocks`)."""

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
    # Scheduling (see `SchedulingOptions`): priority (lower first), its class, the queue time
    # limit, and whether elastic caps may lower its max_tokens.
    priority: int = 0
    priority_class: str = "interactive"
    queue_timeout_s: float | None = None
    elastic: bool = False
    # Set by the scheduler: the elastic output cap once applied (and whether it ended the
    # request), the effective priority the request was admitted with (what protects it from
    # priority preemption), and queue time: waits before the current one + when it began.
    max_tokens_cap: int | None = None
    elastic_truncated: bool = False
    admitted_rank: float = 0.0
    waited_s: float = 0.0
    # Swapped out: the host blocks holding the KV of its first `num_computed_tokens` tokens,
    # copied back into device blocks when it resumes (empty: nothing swapped).
    swap_blocks: list[int] = field(default_factory=list)
    # Speculative decoding: its proposed tokens accepted and verified (accepted, and the first
    # rejected of each proposal), counted with a fading memory (`scheduling.speculation`).
    spec_accepted: float = 0.0
    spec_verified: float = 0.0
    # Its preemption count when it first proposed with a draft model (None: never): the draft
    # model's K/V of its context is written from then on, until a preemption.
    spec_draft_started: int | None = None
    # The block number `swap_blocks[0]` holds (those before it were dropped outside the
    # sliding window before it was swapped out).
    swap_first_block: int = 0
    wait_start_s: float = field(init=False)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_s=self.arrival_s)
        self.wait_start_s = self.arrival_s

    def apply(self, options: SchedulingOptions) -> None:
        """Take a request's scheduling options."""
        self.priority = options.resolved_priority
        self.priority_class = options.priority_class
        self.queue_timeout_s = options.timeout_s
        self.elastic = not options.max_tokens_fixed

    def time_waiting_s(self, now: float) -> float:
        """Time spent waiting so far, in all (while waiting: including the current wait)."""
        if self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return self.waited_s + (now - self.wait_start_s)
        return self.waited_s

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
