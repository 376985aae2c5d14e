"""How many paged KV cache blocks fit in a byte budget, and of which element type.

A block holds `block_size` tokens' K and V for every layer and KV head: `bytes_per_block` is
the same for every attention backend, whatever its layout. The tensor itself is allocated by
the attention backend (`runner/backends/`, `AttentionBackend.allocate_kv_cache`), which alone
knows how it lays the blocks out. Slot `s` is token `s % block_size` of block
`s // block_size`; the block manager in `core/` hands out block ids, the runner only indexes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from batchinfer.core.config import KV_CACHE_DTYPES
from batchinfer.core.validation import check_choice
from batchinfer.models.hardware import TORCH_DTYPES


class KVCacheSpec(Protocol):
    """The part of a model spec that sizes the KV cache (`ModelSpec` satisfies it).

    Read-only members, so frozen dataclasses satisfy it too.
    """

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Element type of the cache: `auto` follows the model's dtype, else the named type
    (`fp8_e4m3` / `fp8_e5m2`: torch's float8 types, stored with a per-layer scale)."""
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
    if kv_cache_dtype == "auto":
        return model_dtype
    return FP8_KV_DTYPES.get(kv_cache_dtype) or TORCH_DTYPES[kv_cache_dtype]


def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * element_bytes


def num_kv_blocks(
    spec: KVCacheSpec, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many whole blocks fit in `budget_bytes` (0 when not even one does)."""
    return max(0, budget_bytes // bytes_per_block(spec, block_size, dtype))

