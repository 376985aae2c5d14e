"""`cpu_sparse`: decodes read the cache rows in place, for CPU float32 caches only.

Scores are a sampled matmul (`torch.sparse.sampled_addmm`: one dot product per query head and
context position, its sparsity pattern naming the cache row of each key) and the weighted sum
of values an `embedding_bag` over the value rows. Each key and value is read once from memory
(the query heads sharing it find it in cache), where gather + SDPA (`gather`) writes and
re-reads a copy of the context, so this is faster on CPU (figures in docs/architecture.md,
"Attention backends"). Both ops are float32-only on CPU, hence only for such caches. A layer's
sliding window joins the padding in the additive mask; soft-capped scores are capped between
the product and the softmax.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchinfer.runner.backends.paged_rows import (
    DecodeGroup,
    DecodeGrouping,
    PagedRowsBackend,
    decode_visible,
)

# A group is cut past this padding (see `DecodeGrouping`) or this padded size: padding is
# computed in full here, against the fixed cost of one more group (per layer).
MAX_DECODE_PADDING_RATIO = 1.5
MAX_DECODE_PADDING_BLOCKS = 32
SPARSE_DECODE_GROUP_TOKENS = 6144


def supports_cpu_sparse(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether `cpu_sparse` can run: CPU and a float32 cache."""
    return device.type == "cpu" and kv_dtype == torch.float32


class CpuSparseBackend(PagedRowsBackend):
    """Block-rows cache; decode groups attend straight from the cache rows (module docstring)."""

    name = "cpu_sparse"

    def __init__(
        self, device: torch.device, kv_dtype: torch.dtype, calculate_kv_scales: bool = False
    ) -> None:
        if not supports_cpu_sparse(device, kv_dtype):
            raise ValueError(
                f"attention_backend cpu_sparse needs a CPU float32 KV cache, "
                f"got {device.type} {kv_dtype}"
            )
        super().__init__(device, kv_dtype)

    def decode_grouping(self) -> DecodeGrouping:
        return DecodeGrouping(
            MAX_DECODE_PADDING_RATIO, MAX_DECODE_PADDING_BLOCKS, SPARSE_DECODE_GROUP_TOKENS
        )

    def _build_decode(self, group: DecodeGroup) -> _SparseDecode:
        return _SparseDecode.build(group, self.block_size, self.num_kv_heads)


@dataclass(slots=True)
class _SparseDecode:
    """Decode attention of one group straight from the cache rows, without gathering them."""

    positions: torch.Tensor  # [n, max_len] row of KV head 0's key at each context position
    group: DecodeGroup
    head_rows: int  # rows between one KV head's keys and the next's (= block_size)
    value_offset: int  # a value's row is its key's + this (see `paged_rows`)
    # Built at the first call, once the number of query heads is known:
    key_rows: torch.Tensor | None = None  # [n * heads, max_len] key row per (query head, pos)
    pattern: torch.Tensor | None = None  # CSR [n * heads, cache rows] with `key_rows`
    # Per window (None: whole contexts), [n, 1, max_len] 0 where a query sees the key, -inf
    # at padding and before the window.
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, group: DecodeGroup, block_size: int, num_kv_heads: int) -> _SparseDecode:
        positions = group.positions
        blocks = group.blocks_at(positions // block_size)  # [n, max_len]
        rows = blocks * (2 * num_kv_heads * block_size) + positions % block_size
        return cls(rows, group, block_size, num_kv_heads * block_size)

    def mask(self, window: int | None) -> torch.Tensor:
        mask = self.masks.get(window)
        if mask is None:
            visible = decode_visible(self.group.positions, self.group.context_lens, window)
            mask = self.masks[window] = torch.where(visible, 0.0, float("-inf"))[:, None, :]
        return mask

    @property
    def num_gathered_rows(self) -> int:
        return 0

    def __call__(
        self, q: torch.Tensor, cache_rows: torch.Tensor, scale: float, workspace: torch.Tensor,
        window: int | None, softcap: float | None,
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
        if softcap is not None:
            scores = torch.tanh(scores / softcap).mul_(softcap)
        probs = torch.add(scores, self.mask(window)).softmax(dim=-1)
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
