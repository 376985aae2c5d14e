"""The plain records that cross the engine's boundaries.

- core <-> runner: `SchedulerOutput` goes down to the runner; `ModelRunnerOutput` comes back up
  to `Scheduler.update_from_output()`. The runner never sees a live `Request`; the scheduler
  never sees a tensor.
- engine thread -> consumers: `EngineCoreOutput` (one per sequence that changed in a step) and
  `SchedulerStats` (one per step). They hold only values copied out of the scheduler's state,
  so another thread may read them while the engine thread goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchinfer.core.request import FinishReason
from batchinfer.core.sampling_params import SamplingParams

# `EngineCoreOutput.error_code`: why the engine ended a request without an answer.
ENGINE_ERROR = "engine_error"  # the runner failed on it (alone too)
QUEUE_TIMEOUT = "queue_timeout"  # it waited longer than its queue time limit


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: a prefill chunk or a single decode token.

    Invariant: `token_ids` are the sequence's tokens at positions
    `[num_computed_tokens, num_computed_tokens + len(token_ids))`, and `block_table` holds enough
    blocks for all of them. `all_token_ids` (prompt + output so far) is what penalties look at.
    `block_table[0]` is the sequence's block number `num_dropped_blocks`: the blocks before it
    lay wholly outside every layer's sliding window and were freed (the model reads no key
    there).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    # True when this chunk ends at the sequence's last known token, so a new token is sampled.
    sample: bool
    sampling_params: SamplingParams
    num_prompt_tokens: int
    # Prompt + output tokens so far; only filled when `sample` and a penalty needs them.
    all_token_ids: list[int] | None = None
    # Index of the token about to be sampled (== number of output tokens so far): with `seed`,
    # the runner derives this step's random stream from (seed, sample_index), so a preempted and
    # recomputed request, or one batched with others, draws the same numbers.
    sample_index: int = 0
    # Speculative decoding: tokens proposed after this chunk, verified in the same step (their
    # blocks are in `block_table`). `spec_token_ids` holds them when the scheduler proposed them
    # (ngram); None with `num_spec_tokens` > 0: the runner's draft model proposes them.
    num_spec_tokens: int = 0
    spec_token_ids: list[int] | None = None
    num_dropped_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the runner needs for one forward step, in batch order."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    # Requests that left since the previous step (finished, aborted, preempted): the runner drops
    # any per-request state it keeps for them.
    finished_request_ids: list[str] = field(default_factory=list)
    # KV blocks to copy before the step runs, swap-outs first: (device block, host block) pairs
    # out to the swap space, then (host block, device block) pairs back in.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the step computes: chunks and decodes, and proposed tokens."""
        return sum(len(s.token_ids) + s.num_spec_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        """No sequence runs (swaps may still be due: `has_swaps`)."""
        return not self.sequences

    @property
    def has_swaps(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top-N alternatives at one position."""

    token_id: int
    logprob: float
    rank: int
    # [(token_id, logprob)] sorted by logprob, best first; length = requested `logprobs`.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced, aligned with `SchedulerOutput.sequences`.

    `sampled_token_ids[i]` is the new token of sequence i, or None when that sequence only
    computed a prefill chunk that does not end the prompt. With speculative decoding,
    `accepted_token_ids[i]` are the proposed tokens of sequence i the step accepted (their KV is
    computed), which come before `sampled_token_ids[i]` in its output, with their logprobs in
    `accepted_logprobs[i]` (where logprobs were asked for); None: no sequence verified any.
    """

    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None] | None = None
    accepted_token_ids: list[list[int]] | None = None
    accepted_logprobs: list[list[TokenLogprobs]] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step changed for one sequence (scheduler id), as plain values.

    `new_token_ids` / `new_logprobs` are this step's tokens only. `finish_reason` is set once,
    on the sequence's last output; `error` says why the engine failed it (finish reason ABORT)
    and `error_code` what kind of failure that is (`ENGINE_ERROR`, `QUEUE_TIMEOUT`).
    `elastic_cap` is the output cap that ended it when that was an elastic cap (finish reason
    LENGTH). The timestamps are the engine clock's (seconds), copied from the sequence's metrics.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_code: str | None = None
    elastic_cap: int | None = None
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding, cumulative counts (vLLM's): verifications (`num_drafts`: a
    sequence's proposed tokens scored in one step), tokens proposed and accepted, accepted by
    position in the proposal; and the depth the last step chose: proposed tokens per sequence
    that could propose (`depth`), and the most any sequence proposed (`max_depth`)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    depth: float = 0.0
    max_depth: int = 0


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's state after one step, for metrics and logs."""

    time_s: float  # engine clock when the step's tokens were recorded
    num_scheduled_tokens: int  # tokens computed in the step (0: no step ran)
    num_scheduled_seqs: int  # sequences in the step
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_preemptions_total: int
    # Cumulative preemptions by (reason, mode). Reason: "kv_full" (a running request needed a
    # block) or "priority" (room for a waiting request of higher priority); mode: "recompute"
    # or "swap" (what its KV became).
    preemptions: dict[tuple[str, str], int] = field(default_factory=dict)
    # Preemptions per 100 steps over the last `PREEMPTION_WINDOW_STEPS` steps that ran.
    preemption_rate: float = 0.0
    # Prefix cache, cumulative, in tokens (vLLM's definition): looked up at admission, found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Swap space (cumulative counts): fraction of host blocks in use, blocks copied out and in,
    # seconds the copies took, and tokens whose KV preemption dropped (to be prefilled again).
    swap_usage: float = 0.0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_time_s: float = 0.0
    recomputed_tokens: int = 0
    # Speculative decoding (None: off).
    spec_decode: SpecDecodeStats | None = None
