"""Paged decode attention: one query token per sequence over its cached context.

One program per (sequence, KV head, split): the query heads that share the KV head (GQA) are
one tile, so each K/V block is read once for all of them; the block table is read in the
kernel; the context's blocks are divided among `num_splits` programs (split-K), whose partial
softmax states (max, sum, weighted values) a second kernel combines. FP8 caches are read as
they are stored: `q . (K k_scale)` folds `k_scale` into the softmax scale and `v_scale`
multiplies the output. A layer's sliding window (`window` > 0) hides the keys before a query's
last `window` and skips the blocks wholly before it; soft-capping (`softcap` > 0) caps each
score at `softcap * tanh(score / softcap)` before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = -1.0e30  # a masked score: finite, so a tile with nothing visible yet gives no NaN


def exact_dots(q: torch.Tensor) -> bool:
    """Whether the kernels' products run in float32 (IEEE): for float32 models (no TF32
    rounding), and under the interpreter (on the CPU), whose half-precision products are not
    exact. bfloat16 / float16 products are exact in float32, so both forms compute the same."""
    return q.dtype == torch.float32 or q.device.type == "cpu"


@triton.jit
def attend_tile(q, keys, values, visible, sm_scale, softcap, running_max, running_sum, acc,
                EXACT: tl.constexpr, SOFTCAP: tl.constexpr):
    """One tile of keys in the online softmax: the scores of `q` `[M, D]` against `keys`
    `[N, D]` where `visible` `[M, N]` (soft-capped at `softcap` where `SOFTCAP`), folded into
    the running max, sum and weighted values. A row with nothing visible yet adds garbage
    weights of 1 to its sum and values; the first visible score rescales them by
    `exp(NEG - max) = 0`, and every query sees at least itself."""
    if EXACT:
        scores = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(keys))
    scores = scores * sm_scale
    if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
    scores = tl.where(visible, scores, NEG)
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    alpha = tl.exp(running_max - new_max)
    p = tl.exp(scores - new_max[:, None])
    running_sum = running_sum * alpha + tl.sum(p, axis=1)
    if EXACT:
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype).to(tl.float32),
                                            values.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
    return new_max, running_sum, acc


@triton.jit
def _decode_split(q_ptr, key_cache_ptr, value_cache_ptr, block_ids_ptr, block_starts_ptr,
                  context_lens_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                  first_seq, q_token_stride, q_head_stride, sm_scale, window, softcap,
                  NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_SIZE_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  EXACT: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = first_seq + row
    context_len = tl.load(context_lens_ptr + seq)
    block_start = tl.load(block_starts_ptr + seq)
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    first_block = split * per_split
    last_block = tl.minimum(first_block + per_split, num_blocks)
    first_key = 0
    if WINDOWED:  # keys before the window: never visible, their blocks never read
        first_key = tl.maximum(context_len - window, 0)
        first_block = tl.maximum(first_block, first_key // BLOCK_SIZE)

    heads = tl.arange(0, GROUP_P)
    dims = tl.arange(0, HEAD_DIM_P)
    tokens = tl.arange(0, BLOCK_SIZE_P)
    head_ok = heads < GROUP
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * GROUP + heads
    q = tl.load(q_ptr + seq * q_token_stride + q_heads[:, None] * q_head_stride + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)

    running_max = tl.full([GROUP_P], NEG, tl.float32)
    running_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    for b in range(first_block, last_block):
        block = tl.load(block_ids_ptr + block_start + b).to(tl.int64)
        positions = b * BLOCK_SIZE + tokens
        visible = (tokens < BLOCK_SIZE) & (positions < context_len) & (positions >= first_key)
        offsets = ((block * BLOCK_SIZE + tokens[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM \
            + dims[None, :]
        kv_mask = visible[:, None] & dim_ok[None, :]
        keys = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
        values = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
        running_max, running_sum, acc = attend_tile(q, keys, values, visible[None, :],
                                                    sm_scale, softcap, running_max,
                                                    running_sum, acc, EXACT, SOFTCAP)

    part = (row * NUM_KV_HEADS * GROUP + q_heads) * NUM_SPLITS + split
    tl.store(part_max_ptr + part, running_max, mask=head_ok)
    tl.store(part_sum_ptr + part, running_sum, mask=head_ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
             mask=head_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_combine(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, first_seq,
                    out_token_stride, out_head_stride, v_scale, NUM_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, NUM_SPLITS_P: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    split_ok = splits < NUM_SPLITS
    part = (row * NUM_HEADS + head) * NUM_SPLITS + splits
    maxes = tl.load(part_max_ptr + part, mask=split_ok, other=NEG)
    sums = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    accs = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                   mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    weights = tl.exp(maxes - tl.max(maxes, axis=0))
    out = tl.sum(accs * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0) * v_scale
    tl.store(out_ptr + (first_seq + row) * out_token_stride + head * out_head_stride + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def num_splits_for(max_blocks: int, num_decodes: int, num_kv_heads: int,
                   programs: int = 128) -> int:
    """Splits of the longest context so that the launch has about `programs` programs, each
    with at least 4 blocks (fewer splits: less combining; more: more parallel reads)."""
    wanted = triton.cdiv(programs, max(1, num_decodes * num_kv_heads))
    return max(1, min(wanted, triton.cdiv(max_blocks, 4), 32))


def decode_attention(out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, block_ids: torch.Tensor,
                     block_starts: torch.Tensor, context_lens: torch.Tensor, first_seq: int,
                     num_seqs: int, num_splits: int, scale: float,
                     kv_scales: tuple[float, float] = (1.0, 1.0), window: int | None = None,
                     softcap: float | None = None) -> None:
    """Attention of sequences `[first_seq, first_seq + num_seqs)` (one query each, at batch
    row = sequence index) over their cached contexts (the last `window` keys of each where
    given; scores soft-capped at `softcap` where given), written into their rows of `out`.

    q, out: `[tokens, heads, head_dim]` (head_dim contiguous); caches `[blocks, block_size,
    kv_heads, head_dim]`; `block_ids` every block table concatenated, `block_starts[i]` where
    sequence i's begins; `context_lens[i]` its tokens, the query's own included."""
    if num_seqs == 0:
        return
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                           device=q.device)
    part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                           device=q.device)
    part_sum = torch.empty_like(part_max)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    _decode_split[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, block_ids, block_starts, context_lens, part_acc, part_max,
        part_sum, first_seq, q.stride(0), q.stride(1), scale * kv_scales[0], window or 0,
        softcap or 1.0, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size,
        BLOCK_SIZE_P=max(16, triton.next_power_of_2(block_size)), NUM_SPLITS=num_splits,
        EXACT=exact_dots(q), WINDOWED=window is not None, SOFTCAP=softcap is not None)
    _decode_combine[(num_seqs, num_heads)](
        part_acc, part_max, part_sum, out, first_seq, out.stride(0), out.stride(1),
        kv_scales[1], NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        NUM_SPLITS=num_splits, NUM_SPLITS_P=triton.next_power_of_2(num_splits))
