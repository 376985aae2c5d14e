"""Attention of one sequence's chunk of queries over its context, shared by every backend.

A chunk's queries are at positions `[c, c + n)` of its sequence (`c = num_computed_tokens`);
they attend causally to the context `[0, c + n)`: the cached prefix plus the chunk itself, with
the causal diagonal offset by `c`. A first chunk (`c == 0`) attends to the step's own K/V
directly (SDPA's `is_causal`; on a CPU in float32 all first chunks of a step in one native call,
`native.packed_attention`), skipping the cache read, so with a narrower `kv_cache_dtype` a
first chunk attends at model precision and later reads at cache precision. Every backend follows
this rule, so they agree to rounding.

A layer with a sliding `window` (`LayerAttention`) sees only keys `p - window + 1 .. p` from a
query at `p`: the mask says so, and a later chunk reads its context only from the first key any
of its queries sees (`Chunk.first_key`), so keys wholly before the window are never read (their
blocks may be freed: docs/architecture.md, "Sliding windows"). Soft-capped scores
(`softcap * tanh(score / softcap)`, Gemma 2) take an explicit product and softmax instead of
SDPA, which cannot cap them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchinfer import native
from batchinfer.models.spec import LayerAttention
from batchinfer.runner.input_batch import AttentionMetadata

# `enable_gqa` appeared in torch 2.5; before it K/V are repeated per query group.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

# (chunk index, first key) -> its context's keys and values from position `first key` on,
# `[num_kv_heads, context_len - first_key, head_dim]` each.
ContextReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class Chunk:
    """Queries `[start, end)` of the batch, one sequence's, at positions `[num_computed,
    context_len)` of it."""

    start: int
    end: int
    num_computed: int
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] the context's blocks
    # Per window (None: full attention), `[end - start, context_len - first_key]` True where a
    # query sees a key; built once per step for each window a layer has.
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def is_first(self) -> bool:
        """Nothing cached before it: its context is exactly this step's own K/V."""
        return self.num_computed == 0

    def first_key(self, window: int | None) -> int:
        """The first context position any of its queries sees under `window`."""
        return 0 if window is None else max(0, self.num_computed - window + 1)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Which keys of the context from `first_key(window)` on each query sees; None where
        that is plain causal attention over the chunk itself (SDPA's `is_causal`)."""
        num_queries = self.end - self.start
        if self.is_first and (window is None or num_queries <= window):
            return None
        mask = self._masks.get(window)
        if mask is None:
            device = self.block_ids.device
            first_key = self.first_key(window)
            queries = torch.arange(num_queries, device=device)[:, None] + self.num_computed
            keys = torch.arange(first_key, self.context_len, device=device)
            mask = keys <= queries
            if window is not None:
                mask &= keys > queries - window
            self._masks[window] = mask
        return mask


def build_chunks(metadata: AttentionMetadata, first_seq: int) -> list[Chunk]:
    """One `Chunk` per sequence from `first_seq` on (masks are built at their first use)."""
    chunks = []
    for i in range(first_seq, metadata.num_seqs):
        start, end = metadata.query_starts[i], metadata.query_starts[i + 1]
        chunks.append(Chunk(start, end, metadata.num_computed_tokens[i],
                            metadata.context_lens[i], metadata.block_table(i)))
    return chunks


def attend_chunks(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[Chunk],
    read_context: ContextReader,
    layer: LayerAttention,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Write each chunk's attention into its rows of `out` (`[num_tokens, heads, d]`), as
    `layer` attends (scale, window, soft-capping).

    `q`, `k`, `v` are the whole step's; `read_context(i, first_key)` reads chunk `i`'s cached
    context from `first_key` on in the backend's layout, and is called only for chunks that
    are not first chunks. A cached context stored as `K / k_scale`, `V / v_scale` (FP8,
    `kv_scales`) is attended with the softmax scale times `k_scale` and its output times
    `v_scale`.
    """
    k_scale, v_scale = kv_scales
    window, softcap = layer.window, layer.softcap
    natively = _native_first_chunks(out, q, k, v, chunks, layer)
    for index, chunk in enumerate(chunks):
        span = slice(chunk.start, chunk.end)
        if chunk.is_first and natively:
            continue
        if chunk.is_first:
            keys, values = k[span].transpose(0, 1), v[span].transpose(0, 1)
            out[span] = chunk_attention(q[span], keys.to(q.dtype), values.to(q.dtype),
                                        chunk.mask(window), layer.scale, softcap)
            continue
        keys, values = read_context(index, chunk.first_key(window))
        attended = chunk_attention(q[span], keys.to(q.dtype), values.to(q.dtype),
                                   chunk.mask(window), layer.scale * k_scale, softcap)
        out[span] = attended if v_scale == 1.0 else attended * v_scale


def _native_first_chunks(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         chunks: list[Chunk], layer: LayerAttention) -> bool:
    """Every first chunk's causal attention in one native call (CPU, float32: 1.9-2.2x SDPA's
    per-chunk calls on SmolLM2's heads here, `benchmarks/native_many_rows.py`); False where that cannot run, for the loop to do
    them. The native call computes plain causal attention: not soft-capped scores, nor a
    window shorter than a chunk."""
    firsts = [chunk for chunk in chunks if chunk.is_first]
    if not firsts or not all(t.dtype == torch.float32 and t.device.type == "cpu"
                             for t in (out, q, k, v)):
        return False
    if layer.softcap is not None or any(c.mask(layer.window) is not None for c in firsts):
        return False
    lib = native.library()
    out_rows, q_rows, k_rows, v_rows = (_as_rows(t) for t in (out, q, k, v))
    if lib is None or out_rows is None or q_rows is None or k_rows is None or v_rows is None:
        return False
    native.packed_attention(lib, q_rows, k_rows, v_rows, [c.end - c.start for c in firsts],
                            q.shape[1], starts=[c.start for c in firsts], causal=True,
                            scale=layer.scale, out=out_rows)
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
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one chunk `[n, heads, d]` over its context `[kv_heads, ctx, d]`.

    `mask` None means `is_causal` (query i sees keys `[0, i]`). Inputs go to SDPA as 4-D
    `[1, heads, len, d]`: with 3-D ones torch's CPU SDPA takes a much slower path. Soft-capped
    scores go through `capped_attention` instead.
    """
    num_heads, num_kv_heads = q.shape[1], keys.shape[0]
    if softcap is not None:
        if mask is None:  # causal over the chunk itself: context == chunk
            mask = torch.ones(q.shape[0], keys.shape[1], dtype=torch.bool,
                              device=q.device).tril_()
        grouped = q.transpose(0, 1).reshape(num_kv_heads, -1, q.shape[-1])  # [kv, g * n, d]
        out = capped_attention(grouped, keys, values, mask.repeat(num_heads // num_kv_heads, 1),
                               scale, softcap)  # [kv, g * n, d]
        return out.view(num_heads, q.shape[0], -1).transpose(0, 1)
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


def capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores, `softmax(cap * tanh(q k^T scale / cap)) v` where
    `mask`, in float32: q `[..., m, d]` over keys, values `[..., len, d]` (leading dimensions
    alike), mask broadcasting to `[..., m, len]`; returns `[..., m, d]` in q's dtype."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)).mul_(scale / softcap)
    scores = scores.tanh_().mul_(softcap).masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), values.float()).to(q.dtype)
