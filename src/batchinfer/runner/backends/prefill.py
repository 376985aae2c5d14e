"""Attention of one sequence's chunk of queries over its context, shared by every backend.

A chunk's queries are at positions `[c, c + n)` of its sequence (`c = num_computed_tokens`);
they attend causally to the context `[0, c + n)`: the cached prefix plus the chunk itself, with
the causal diagonal offset by `c`. A first chunk (`c == 0`) attends to the step's own K/V
directly (SDPA's `is_causal`; on a CPU in float32 all first chunks of a step in one native call,
`native.packed_attention`), skipping the cache read, so with a narrower `kv_cache_dtype` a
first chunk attends at model precision and later reads at cache precision. Every backend follows
this rule, so they agree to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchinfer import native
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
    natively = _native_first_chunks(out, q, k, v, chunks, scale)
    for index, chunk in enumerate(chunks):
        span = slice(chunk.start, chunk.end)
        if chunk.is_first and natively:
            continue
        if chunk.is_first:
            keys, values = k[span].transpose(0, 1), v[span].transpose(0, 1)
            out[span] = chunk_attention(q[span], keys.to(q.dtype), values.to(q.dtype),
                                        chunk.mask, scale)
            continue
        keys, values = read_context(index)
        attended = chunk_attention(q[span], keys.to(q.dtype), values.to(q.dtype), chunk.mask,
                                   scale * k_scale)
        out[span] = attended if v_scale == 1.0 else attended * v_scale


def _native_first_chunks(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         chunks: list[Chunk], scale: float) -> bool:
    """Every first chunk's causal attention in one native call (CPU, float32: 1.9-2.2x SDPA's
    per-chunk calls on SmolLM2's heads here, `benchmarks/native_many_rows.py`); False where that cannot run, for the loop to do
    them."""
    firsts = [chunk for chunk in chunks if chunk.is_first]
    if not firsts or not all(t.dtype == torch.float32 and t.device.type == "cpu"
                             for t in (out, q, k, v)):
        return False
    lib = native.library()
    out_rows, q_rows, k_rows, v_rows = (_as_rows(t) for t in (out, q, k, v))
    if lib is None or out_rows is None or q_rows is None or k_rows is None or v_rows is None:
        return False
    native.packed_attention(lib, q_rows, k_rows, v_rows, [c.end - c.start for c in firsts],
                            q.shape[1], starts=[c.start for c in firsts], causal=True,
                            scale=scale, out=out_rows)
    return True


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """`[tokens, heads, d]` with heads side by side in a row as `[tokens, heads * d]` (a view),
    or None."""
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        return None
    return t.as_strided((t.shape[0], t.shape[1] * t.shape[2]), (t.stride(0), 1))


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
