"""How a preempted request keeps (or drops) its KV: recompute, swap to host memory, or the
cheaper of the two.

- `recompute`: its blocks are freed; when it resumes, prompt + output so far are prefilled again.
- `swap`: its blocks are copied to a pool of host blocks (`swap_space` bytes) and copied back
  when it resumes. At most `max_swap_blocks_per_step` blocks move each way in one step (a swap
  holds up the whole step, so one long request must not stall everyone): a request with more
  computed blocks than the step has left swaps its leading blocks and recomputes the rest.
  With the host pool full, it is recomputed.
- `auto`: per victim, the cheaper by `PreemptionCosts`, measured on the machine at start-up.

`plan_kept_kv` is that rule for one victim; `fits_swap_in` the per-step cap on the way back.

Pure Python: the scheduler decides and records (device block, host block) pairs in the step's
`SchedulerOutput`; the runner copies them before the step's forward pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from batchinfer.core.block_manager import cdiv

PREEMPTION_MODES = ("recompute", "swap", "auto")


@dataclass(frozen=True, slots=True)
class PreemptionCosts:
    """What preempting costs on this machine, in seconds: prefilling one token again, moving
    one KV block out and back in (both copies), and the fixed cost of a swap (the calls, a
    device sync), paid once out and once in."""

    prefill_s_per_token: float
    swap_s_per_block: float
    swap_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "swap_s_per_block", "swap_fixed_s"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token

    def swap_s(self, num_blocks: int, num_tokens_recomputed: int) -> float:
        """Swapping `num_blocks` blocks out and back, plus the tokens past them, recomputed."""
        return (2 * self.swap_fixed_s + num_blocks * self.swap_s_per_block
                + self.recompute_s(num_tokens_recomputed))

    def describe(self) -> str:
        return (f"recompute {self.prefill_s_per_token * 1e3:.3f} ms/token, swap "
                f"{self.swap_s_per_block * 1e3:.3f} ms/block out+in "
                f"(+{self.swap_fixed_s * 1e3:.3f} ms per copy)")


@dataclass(frozen=True, slots=True)
class KeptKV:
    """What a victim's KV becomes: its first `num_swap_blocks` computed blocks are swapped out
    and its first `num_kept_tokens` tokens kept; the rest is recomputed when it resumes."""

    num_swap_blocks: int
    num_kept_tokens: int

    @property
    def mode(self) -> str:
        return "swap" if self.num_swap_blocks else "recompute"


def plan_kept_kv(
    mode: str,
    num_computed_tokens: int,
    block_size: int,
    num_free_host_blocks: int,
    num_swap_blocks_left: int,
    costs: PreemptionCosts | None,
    num_dropped_blocks: int = 0,
) -> KeptKV:
    """Swap a victim's computed blocks out (its leading ones, within what this step may still
    copy out, `num_swap_blocks_left`, and the free host blocks) or drop them, by `mode`
    (`auto`: the cheaper by the measured `costs`). A victim whose first `num_dropped_blocks`
    were dropped outside the sliding window swaps all the blocks it holds or none: resuming
    part way would need keys it no longer has."""
    computed = num_computed_tokens
    num_blocks = cdiv(computed, block_size) - num_dropped_blocks
    n = 0
    if mode != "recompute" and num_blocks > 0:
        n = min(num_blocks, num_free_host_blocks, num_swap_blocks_left)
    if num_dropped_blocks and n < num_blocks:
        n = 0
    if n == 0:
        kept = 0
    elif n == num_blocks:
        kept = computed
    else:
        kept = n * block_size
    if (n and mode == "auto" and costs is not None
            and costs.swap_s(n, computed - kept) >= costs.recompute_s(computed)):
        n = kept = 0
    return KeptKV(num_swap_blocks=n, num_kept_tokens=kept)


def fits_swap_in(num_copied_in: int, num_blocks: int, max_swap_blocks_per_step: int) -> bool:
    """Whether a swapped-out request's `num_blocks` fit in what this step may still copy in."""
    return num_copied_in + num_blocks <= max_swap_blocks_per_step


class HostBlockPool:
    """The swap space: `num_blocks` host blocks, numbered from 0, handed out and returned.

    Blocks read by a step's swap-in are `release`d, not freed: they return to the pool at the
    next `end_step()`, so a swap-out scheduled in the same step (copied before the swap-ins run)
    never overwrites them.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._released: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (0..1; 0 without a pool)."""
        if not self.num_blocks:
            return 0.0
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} host blocks asked for, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Return blocks nobody will read in this step (an aborted request's)."""
        self._free.extend(blocks)

    def release(self, blocks: list[int]) -> None:
        """Return blocks this step's swap-in reads, after the step."""
        self._released.extend(blocks)

    def keep(self, blocks: list[int]) -> None:
        """Take back released blocks: the swap-in that read them was undone in this step."""
        gone = set(blocks)
        self._released = [b for b in self._released if b not in gone]

    def end_step(self) -> None:
        self._free.extend(self._released)
        self._released = []

    def check_invariants(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise RuntimeError("a host block is free twice")
        if set(self._free) & set(self._released):
            raise RuntimeError("a host block is both free and released")
