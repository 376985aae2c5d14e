"""Admission: whether a waiting request may start now, and what starting it takes.

- **Batching form** (`batch_due`): `continuous` admits at every step; `dynamic` and `static`
  admit a whole batch, only when nothing runs, once `max_batch_size` requests wait (or a
  preempted member waits, or input is closed), `dynamic` also once the oldest has waited
  `max_batch_delay_ms`.
- **Size** (`admission_size`): the cached prefix it shares, its first chunk within the
  step's budget, and the blocks both take.
- **Seats, blocks and the admission watermark** (`Watermarks.admissible`): a seat, the free
  blocks for the first chunk, and unless the machine is empty `kv_admission_watermark`.
- **Soft watermark** (`Watermarks.above_soft`, `Watermarks.soft_exempt`): past
  `kv_soft_watermark`, counting what running prefills still need, only interactive, short or
  aged-to-interactive requests are admitted; the others wait and the ones behind may go.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from batchinfer.core.block_manager import cdiv
from batchinfer.core.policy import WaitingQueue
from batchinfer.core.request import Request, RequestStatus


class BlockCounts(Protocol):
    """What admission reads of the block manager."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...


def batch_due(
    waiting: WaitingQueue,
    size: int,
    *,
    batching: str,
    input_closed: bool,
    max_batch_delay_ms: float,
    clock: Callable[[], float],
) -> bool:
    """dynamic / static, with nothing running: whether the waiting batch of `size` starts now."""
    if len(waiting) >= size or input_closed:
        return True
    if any(r.status == RequestStatus.PREEMPTED for r in waiting):
        return True  # a preempted batch member resumes as soon as the machine is free
    if batching == "dynamic":
        due = waiting.first().arrival_s + max_batch_delay_ms / 1000.0
        return clock() >= due
    return False


@dataclass(slots=True)
class AdmissionSize:
    """Admitting a waiting request now: the `cached` blocks of its prefix it shares (holding
    those from block number `first_block` on: the ones before lie outside the sliding window),
    the blocks its whole known context adds to those in use (`whole`: new ones + cached ones
    nobody holds; with a sliding window, at most what it holds at once), where its first chunk
    starts and how long it is, and the blocks that chunk adds (`take`)."""

    cached: list[int]
    whole: int
    start: int
    num_new: int
    take: int
    first_block: int = 0


def admission_size(
    request: Request, budget: int, cached: list[int], num_reused: int, block_size: int,
    first_block: int = 0, max_held_blocks: int | None = None,
) -> AdmissionSize:
    """What admitting `request` takes within `budget` tokens, given its `cached` prefix blocks,
    of which it holds those from `first_block` on (the first block its window reaches; a
    swapped-out request's first swapped block) and `num_reused` of those are held by nobody
    (they leave the free count when shared); `max_held_blocks` bounds what a request holds at
    once under a sliding window (None: no window)."""
    # Swapped out: its KV comes back into new blocks; else its cached prefix is not computed.
    start = request.num_computed_tokens if request.swap_blocks else len(cached) * block_size
    num_new = min(request.num_tokens - start, budget)
    held = max(0, len(cached) - first_block)
    take = cdiv(start + num_new, block_size) - first_block - held + num_reused
    whole_blocks = cdiv(request.num_tokens, block_size) - first_block
    if max_held_blocks is not None:
        whole_blocks = min(whole_blocks, max_held_blocks)
    return AdmissionSize(
        cached=cached,
        whole=max(take, whole_blocks - held + num_reused),
        start=start,
        num_new=num_new,
        take=take,
        first_block=first_block,
    )


@dataclass(frozen=True, slots=True)
class Watermarks:
    """The admission knobs: `max_num_seqs`, `kv_admission_watermark`, `kv_soft_watermark`,
    `short_request_tokens`, and whether the admission watermark holds for the whole prompt (the
    policy's `watermark_whole_prompt`)."""

    max_num_seqs: int
    kv_admission_watermark: float
    kv_soft_watermark: float | None
    short_request_tokens: int
    whole_prompt: bool

    def admissible(
        self, needed: int, committed_after: int, num_running: int, blocks: BlockCounts
    ) -> bool:
        """A seat, the free blocks for the first chunk (`needed`), and unless the machine is
        empty the admission watermark: running requests keep room to grow, so kv-full
        preemption stays rare. With `whole_prompt` the watermark holds for the request's whole
        prompt on top of what running prefills still need (`committed_after`): a request that
        could only finish its prefill by preempting is not started (no recompute ping-pong
        between long prompts)."""
        if num_running >= self.max_num_seqs or needed > blocks.num_free_blocks:
            return False
        if not num_running:
            return True
        limit = self.kv_admission_watermark * blocks.num_blocks
        if self.whole_prompt:
            return committed_after <= limit
        return blocks.num_used_blocks + needed <= limit

    def above_soft(self, committed_after: int, num_running: int, num_blocks: int) -> bool:
        """Whether admitting takes the committed blocks (in use + what running prefills still
        need + the request's whole context) past the soft watermark; an empty machine admits
        anything."""
        soft = self.kv_soft_watermark
        return soft is not None and num_running > 0 and committed_after > soft * num_blocks

    def soft_exempt(self, request: Request, num_tokens_left: int, aged: bool) -> bool:
        """Admitted above the soft watermark: interactive, short (prompt + the output it may
        still produce), or `aged` to the interactive level."""
        if request.priority_class == "interactive":
            return True
        if request.num_prompt_tokens + num_tokens_left <= self.short_request_tokens:
            return True
        return aged
