"""`gather`: decodes by one gather of each group's K/V rows and one SDPA call, any device/dtype.

Each decode group's K and V rows are copied with one `index_select` into a reused workspace as
`[n, kv_heads, len, d]`, then one SDPA call takes the query heads of a KV head as its
query-length dimension (`[n, kv_heads, group, d]`), so grouped-query attention needs no K/V
repeat; a key mask `position < context_len` hides the padding of shorter contexts. Groups are
kept small enough that their copy is still in the CPU cache when SDPA reads it. A layer with a
sliding window masks the keys before it too; soft-capped scores (Gemma 2) are computed by an
explicit product and softmax (`prefill.capped_attention`), which SDPA cannot cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchinfer.runner.backends.paged_rows import (
    DecodeGroup,
    DecodeGrouping,
    PagedRowsBackend,
    context_rows,
    decode_visible,
    gather_blocks,
)
from batchinfer.runner.backends.prefill import capped_attention

# A group is cut past this padding (see `DecodeGrouping`): one more group costs a gather and an
# SDPA call per layer, which only pays off past a real amount of padding.
MAX_DECODE_PADDING_RATIO = 1.5
MAX_DECODE_PADDING_BLOCKS = 32
# A group's K and V copy stays within this many bytes, so it is still in the CPU cache when
# SDPA reads it.
DECODE_GROUP_BYTES = 4 << 20


class GatherBackend(PagedRowsBackend):
    """Block-rows cache; decode groups gathered then attended by SDPA (module docstring)."""

    name = "gather"

    def decode_grouping(self) -> DecodeGrouping:
        head_dim, element_bytes = self.kv_cache.shape[-1], self.kv_cache.element_size()
        token_bytes = 2 * self.num_kv_heads * head_dim * element_bytes
        max_group_tokens = max(1, DECODE_GROUP_BYTES // token_bytes)
        return DecodeGrouping(MAX_DECODE_PADDING_RATIO, MAX_DECODE_PADDING_BLOCKS, max_group_tokens)

    def _build_decode(self, group: DecodeGroup) -> _GatherDecode:
        return _GatherDecode.build(group, self.block_size, self.num_kv_heads)


@dataclass(slots=True)
class _GatherDecode:
    """Decode attention of one group: gather its K and V rows, then one SDPA call."""

    rows: torch.Tensor  # [2, n, kv_heads, num_blocks] cache rows to gather (see context_rows)
    group: DecodeGroup
    # Per window (None: whole contexts), [n, 1, 1, max_len] True at the keys a query sees.
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, group: DecodeGroup, block_size: int, num_kv_heads: int) -> _GatherDecode:
        return cls(context_rows(group.block_tables(), num_kv_heads), group)

    def mask(self, window: int | None) -> torch.Tensor:
        mask = self.masks.get(window)
        if mask is None:
            visible = decode_visible(self.group.positions, self.group.context_lens, window)
            mask = self.masks[window] = visible[:, None, None, :]
        return mask

    @property
    def num_gathered_rows(self) -> int:
        return self.rows.numel()

    def __call__(
        self, q: torch.Tensor, cache_rows: torch.Tensor, scale: float, workspace: torch.Tensor,
        window: int | None, softcap: float | None,
    ) -> torch.Tensor:
        """Attention of `q` `[n, heads, d]` over the group's contexts: `[n, heads, d]`."""
        n, num_heads, head_dim = q.shape
        keys, values = gather_blocks(cache_rows, self.rows, workspace)  # [n, kv, len, d]
        num_kv_heads = keys.shape[1]
        # Query heads h = kv * group_size + j share KV head kv: [n, kv_heads, group_size, d]
        grouped_q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        keys, values, mask = keys.to(q.dtype), values.to(q.dtype), self.mask(window)
        if softcap is not None:
            out = capped_attention(grouped_q, keys, values, mask, scale, softcap)
        else:
            out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask,
                                                 scale=scale)
        return out.reshape(n, num_heads, head_dim)
