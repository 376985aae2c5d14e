"""Paged KV cache bookkeeping: free blocks, reference counts, one block table per request, and
the prefix cache.

Pure Python: block ids are ints and block tables `list[int]`; the runner maps them onto tensors.

Prefix caching: once a block is full of computed tokens it is identified by a chained key, the
hash of its parent block's key and its own tokens (so a block stands for its whole prefix, not
only its 16 tokens). A request that starts (or resumes after preemption) looks up the longest run
of its leading full blocks in the cache and shares them (reference count + 1) instead of
computing them again. A block whose last holder leaves stays cached in the free pool; free
blocks are reused least recently freed first, uncached ones before cached ones, and a cached
block is evicted (forgotten) only when it is reused. Only full blocks are shared and a full
block is never written again, so sharing needs no copy-on-write.

Sliding windows: where every layer of the model attends over a window, the leading blocks of a
request that lie wholly before the window of its next query are read by no layer again, and
`drop_blocks_before` frees them. A table then holds the request's blocks from number
`num_dropped_blocks` on (position `p` is in `table[p // block_size - num_dropped_blocks]`); a
dropped block is returned like a freed one (a cached one stays in the prefix cache).

Invariants (`check_invariants`): every block is free (reference count 0, in the free pool once)
or referenced by the tables that hold it (count = holders); free + used = total; a key maps to
exactly one block, and that block carries the key.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

# (digest of the parent block's key, the block's tokens). The digest is a 128-bit BLAKE2b of the
# parent's own key, so a chain of keys stands for the whole prefix and a crafted collision with
# another prompt's prefix is out of reach (Python's `hash` is 64-bit and not collision-resistant).
BlockKey = tuple[bytes, tuple[int, ...]]
ROOT_PARENT = b""  # the parent digest of a request's first block


def key_digest(key: BlockKey) -> bytes:
    """The digest a block's key passes on to the next block's key."""
    parent, tokens = key
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_keys(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_PARENT,
               start_block: int = 0) -> list[BlockKey]:
    """The chained keys of the full blocks of `token_ids` from `start_block` on (`parent`: the
    digest of the key of the block before it)."""
    keys: list[BlockKey] = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        key = (parent, tuple(token_ids[start : start + block_size]))
        keys.append(key)
        parent = key_digest(key)
    return keys


class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` tokens each (`enable_prefix_caching`: full
    blocks are shared by key and kept after their last holder leaves)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
                 ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free pool in reuse order (first = next to be reused); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        # Keys of each request's leading full blocks registered so far (the chain's tail).
        self._request_keys: dict[str, list[BlockKey]] = {}
        # Leading blocks of a request dropped outside the sliding window (absent: none).
        self._num_dropped: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request may take: unused ones and cached ones nobody holds (evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix (held by requests or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (`batchinfer_kv_cache_usage_perc`); cached blocks
        nobody holds count as free."""
        return self.num_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The blocks the request holds, from block number `num_dropped_blocks` on."""
        return self._tables.get(request_id, [])

    def num_dropped_blocks(self, request_id: str) -> int:
        """Leading blocks of the request dropped outside the sliding window."""
        return self._num_dropped.get(request_id, 0)

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs so that its table holds `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ())) + self.num_dropped_blocks(request_id)
        return max(0, cdiv(num_tokens, self.block_size) - have)

    # ----------------------------------------------------------------- prefix cache
    def cached_blocks(self, keys: Sequence[BlockKey]) -> list[int]:
        """The cached blocks of the longest run of leading `keys` (see `block_keys`; to leave a
        token to compute, pass the keys of all but a prompt's last token)."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        for key in keys:
            block_id = self._cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_freed_by(self, request_ids: Sequence[str]) -> int:
        """Blocks that freeing all these requests would return (those no one else holds)."""
        holders: dict[int, int] = {}
        for request_id in request_ids:
            for block_id in self._tables.get(request_id, ()):
                holders[block_id] = holders.get(block_id, 0) + 1
        return sum(1 for b, n in holders.items() if n == self._ref_counts[b])

    def num_idle(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` nobody holds (cached in the free pool: sharing them takes them
        out of it)."""
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def share(self, request_id: str, cached: Sequence[int], first_block: int = 0) -> None:
        """Start a request's (empty) table with the `cached` blocks of its prefix, holding
        those from number `first_block` on (the ones before lie outside the sliding window:
        dropped at once; with no `cached` blocks, the table starts at `first_block`)."""
        if self._tables.get(request_id):
            raise RuntimeError(f"request {request_id!r} already holds blocks")
        table = self._tables.setdefault(request_id, [])
        keys = self._request_keys.setdefault(request_id, [])
        if first_block:
            self._num_dropped[request_id] = first_block
        for index, block_id in enumerate(cached):
            keys.append(self._block_key[block_id])  # type: ignore[arg-type]
            if index < first_block:
                continue
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
            table.append(block_id)

    def drop_blocks_before(self, request_id: str, first_block: int) -> int:
        """Free the request's blocks numbered below `first_block` (they lie wholly outside the
        sliding window of every query it has left); returns how many it held."""
        dropped = self.num_dropped_blocks(request_id)
        table = self._tables.get(request_id)
        if first_block <= dropped or not table:
            return 0
        num = min(first_block - dropped, len(table))
        self._release(table[:num])
        del table[:num]
        self._num_dropped[request_id] = dropped + num
        return num

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's blocks that are full of computed tokens (`token_ids` holds at
        least its first `num_computed` tokens). A block whose key is cached already (another
        request computed the same prefix at the same time) stays private."""
        if not self.enable_prefix_caching:
            return
        keys = self._request_keys.setdefault(request_id, [])
        num_full = num_computed // self.block_size
        if num_full <= len(keys):
            return
        table = self._tables[request_id]
        dropped = self.num_dropped_blocks(request_id)
        parent = key_digest(keys[-1]) if keys else ROOT_PARENT
        start = len(keys)
        new_keys = block_keys(token_ids[: num_full * self.block_size], self.block_size, parent,
                              start)
        for index, key in enumerate(new_keys, start):
            keys.append(key)  # a dropped block's key still links the chain
            if index < dropped:
                continue
            block_id = table[index - dropped]
            if key not in self._cached and self._block_key[block_id] is None:
                self._cached[key] = block_id
                self._block_key[block_id] = key

    # ----------------------------------------------------------------- allocation
    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens; return it, or None (and change
        nothing) when not enough blocks are free."""
        needed = self.num_blocks_needed(request_id, num_tokens)
        if needed > len(self._free):
            return None
        table = self._tables.setdefault(request_id, [])
        for _ in range(needed):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            table.append(block_id)
        return table

    def _evict(self, block_id: int) -> None:
        key = self._block_key[block_id]
        if key is not None:
            self._block_key[block_id] = None
            del self._cached[key]

    def free(self, request_id: str) -> None:
        """Release the request's blocks (a request without blocks is a no-op). Cached blocks
        stay in the free pool to be found again, the request's last blocks first in line for
        reuse; uncached ones go to the front."""
        self._request_keys.pop(request_id, None)
        self._num_dropped.pop(request_id, None)
        self._release(self._tables.pop(request_id, ()))

    def _release(self, blocks: Sequence[int]) -> None:
        """One reference less on each of `blocks`; those nobody holds return to the pool."""
        for block_id in reversed(blocks):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self._block_key[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks beyond the ones `num_tokens` tokens fill (speculative
        decoding: the blocks only rejected proposals reached). Such a block holds no computed
        token, so it is neither cached nor shared: it goes to the front of the free pool."""
        table = self._tables.get(request_id)
        if not table:
            return
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(self._request_keys.get(request_id, ())):
            raise RuntimeError(f"request {request_id!r}: trimming would drop a cached block")
        while len(table) > keep:
            block_id = table.pop()
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] != 0:
                raise RuntimeError(f"block {block_id} trimmed while shared")
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody holds; returns how many."""
        dropped = [b for b in self._free if self._block_key[b] is not None]
        for block_id in dropped:
            self._evict(block_id)
        return len(dropped)

    def check_invariants(self) -> None:
        """Raise `RuntimeError` if the free pool, ref counts, tables and keys disagree."""
        free = set(self._free)
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
        for key, block_id in self._cached.items():
            if self._block_key[block_id] != key:
                raise RuntimeError(f"cached key of block {block_id} does not match")
        if sum(1 for k in self._block_key if k is not None) != len(self._cached):
            raise RuntimeError("a block carries a key the cache does not map")
