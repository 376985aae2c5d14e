"""Results handed to users; shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchinfer.core.outputs import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (`index` among the request's `n`). `text` is cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Monotonic timestamps (seconds) and counts of one request; for metrics and benchmarks."""

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
class RequestOutput:
    """A request's state after a step: all its `n` sequences so far, `finished` when all are."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    # Token ids each sequence gained in this step, by index (for streaming consumers).
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
