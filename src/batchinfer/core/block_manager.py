"""Paged KV cache bookkeeping: a free list, reference counts and one block table per request.

Pure Python: block ids are ints and block tables `list[int]`; the runner maps them onto tensors.
Invariant (checked by `check_invariants`): every block is either free (ref count 0, in the free
list exactly once) or referenced by the tables that hold it (ref count = number of holders).
"""

from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (`batchinfer_kv_cache_usage_perc`)."""
        return self.num_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs so that its table holds `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens; return it, or None (and change
        nothing) when not enough blocks are free."""
        needed = self.num_blocks_needed(request_id, num_tokens)
        if needed > len(self._free):
            return None
        table = self._tables.setdefault(request_id, [])
        for _ in range(needed):
            block_id = self._free.popleft()
            self._ref_counts[block_id] = 1
            table.append(block_id)
        return table

    def free(self, request_id: str) -> None:
        """Release the request's blocks (a request without blocks is a no-op)."""
        for block_id in reversed(self._tables.pop(request_id, ())):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_invariants(self) -> None:
        """Raise `RuntimeError` if the free list, ref counts and tables disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a block is in the free list twice")
        holders = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                if block_id in free:
                    raise RuntimeError(f"block {block_id} is both free and referenced")
                holders[block_id] += 1
        if holders != self._ref_counts:
            raise RuntimeError("reference counts do not match block tables")
        if len(free) + sum(1 for h in holders if h) != self.num_blocks:
            raise RuntimeError("free + used blocks != total blocks")
