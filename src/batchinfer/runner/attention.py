"""Paged attention: write this step's K/V into the cache, attend over each sequence's context.

`PagedAttention` is built once per step from that step's `AttentionMetadata` and handed to
`model.forward` as its `attention(layer_idx, q, k, v)` callable, so the metadata travels
explicitly, never through a global. q and k arrive with RoPE applied; the softmax scale
`1 / sqrt(head_dim)` is applied here.

Two paths, chosen by `prepare_inputs`:
- decodes (query length 1) in groups of similar context length: one block gather
  `[n, num_blocks * block_size, kv_heads, head_dim]` and one SDPA call per group, with the
  query heads of a KV head laid out as the query-length dimension (`[n, kv_heads, group, d]`),
  so grouped-query attention needs no K/V repeat and no `enable_gqa`, and a key mask
  `position < context_len` hides the padding;
- longer chunks (prefill): one SDPA per chunk over its cached prefix + itself, causal with the
  diagonal offset by `num_computed_tokens`. A first chunk (nothing cached) attends to the
  step's own K/V directly with `is_causal`, skipping the cache read (so with a narrower
  `kv_cache_dtype` a first chunk attends at model precision, later reads at cache precision).
Sliding-window attention (Mistral's `sliding_window`) is NOT applied: every query sees its
whole context.

Measured with `python -m batchinfer.runner.attention_bench --threads 1`: one layer of the
SmolLM2-135M attention shape (9 heads, 3 KV heads, head_dim 64), block_size 16, 64 decodes with
contexts 240..360 in shuffled blocks; fastest of 30 calls in thread CPU time, on a shared 2-core
AMD EPYC (no AVX-512, so bf16 math is emulated), torch 2.13, neighbours loading the box:
    one SDPA per sequence (straightforward):  fp32 22-26 ms   bf16 23-27 ms
    grouped decodes (this path):              fp32 11-13 ms   bf16  9.5-11 ms
About 4 ms of the grouped fp32 figure is the K and V block gathers (memory-bound, 2 x 18 MB),
the rest one SDPA call. Gathering into a fresh tensor per call instead of the reused workspace
measured 34 ms (fp32) once a per-sequence step had fragmented the heap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchinfer.runner.input_batch import AttentionMetadata, DecodeGroup, PrefillChunk

# `enable_gqa` appeared in torch 2.5; before it the prefill path repeats K/V per query group.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class PagedAttention:
    """The attention callable of one step over a paged KV cache.

    `kv_cache` is `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`; it is
    written in place (new K/V at `metadata.slot_mapping`) on every call, once per layer.
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
        # Decode gathers land in one reused buffer: a fresh 10-100 MB tensor per layer costs
        # page faults, and after a step of many small tensors, glibc serves it from fresh mmaps
        # (measured: grouped decodes 3x slower). Callers keep `self.workspace` for the next step.
        block_numel = kv_cache[0, 0, 0].numel()
        needed = max(
            (2 * g.block_tables.numel() * block_numel for g in metadata.decode_groups), default=0
        )
        if workspace is None or workspace.numel() < needed or workspace.dtype != kv_cache.dtype:
            workspace = torch.empty(needed, dtype=kv_cache.dtype, device=device)
        self.workspace = workspace
        # Masks depend only on the step, so they are built once and reused by every layer.
        self._decode_masks = [_context_mask(g, metadata.block_size) for g in metadata.decode_groups]
        self._prefill_masks = [_offset_causal_mask(c, device) for c in metadata.prefills]

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        key_cache = self.kv_cache[layer_idx, 0]  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache = self.kv_cache[layer_idx, 1]
        num_kv_heads, head_dim = key_cache.shape[-2:]
        slots = self.metadata.slot_mapping
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(key_cache.dtype))

        scale = head_dim**-0.5
        out = torch.empty_like(q)
        for group, mask in zip(self.metadata.decode_groups, self._decode_masks, strict=True):
            out[group.start : group.end] = _decode_attention(
                q[group.start : group.end], key_cache, value_cache, group, mask, scale,
                self.workspace,
            )
        for chunk, mask in zip(self.metadata.prefills, self._prefill_masks, strict=True):
            rows = slice(chunk.start, chunk.end)
            if mask is None:  # first chunk: its context is exactly this step's k, v
                keys, values = k[rows], v[rows]
            else:
                keys = _gather_context(key_cache, chunk.block_ids, chunk.context_len)
                values = _gather_context(value_cache, chunk.block_ids, chunk.context_len)
            out[rows] = _chunk_attention(q[rows], keys, values, mask, scale)
        return out


def _decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: DecodeGroup,
    mask: torch.Tensor,
    scale: float,
    workspace: torch.Tensor,
) -> torch.Tensor:
    """One new token per sequence against its whole (padded) context; returns `[n, heads, d]`."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    size = group.block_tables.numel() * key_cache[0].numel()
    keys = _gather_blocks(key_cache, group.block_tables, workspace[:size])  # [n, kv, len, d]
    values = _gather_blocks(value_cache, group.block_tables, workspace[size : 2 * size])
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    # Query heads h = kv * group_size + j share KV head kv: [n, kv_heads, group_size, d]
    grouped_q = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def _chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk `[n, heads, d]` over its context `[ctx, kv_heads, d]`."""
    num_heads, num_kv_heads = q.shape[1], keys.shape[1]
    q_t = q.transpose(0, 1)  # [heads, n, d]
    keys = keys.transpose(0, 1).to(q.dtype)  # [kv_heads, ctx, d]
    values = values.transpose(0, 1).to(q.dtype)
    kwargs: dict[str, object] = {"scale": scale}
    if num_heads != num_kv_heads:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=0)
            values = values.repeat_interleave(num_heads // num_kv_heads, dim=0)
    if mask is None:
        out = F.scaled_dot_product_attention(q_t, keys, values, is_causal=True, **kwargs)
    else:
        out = F.scaled_dot_product_attention(q_t, keys, values, attn_mask=mask, **kwargs)
    return out.transpose(0, 1)


def _gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Blocks of `n` sequences as `[n, kv_heads, num_blocks * block_size, d]` (a strided view).

    `index_select` on the flattened table, not `cache[block_tables]`: same result, and on CPU
    about twice as fast as advanced indexing. Written into `out` (flat, exactly the right size).
    """
    n, num_blocks = block_tables.shape
    gathered = out.view(n * num_blocks, *cache.shape[1:])  # [n * num_blocks, bs, kv, d]
    torch.index_select(cache, 0, block_tables.view(-1), out=gathered)
    return gathered.view(n, num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` cached tokens of one sequence: `[context_len, kv_heads, d]`."""
    return cache.index_select(0, block_ids).flatten(0, 1)[:context_len]


def _context_mask(group: DecodeGroup, block_size: int) -> torch.Tensor:
    """`[n, 1, 1, max_len]` True where key position < the sequence's context length."""
    max_len = group.block_tables.shape[1] * block_size
    positions = torch.arange(max_len, device=group.context_lens.device)
    return (positions < group.context_lens[:, None])[:, None, None, :]


def _offset_causal_mask(chunk: PrefillChunk, device: torch.device) -> torch.Tensor | None:
    """`[n, ctx]` True where query i (position c + i) may see key j, i.e. j <= c + i.

    None for a first chunk (c == 0), which uses SDPA's own `is_causal` instead.
    """
    if chunk.num_computed_tokens == 0:
        return None
    n = chunk.end - chunk.start
    query_positions = torch.arange(n, device=device) + chunk.num_computed_tokens
    return torch.arange(chunk.context_len, device=device) <= query_positions[:, None]
