"""Attention of one sequence's chunk of queries over its context, shared by every backend.

A chunk's queries are at positions `[c, c + n)` of its sequence (`c = num_computed_tokens`);
they attend causally to the context `[0, c + n)`: the cached prefix plus the chunk itself, with
the causal diagonal offset by `c`. A first chunk (`c == 0`) attends to the step's own K/V
directly with SDPA's `is_causal`, skipping the cache read, so with a narrower `kv_cache_dtype` a
first chunk attends at model precision and later reads at cache precision. Every backend follows
this rule, so they agree to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchinfer.runner.input_batch import AttentionMetadata

# `enable_gqa` appeared in torch 2.5; before it K/V are repeated per query group.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

# (chunk index) -> its context's keys and values, `[num_kv_heads, context_len, head_dim]` each.
ContextReader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class Chunk:
    """Queries `[start, end)` of the batch, one sequence's, over a `context_len`-token context."""

    start: int
    end: int
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] the context's blocks
    mask: torch.Tensor | None  # [end - start, context_len] True where a query sees a key

    @property
    def is_first(self) -> bool:
        """Nothing cached before it: its context is exactly this step's own K/V."""
        return self.mask is None


def build_chunks(metadata: AttentionMetadata, first_seq: int) -> list[Chunk]:
    """One `Chunk` per sequence from `first_seq` on; masks built here, once per step."""
    chunks = []
    for i in range(first_seq, metadata.num_seqs):
        start, end = metadata.query_starts[i], metadata.query_starts[i + 1]
        num_computed, context_len = metadata.num_computed_tokens[i], metadata.context_lens[i]
        mask = None
        if num_computed > 0:
            device = metadata.block_ids.device
            query_positions = torch.arange(end - start, device=device) + num_computed
            mask = torch.arange(context_len, device=device) <= query_positions[:, None]
        chunks.append(Chunk(start, end, context_len, metadata.block_table(i), mask))
    return chunks


def attend_chunks(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[Chunk],
    read_context: ContextReader,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Write each chunk's attention into its rows of `out` (`[num_tokens, heads, d]`).

    `q`, `k`, `v` are the whole step's; `read_context(i)` reads chunk `i`'s cached context in
    the backend's layout, and is called only for chunks that are not first chunks. A cached
    context stored as `K / k_scale`, `V / v_scale` (FP8, `kv_scales`) is attended with the
    softmax scale times `k_scale` and its output times `v_scale`.
    """
    k_scale, v_scale = kv_scales
    for index, chunk in enumerate(chunks):
        span = slice(chunk.start, chunk.end)
        if chunk.is_first:
            keys, values = k[span].transpose(0, 1), v[span].transpose(0, 1)
            out[span] = chunk_attention(q[span], keys.to(q.dtype), values.to(q.dtype),
                                        chunk.mask, scale)
            continue
        keys, values = read_context(index)
        attended = chunk_attention(q[span], keys.to(q.dtype), values.to(q.dtype), chunk.mask,
                                   scale * k_scale)
        out[span] = attended if v_scale == 1.0 else attended * v_scale


def chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one chunk `[n, heads, d]` over its context `[kv_heads, ctx, d]`.

    `mask` None means `is_causal` (query i sees keys `[0, i]`). Inputs go to SDPA as 4-D
    `[1, heads, len, d]`: with 3-D ones torch's CPU SDPA takes a much slower path.
    """
    num_heads, num_kv_heads = q.shape[1], keys.shape[0]
    q_t = q.transpose(0, 1)[None]  # [1, heads, n, d]
    keys, values = keys[None], values[None]  # [1, kv_heads, ctx, d]
    is_causal = mask is None
    if num_heads == num_kv_heads:
        out = F.scaled_dot_product_attention(
            q_t, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale
        )
    elif _SDPA_HAS_GQA:
        out = F.scaled_dot_product_attention(
            q_t, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    else:
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(
            q_t, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale
        )
    return out[0].transpose(0, 1)
