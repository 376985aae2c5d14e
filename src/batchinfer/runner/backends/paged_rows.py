"""The block-rows KV layout and the step code that `cpu_sparse` and `gather` share.

The cache is one tensor `[num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]`: a
block's K and V sit together, and each head's tokens of a block are one contiguous
`[block_size, head_dim]` row. Per layer it is rows `[num_blocks * 2 * num_kv_heads, block_size,
head_dim]`, row `(block * 2 + kind) * num_kv_heads + head` holding the K (kind 0) or V (kind 1)
of `head` for the block's tokens. A context is read with one `index_select` of such rows straight
into the `[kv_heads, context_len, head_dim]` layout SDPA's matmuls want, with no transposing copy.

A step: this step's K/V are written at their slots; decodes (`[0, num_decodes)`, sorted by
context length) are cut into groups of similar length (`group_decodes`, within limits each
backend sets) and each group attends in one call per layer, its shorter contexts padded and
masked (and, for a layer with a sliding window, the keys before its window); longer chunks go
through `prefill.attend_chunks`, reading their cached prefix by rows from the first block the
layer's window reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from batchinfer.runner.backends.base import FP8_DTYPES, BackendBase
from batchinfer.runner.backends.prefill import Chunk, attend_chunks, build_chunks
from batchinfer.runner.input_batch import AttentionMetadata
from batchinfer.runner.kv_cache import KVCacheSpec


@dataclass(slots=True)
class DecodeGroup:
    """Decodes `[start, end)` of the batch (rows of both tokens and sequences), padded together.

    Each is padded to `num_blocks` blocks (the longest context's), `max_len` positions; a
    padded block maps to the sequence's own last block (see `blocks_at`), so padded reads
    see finite values of that sequence alone, which the decode masks by `context_lens`.
    """

    start: int
    end: int
    num_blocks: int
    context_lens: torch.Tensor  # [n]
    positions: torch.Tensor  # [max_len] 0, 1, ... (a view of one arange per step)
    block_ids: torch.Tensor  # the step's block tables, concatenated (`AttentionMetadata`)
    first_block: torch.Tensor  # [n, 1] index in `block_ids` of each one's first block
    last_block: torch.Tensor  # [n, 1] index in `block_ids` of each one's last block

    def blocks_at(self, block_index: torch.Tensor) -> torch.Tensor:
        """Block id at each `block_index` (`[m]`) of every sequence's table: `[n, m]`.

        Past a sequence's last block, its last block (padding).
        """
        index = (self.first_block + block_index).clamp_max_(self.last_block)
        return self.block_ids.take(index)

    def block_tables(self) -> torch.Tensor:
        """Padded block tables `[n, num_blocks]`."""
        return self.blocks_at(self.positions[: self.num_blocks])


@dataclass(frozen=True, slots=True)
class DecodeGrouping:
    """Limits of one decode group, set by each backend for its own decode cost.

    A group is cut when padding it to its longest context would cost more than
    `max_padding_ratio` times the blocks its sequences really use AND more than
    `max_padding_blocks` padding blocks (one more group has a fixed cost per layer, which only
    pays off past a real amount of padding), or when its padded size (members x longest
    context) would pass `max_group_tokens`.
    """

    max_padding_ratio: float
    max_padding_blocks: int
    max_group_tokens: int


class GroupDecode(Protocol):
    """The attention of one decode group, built once per step, called once per layer."""

    @property
    def num_gathered_rows(self) -> int:
        """Cache rows it copies into the workspace per call (0: it reads them in place)."""
        ...

    def __call__(
        self, q: torch.Tensor, cache_rows: torch.Tensor, scale: float, workspace: torch.Tensor,
        window: int | None, softcap: float | None,
    ) -> torch.Tensor:
        """Attention of `q` `[n, heads, d]` over the group's contexts: `[n, heads, d]`, each
        query seeing its context's last `window` keys (None: all), its scores soft-capped at
        `softcap` (None: not)."""
        ...


def decode_visible(positions: torch.Tensor, context_lens: torch.Tensor,
                   window: int | None) -> torch.Tensor:
    """`[n, max_len]` True where the query of a decode (the last token of its context) sees
    the key at each of `positions` (`[max_len]`): inside its context and its window."""
    lens = context_lens[:, None]
    visible = positions < lens
    if window is not None:
        visible &= positions >= lens - window
    return visible


@dataclass(slots=True)
class _Step:
    """What `PagedRowsBackend.build` prepares for every layer of one step."""

    write_index: torch.Tensor  # [num_tokens * 2 * kv_heads] (see `kv_write_index`)
    groups: list[DecodeGroup]
    decodes: list[GroupDecode]  # one per group
    chunks: list[Chunk]  # the multi-token chunks, after the decodes
    # Chunk index -> its context's rows (see `context_rows`), for chunks after a cached prefix.
    chunk_rows: dict[int, torch.Tensor]


class PagedRowsBackend(BackendBase):
    """A backend on the block-rows layout; subclasses say how a decode group attends."""

    def __init__(
        self, device: torch.device, kv_dtype: torch.dtype, calculate_kv_scales: bool = False
    ) -> None:
        super().__init__(device, kv_dtype, calculate_kv_scales)
        # Gathers land in one buffer reused across layers and steps: a fresh 10-100 MB tensor
        # per layer costs page faults, and after a step of many small tensors glibc serves it
        # from fresh mmaps.
        self.workspace = torch.empty(0, dtype=kv_dtype, device=device)
        self._step: _Step | None = None

    def decode_grouping(self) -> DecodeGrouping:
        """The limits this backend groups decodes by (for its allocated cache)."""
        raise NotImplementedError

    def _build_decode(self, group: DecodeGroup) -> GroupDecode:
        raise NotImplementedError

    def _cache_shape(
        self, spec: KVCacheSpec, num_blocks: int, block_size: int
    ) -> tuple[int, ...]:
        return (spec.num_layers, num_blocks, 2, spec.num_kv_heads, block_size, spec.head_dim)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_cache.shape[3]

    def build(self, metadata: AttentionMetadata) -> None:
        """Prepare the step: everything that depends only on it (row indices, masks)."""
        self._check_step(metadata)
        block_size, num_kv_heads = self.block_size, self.num_kv_heads
        groups = self._decode_groups(metadata)
        chunks = build_chunks(metadata, metadata.num_decodes)
        step = _Step(
            write_index=kv_write_index(metadata.slot_mapping, block_size, num_kv_heads),
            groups=groups,
            decodes=[self._build_decode(group) for group in groups],
            chunks=chunks,
            chunk_rows={
                i: context_rows(c.block_ids[None], num_kv_heads)
                for i, c in enumerate(chunks)
                if not c.is_first
            },
        )
        num_rows = [d.num_gathered_rows for d in step.decodes]
        num_rows += [rows.numel() for rows in step.chunk_rows.values()]
        needed = max(num_rows, default=0) * block_size * self.kv_cache.shape[-1]
        if self.workspace.numel() < needed:
            self.workspace = torch.empty(needed, dtype=self.kv_dtype, device=self.device)
        self._step = step

    def _decode_groups(self, metadata: AttentionMetadata) -> list[DecodeGroup]:
        """The step's decodes cut into groups (`group_decodes` within `decode_grouping`)."""
        lens = metadata.context_lens[: metadata.num_decodes]
        if not lens:
            return []
        block_size = self.block_size
        # Shared by every group: one arange for the longest context (the last), table bounds.
        positions = torch.arange(-(-lens[-1] // block_size) * block_size, device=self.device)
        first_block = metadata.block_starts_tensor[: len(lens), None]
        last_block = metadata.block_starts_tensor[1 : len(lens) + 1, None] - 1
        groups = []
        for start, end in group_decodes(lens, block_size, self.decode_grouping()):
            num_blocks = -(-lens[end - 1] // block_size)
            groups.append(DecodeGroup(
                start, end, num_blocks, metadata.context_lens_tensor[start:end],
                positions[: num_blocks * block_size], metadata.block_ids,
                first_block[start:end], last_block[start:end],
            ))
        return groups

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        step = self._step
        if step is None:
            raise RuntimeError(f"{self.name}: called before build()")
        block_size, head_dim = self.block_size, self.kv_cache.shape[-1]
        cache_rows = self.kv_cache[layer_idx].view(-1, block_size, head_dim)
        write_kv(cache_rows, step.write_index, *self.quantize(layer_idx, k, v))
        layer = self.layer(layer_idx, head_dim)
        k_scale, v_scale = kv_scales = self.kv_scales[layer_idx]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for group, decode in zip(step.groups, step.decodes, strict=True):
            span = slice(group.start, group.end)
            # FP8: q . (K k_scale) = (q . K) k_scale, and the output is linear in V.
            attended = decode(q[span], cache_rows, layer.scale * k_scale, self.workspace,
                              layer.window, layer.softcap)
            out[span] = attended if v_scale == 1.0 else attended * v_scale

        def read_context(index: int, first_key: int) -> tuple[torch.Tensor, torch.Tensor]:
            first_block = first_key // block_size
            rows = step.chunk_rows[index][..., first_block:]
            keys, values = gather_blocks(cache_rows, rows, self.workspace)
            span = slice(first_key - first_block * block_size,
                         step.chunks[index].context_len - first_block * block_size)
            return keys[0, :, span], values[0, :, span]

        attend_chunks(out, q, k, v, step.chunks, read_context, layer, kv_scales)
        return out


def group_decodes(
    sorted_context_lens: list[int], block_size: int, limits: DecodeGrouping
) -> list[tuple[int, int]]:
    """Split decodes (sorted by context length) into `[start, end)` groups of similar length.

    A group grows while padding all of its members to the newest (longest) one stays within
    the padding limits, so one very long context does not make every short one attend over its
    length, and while its padded size stays within `limits.max_group_tokens`.
    """
    max_group_blocks = limits.max_group_tokens // block_size
    groups: list[tuple[int, int]] = []
    start, used_blocks = 0, 0
    for i, context_len in enumerate(sorted_context_lens):
        num_blocks = -(-context_len // block_size)
        padded = (i - start + 1) * num_blocks
        used = used_blocks + num_blocks
        too_padded = (
            padded > limits.max_padding_ratio * used
            and padded - used > limits.max_padding_blocks
        )
        if i > start and (too_padded or padded > max_group_blocks):
            groups.append((start, i))
            start, used_blocks = i, 0
        used_blocks += num_blocks
    if sorted_context_lens:
        groups.append((start, len(sorted_context_lens)))
    return groups


def kv_write_index(slots: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """`[num_tokens * 2 * kv_heads]`: the flat row (of head_dim) each new K and V lands in."""
    kv_rows = torch.arange(2 * num_kv_heads, device=slots.device) * block_size
    block_base = (slots // block_size) * (2 * num_kv_heads * block_size) + slots % block_size
    return (block_base[:, None] + kv_rows).view(-1)


def write_kv(
    cache_rows: torch.Tensor, write_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store this step's K and V (`[num_tokens, kv_heads, d]` each, in the cache's dtype) at
    their cache slots."""
    head_dim = cache_rows.shape[-1]
    new = torch.cat((k, v), dim=1)  # [num_tokens, 2 * kv_heads, d]
    rows = cache_rows.view(-1, head_dim)
    if new.dtype in FP8_DTYPES:  # index_copy_ has no FP8 kernel on CPU: copy the bytes
        rows, new = rows.view(torch.uint8), new.view(torch.uint8)
    rows.index_copy_(0, write_index, new.view(-1, head_dim))


def context_rows(block_tables: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Cache rows of `n` contexts in the order `[2, n, kv_heads, num_blocks]` (K then V).

    Gathering them gives `[2, n, kv_heads, num_blocks * block_size, head_dim]`, each head's
    context contiguous: the layout SDPA reads fastest, reached by the gather alone.
    """
    n, num_blocks = block_tables.shape
    kinds = torch.arange(2, device=block_tables.device).view(2, 1, 1, 1) * num_kv_heads
    heads = torch.arange(num_kv_heads, device=block_tables.device).view(1, 1, num_kv_heads, 1)
    return block_tables.view(1, n, 1, num_blocks) * (2 * num_kv_heads) + kinds + heads


def gather_blocks(
    cache_rows: torch.Tensor, rows: torch.Tensor, workspace: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `rows` (`[2, n, kv, num_blocks]`) as `[n, kv, num_blocks * bs, d]` each.

    `index_select` into the reused workspace, not `cache[rows]`: same result, faster on CPU than
    advanced indexing.
    """
    _, n, num_kv_heads, num_blocks = rows.shape
    block_size, head_dim = cache_rows.shape[1:]
    gathered = workspace[: rows.numel() * block_size * head_dim].view(-1, block_size, head_dim)
    torch.index_select(cache_rows, 0, rows.reshape(-1), out=gathered)
    kv = gathered.view(2, n, num_kv_heads, num_blocks * block_size, head_dim)
    return kv[0], kv[1]
