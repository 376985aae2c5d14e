"""Prefill / extend attention: a chunk of queries of each sequence over its paged context.

One program per (sequence, query head, tile of `BLOCK_M` queries); sequences of any lengths in
one launch (varlen: their rows come from `query_starts`). Queries at positions `[c, c + n)`
(`c = num_computed_tokens`) attend causally to `[0, c + n)`. The rule every backend follows
(`backends/prefill.py`): a first chunk (`c == 0`) attends to the step's own K/V at model
precision; a later chunk reads its whole context from the cache (where this step's K/V were
just written), through the block table, at cache precision (FP8: scales folded in as in
`decode.py`). A sliding window hides each query's keys before its last `window` and skips the
key tiles wholly before the tile's first window; soft-capping as in `decode.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.runner.backends.triton.decode import NEG, attend_tile, exact_dots


@triton.jit
def _extend(q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, out_ptr, seq_ids_ptr,
            query_starts_ptr, num_computed_ptr, block_ids_ptr, block_starts_ptr,
            q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride,
            v_head_stride, out_token_stride, out_head_stride, scale, k_scale, v_scale,
            window, softcap,
            NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
            HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, EXACT: tl.constexpr, WINDOWED: tl.constexpr,
            SOFTCAP: tl.constexpr):
    seq = tl.load(seq_ids_ptr + tl.program_id(0))
    head = tl.program_id(1)
    kv_head = head // GROUP
    query_start = tl.load(query_starts_ptr + seq)
    num_queries = tl.load(query_starts_ptr + seq + 1) - query_start
    num_computed = tl.load(num_computed_ptr + seq)
    block_start = tl.load(block_starts_ptr + seq)
    tile_start = tl.program_id(2) * BLOCK_M
    if tile_start < num_queries:
        rows = tile_start + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM_P)
        row_ok = rows < num_queries
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + (query_start + rows[:, None]) * q_token_stride
                    + head * q_head_stride + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        positions = num_computed + rows  # of the queries in their sequence
        first = num_computed == 0
        sm_scale = tl.where(first, scale, scale * k_scale)
        running_max = tl.full([BLOCK_M], NEG, tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        # Keys past the tile's last query are never visible (causal): stop there.
        key_end = num_computed + tl.minimum(tile_start + BLOCK_M, num_queries)
        first_tile = 0
        if WINDOWED:  # keys before the tile's first query's window are never visible
            first_tile = tl.maximum(num_computed + tile_start - window + 1, 0) // BLOCK_N
        for key_tile in range(first_tile, tl.cdiv(key_end, BLOCK_N)):
            key_positions = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_ok = key_positions < key_end
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            if first:  # the step's own K/V, rows of this sequence's chunk
                keys = tl.load(k_ptr + (query_start + key_positions[:, None]) * k_token_stride
                               + kv_head * k_head_stride + dims[None, :],
                               mask=kv_mask, other=0.0).to(q.dtype)
                values = tl.load(v_ptr + (query_start + key_positions[:, None])
                                 * v_token_stride + kv_head * v_head_stride + dims[None, :],
                                 mask=kv_mask, other=0.0).to(q.dtype)
            else:  # the cache, through the block table
                blocks = tl.load(block_ids_ptr + block_start + key_positions // BLOCK_SIZE,
                                 mask=key_ok, other=0).to(tl.int64)
                slots = blocks * BLOCK_SIZE + key_positions % BLOCK_SIZE
                offsets = (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]
                keys = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
                values = tl.load(value_cache_ptr + offsets, mask=kv_mask,
                                 other=0.0).to(q.dtype)
            visible = key_ok[None, :] & (key_positions[None, :] <= positions[:, None])
            if WINDOWED:
                visible = visible & (key_positions[None, :] > positions[:, None] - window)
            running_max, running_sum, acc = attend_tile(q, keys, values, visible, sm_scale,
                                                        softcap, running_max, running_sum, acc,
                                                        EXACT, SOFTCAP)
        out = acc / running_sum[:, None] * tl.where(first, 1.0, v_scale)
        tl.store(out_ptr + (query_start + rows[:, None]) * out_token_stride
                 + head * out_head_stride + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def extend_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor,
                     seq_ids: torch.Tensor, query_starts: torch.Tensor,
                     num_computed: torch.Tensor, block_ids: torch.Tensor,
                     block_starts: torch.Tensor, max_queries: int, scale: float,
                     kv_scales: tuple[float, float] = (1.0, 1.0), window: int | None = None,
                     softcap: float | None = None) -> None:
    """Attention of the chunks of sequences `seq_ids` (a device tensor of sequence indices),
    written into their rows of `out`. q, k, v, out: the step's `[tokens, heads, head_dim]`
    (head_dim contiguous); the metadata as `AttentionMetadata` holds it, on the device;
    `max_queries` the longest chunk among them; `window` and `softcap` as in
    `decode_attention`."""
    num = seq_ids.shape[0]
    if num == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = q.shape[1]
    block_m = 16 if max_queries <= 16 else 32
    _extend[(num, num_heads, triton.cdiv(max_queries, block_m))](
        q, k, v, key_cache, value_cache, out, seq_ids, query_starts, num_computed, block_ids,
        block_starts, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), out.stride(0), out.stride(1), scale, kv_scales[0], kv_scales[1],
        window or 0, softcap or 1.0, NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=32, EXACT=exact_dots(q), WINDOWED=window is not None,
        SOFTCAP=softcap is not None)
