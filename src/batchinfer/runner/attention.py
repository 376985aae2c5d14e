"""Paged attention: write this step's K/V into the cache, attend over each sequence's context.

`PagedAttention` is built once per step from that step's `AttentionMetadata` and handed to
`model.forward` as its `attention(layer_idx, q, k, v)` callable, so the metadata travels
explicitly, never through a global. q and k arrive with RoPE applied; the softmax scale
`1 / sqrt(head_dim)` is applied here. The cache layout (see `kv_cache.py`) keeps each head's
tokens of a block as one `[block_size, head_dim]` row, so a context is read row by row.

Two paths, chosen by `prepare_inputs`:
- decodes (query length 1) in groups of similar context length (`DecodeGroup`), one attention
  per group and layer, in one of two ways fixed at start-up by `uses_sparse_decode`:
  - CPU, float32 cache (`_SparseDecode`): scores by a sampled matmul and the weighted sum of
    values by an `embedding_bag`, both reading the cache rows in place;
  - otherwise (`_GatherDecode`): one `index_select` of the group's K and V rows into a reused
    workspace as `[n, kv_heads, len, d]`, then one SDPA call with the query heads of a KV head
    as its query-length dimension (`[n, kv_heads, group, d]`), so grouped-query attention needs
    no K/V repeat; a group is kept small enough that its copy is still in cache for SDPA.
  Either way a key mask `position < context_len` hides the padding of shorter contexts;
- longer chunks (prefill): one SDPA per chunk over its cached prefix + itself, causal with the
  diagonal offset by `num_computed_tokens`. A first chunk (nothing cached) attends to the
  step's own K/V directly with `is_causal`, skipping the cache read (so with a narrower
  `kv_cache_dtype` a first chunk attends at model precision, later reads at cache precision).
Sliding-window attention (Mistral's `sliding_window`) is NOT applied: every query sees its
whole context.

Measured with `python -m batchinfer.runner.attention_bench --threads 1`: one layer of the
SmolLM2-135M attention shape (9 heads, 3 KV heads, head_dim 64), block_size 16, 64 decodes with
contexts 240..360 in shuffled blocks; fastest of 30 calls in thread CPU time, on a shared 2-core
AMD EPYC (AVX2, no AVX-512, so bf16 math is emulated), torch 2.13, neighbours loading the box:
    one SDPA per sequence (`group_decodes=False`):   fp32 10-11 ms        bf16 29 ms
    grouped, before (K, V gathered as [n, len, kv, d]
      blocks, transposed by SDPA; one group):        fp32 11-13 ms        bf16 9.5-11 ms
    grouped, now:                                    fp32 4.5-4.8 ms      bf16 6-8 ms
                                                     (sparse)             (gather)
Over 30 layers and a 2 GB cache (`benchmarks/step_profile.py`), a step of 64 decodes at
200-450 tokens spends 5.5-6 ms per layer in attention (was 14-16 ms with the gathers), against
10-11 ms in its matmuls. SDPA gets 4-D inputs everywhere: 3-D ones take a slower CPU path.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchinfer.runner.input_batch import AttentionMetadata, DecodeGroup, PrefillChunk
from batchinfer.runner.kv_cache import layer_rows

# `enable_gqa` appeared in torch 2.5; before it the prefill path repeats K/V per query group.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
# Padded context tokens of one decode group, at most. Gather path: its K and V copy stays
# within this many bytes, so it is still in the CPU cache when SDPA reads it. Sparse path:
# bounds the padding a group computes, against ~0.1 ms of fixed cost per group and layer.
DECODE_GROUP_BYTES = 4 << 20
SPARSE_DECODE_GROUP_TOKENS = 6144


def uses_sparse_decode(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether decodes read the cache in place (`_SparseDecode`): CPU, float32 cache only."""
    return device.type == "cpu" and kv_dtype == torch.float32


def max_decode_group_tokens(
    num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, device: torch.device
) -> int:
    """The `max_decode_group_tokens` to build a step's inputs with (see the constants above)."""
    if uses_sparse_decode(device, kv_dtype):
        return SPARSE_DECODE_GROUP_TOKENS
    token_bytes = 2 * num_kv_heads * head_dim * torch.empty((), dtype=kv_dtype).element_size()
    return max(1, DECODE_GROUP_BYTES // token_bytes)


class PagedAttention:
    """The attention callable of one step over a paged KV cache.

    `kv_cache` comes from `kv_cache.allocate_kv_cache`; it is written in place (new K/V at
    `metadata.slot_mapping`) on every call, once per layer. Everything that depends only on
    the step (row indices, masks) is built here once and reused by every layer.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        workspace: torch.Tensor | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.metadata = metadata
        device = kv_cache.device
        block_size, num_kv_heads, head_dim = kv_cache.shape[-3:]
        layer_rows(kv_cache, 0)  # checks the layout once, not per layer
        # [num_tokens * 2 * kv_heads]: the flat row (of head_dim) each new K and V lands in.
        slots = metadata.slot_mapping
        kv_rows = torch.arange(2 * num_kv_heads, device=device) * block_size
        block_base = (slots // block_size) * (2 * num_kv_heads * block_size) + slots % block_size
        self._write_index = (block_base[:, None] + kv_rows).view(-1)
        sparse = uses_sparse_decode(device, kv_cache.dtype)
        self._decodes: list[_SparseDecode | _GatherDecode] = [
            _SparseDecode.build(g, block_size, num_kv_heads)
            if sparse
            else _GatherDecode.build(g, block_size, num_kv_heads)
            for g in metadata.decode_groups
        ]
        self._prefill_rows = [
            None if c.num_computed_tokens == 0 else _context_rows(c.block_ids[None], num_kv_heads)
            for c in metadata.prefills
        ]
        self._prefill_masks = [_offset_causal_mask(c, device) for c in metadata.prefills]
        # Gathers land in one reused buffer: a fresh 10-100 MB tensor per layer costs page
        # faults, and after a step of many small tensors glibc serves it from fresh mmaps
        # (measured: 3x slower). Callers keep `self.workspace` for the next step.
        rows = [d.rows for d in self._decodes if isinstance(d, _GatherDecode)]
        rows += [r for r in self._prefill_rows if r is not None]
        needed = max((r.numel() for r in rows), default=0) * block_size * head_dim
        if workspace is None or workspace.numel() < needed or workspace.dtype != kv_cache.dtype:
            workspace = torch.empty(needed, dtype=kv_cache.dtype, device=device)
        self.workspace = workspace

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        cache_rows = layer_rows(self.kv_cache, layer_idx)  # [blocks * 2 * kv, bs, d]
        _write_kv(cache_rows, self._write_index, k, v)
        scale = q.shape[-1] ** -0.5
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for group, decode in zip(self.metadata.decode_groups, self._decodes, strict=True):
            span = slice(group.start, group.end)
            out[span] = decode(q[span], cache_rows, scale, self.workspace)
        for chunk, rows, mask in zip(
            self.metadata.prefills, self._prefill_rows, self._prefill_masks, strict=True
        ):
            span = slice(chunk.start, chunk.end)
            if rows is None:  # first chunk: its context is exactly this step's k, v
                keys, values = k[span].transpose(0, 1), v[span].transpose(0, 1)
            else:
                keys, values = _gather_blocks(cache_rows, rows, self.workspace)
                keys = keys[0, :, : chunk.context_len]  # [kv_heads, context_len, d]
                values = values[0, :, : chunk.context_len]
            out[span] = _chunk_attention(q[span], keys.to(q.dtype), values.to(q.dtype), mask, scale)
        return out


@dataclass(slots=True)
class _SparseDecode:
    """Decode attention of one group straight from the cache rows, without gathering them.

    Scores are a sampled matmul (`torch.sparse.sampled_addmm`: one dot product per query head
    and context position, its sparsity pattern naming the cache row of each key) and the
    weighted sum of values an `embedding_bag` over the value rows. Each key and value is read
    once from memory (the query heads sharing it find it in cache), where gather + SDPA writes
    and re-reads a copy of the context: measured 1.4-1.6x faster on CPU (SmolLM2 shape, 32-64
    decodes of 200-450 tokens). Both ops are float32-only on CPU, hence only for such caches.
    """

    positions: torch.Tensor  # [n, max_len] row of KV head 0's key at each context position
    mask: torch.Tensor  # [n, 1, max_len] 0 at context positions, -inf at padding
    head_rows: int  # rows between one KV head's keys and the next's (= block_size)
    value_offset: int  # a value's row is its key's + this (see `kv_cache.layer_rows`)
    # Built at the first call, once the number of query heads is known:
    key_rows: torch.Tensor | None = None  # [n * heads, max_len] key row per (query head, pos)
    pattern: torch.Tensor | None = None  # CSR [n * heads, cache rows] with `key_rows`

    @classmethod
    def build(cls, group: DecodeGroup, block_size: int, num_kv_heads: int) -> _SparseDecode:
        max_len = group.block_tables.shape[1] * block_size
        positions = torch.arange(max_len, device=group.block_tables.device)
        blocks = group.block_tables[:, positions // block_size]  # [n, max_len]
        rows = blocks * (2 * num_kv_heads * block_size) + positions % block_size
        mask = torch.zeros(rows.shape[0], 1, max_len, device=rows.device)
        mask.masked_fill_(positions >= group.context_lens[:, None, None], float("-inf"))
        return cls(rows, mask, block_size, num_kv_heads * block_size)

    def __call__(
        self, q: torch.Tensor, cache_rows: torch.Tensor, scale: float, workspace: torch.Tensor
    ) -> torch.Tensor:
        """Attention of `q` `[n, heads, d]` over the group's contexts: `[n, heads, d]`."""
        n, num_heads, head_dim = q.shape
        max_len = self.positions.shape[1]
        rows = cache_rows.view(-1, head_dim)  # [num_blocks * 2 * kv_heads * block_size, d]
        if self.key_rows is None or self.pattern is None:
            self.key_rows, self.pattern = self._pattern(num_heads, rows.shape[0])
        # Written into the pattern's own values (`out=`), which saves copying the pattern
        # per call; they must stay finite (beta=0 still multiplies them), so the mask is added
        # out of place.
        scores = torch.sparse.sampled_addmm(
            self.pattern, q.reshape(n * num_heads, head_dim).float(), rows.t(),
            beta=0.0, alpha=scale, out=self.pattern,
        ).values().view(n, num_heads, max_len)
        probs = torch.add(scores, self.mask).softmax(dim=-1)
        out = F.embedding_bag(
            self.key_rows, rows[self.value_offset :], mode="sum",
            per_sample_weights=probs.view(n * num_heads, max_len),
        )
        return out.view(n, num_heads, head_dim).to(q.dtype)

    def _pattern(self, num_heads: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, max_len = self.positions.shape
        device = self.positions.device
        group_size = num_heads // (self.value_offset // self.head_rows)
        kv_head = torch.arange(num_heads, device=device) // group_size
        key_rows = (self.positions[:, None, :] + kv_head[:, None] * self.head_rows).view(-1, max_len)
        crow = torch.arange(0, key_rows.numel() + 1, max_len, device=device)
        values = torch.zeros(key_rows.numel(), device=device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            pattern = torch.sparse_csr_tensor(
                crow, key_rows.view(-1), values, size=(n * num_heads, num_rows),
                check_invariants=False,
            )
        return key_rows, pattern


@dataclass(slots=True)
class _GatherDecode:
    """Decode attention of one group: gather its K and V rows, then one SDPA call."""

    rows: torch.Tensor  # [2, n, kv_heads, num_blocks] cache rows to gather (see _context_rows)
    mask: torch.Tensor  # [n, 1, 1, max_len] True at context positions

    @classmethod
    def build(cls, group: DecodeGroup, block_size: int, num_kv_heads: int) -> _GatherDecode:
        max_len = group.block_tables.shape[1] * block_size
        positions = torch.arange(max_len, device=group.context_lens.device)
        mask = (positions < group.context_lens[:, None])[:, None, None, :]
        return cls(_context_rows(group.block_tables, num_kv_heads), mask)

    def __call__(
        self, q: torch.Tensor, cache_rows: torch.Tensor, scale: float, workspace: torch.Tensor
    ) -> torch.Tensor:
        """Attention of `q` `[n, heads, d]` over the group's contexts: `[n, heads, d]`."""
        n, num_heads, head_dim = q.shape
        keys, values = _gather_blocks(cache_rows, self.rows, workspace)  # [n, kv, len, d]
        num_kv_heads = keys.shape[1]
        # Query heads h = kv * group_size + j share KV head kv: [n, kv_heads, group_size, d]
        grouped_q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            grouped_q, keys.to(q.dtype), values.to(q.dtype), attn_mask=self.mask, scale=scale
        )
        return out.view(n, num_heads, head_dim)


def _context_rows(block_tables: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Cache rows of `n` contexts in the order `[2, n, kv_heads, num_blocks]` (K then V).

    Gathering them gives `[2, n, kv_heads, num_blocks * block_size, head_dim]`, each head's
    context contiguous: the layout SDPA reads fastest, reached by the gather alone.
    """
    n, num_blocks = block_tables.shape
    kinds = torch.arange(2, device=block_tables.device).view(2, 1, 1, 1) * num_kv_heads
    heads = torch.arange(num_kv_heads, device=block_tables.device).view(1, 1, num_kv_heads, 1)
    return block_tables.view(1, n, 1, num_blocks) * (2 * num_kv_heads) + kinds + heads


def _write_kv(
    cache_rows: torch.Tensor, write_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store this step's K and V (`[num_tokens, kv_heads, d]` each) at their cache slots."""
    head_dim = cache_rows.shape[-1]
    new = torch.cat((k, v), dim=1).to(cache_rows.dtype)  # [num_tokens, 2 * kv_heads, d]
    cache_rows.view(-1, head_dim).index_copy_(0, write_index, new.view(-1, head_dim))


def _gather_blocks(
    cache_rows: torch.Tensor, rows: torch.Tensor, workspace: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `rows` (`[2, n, kv, num_blocks]`) as `[n, kv, num_blocks * bs, d]` each.

    `index_select` into the reused workspace, not `cache[rows]`: same result, and on CPU about
    twice as fast as advanced indexing.
    """
    _, n, num_kv_heads, num_blocks = rows.shape
    block_size, head_dim = cache_rows.shape[1:]
    gathered = workspace[: rows.numel() * block_size * head_dim].view(-1, block_size, head_dim)
    torch.index_select(cache_rows, 0, rows.view(-1), out=gathered)
    kv = gathered.view(2, n, num_kv_heads, num_blocks * block_size, head_dim)
    return kv[0], kv[1]


def _chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk `[n, heads, d]` over its context `[kv_heads, ctx, d]`.

    Inputs go to SDPA as 4-D `[1, heads, len, d]`: with 3-D ones torch 2.13 on CPU takes a
    path about 3x slower (measured, 300-token causal prefill of the SmolLM2 shape).
    """
    num_heads, num_kv_heads = q.shape[1], keys.shape[0]
    q_t = q.transpose(0, 1)[None]  # [1, heads, n, d]
    keys, values = keys[None], values[None]  # [1, kv_heads, ctx, d]
    kwargs: dict[str, object] = {"scale": scale}
    if num_heads != num_kv_heads:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
            values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(q_t, keys, values, is_causal=True, **kwargs)
    else:
        out = F.scaled_dot_product_attention(q_t, keys, values, attn_mask=mask, **kwargs)
    return out[0].transpose(0, 1)


def _offset_causal_mask(chunk: PrefillChunk, device: torch.device) -> torch.Tensor | None:
    """`[n, ctx]` True where query i (position c + i) may see key j, i.e. j <= c + i.

    None for a first chunk (c == 0), which uses SDPA's own `is_causal` instead.
    """
    if chunk.num_computed_tokens == 0:
        return None
    n = chunk.end - chunk.start
    query_positions = torch.arange(n, device=device) + chunk.num_computed_tokens
    return torch.arange(chunk.context_len, device=device) <= query_positions[:, None]
