"""The paged KV cache tensor and how many blocks of it fit in a byte budget.

One tensor holds every layer's K and V. Callers see it as
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`: `cache[layer, 0]` is that
layer's K blocks `[num_blocks, block_size, num_kv_heads, head_dim]` and `cache[layer, 1]` its V
blocks. Slot `s` of a layer is token `s % block_size` of block `s // block_size`; the block
manager in `core/` hands out block ids, the runner only indexes.

In memory the order is different, `[num_layers, num_blocks, 2, num_kv_heads, block_size,
head_dim]` (the tensor returned is a permuted view of that storage): a block's K and V sit
together, and each head's tokens are one contiguous `[block_size, head_dim]` row. Attention
reads a context with one `index_select` of such rows (see `layer_rows`) straight into the
`[kv_heads, context_len, head_dim]` layout its matmuls want, with no transposing copy.
"""

from __future__ import annotations

from typing import Protocol

import torch

# Bytes kept free on CUDA for activations when no profiled figure is given.
DEFAULT_ACTIVATION_BYTES = 1 << 30

_KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class KVCacheSpec(Protocol):
    """The part of a model spec that sizes the KV cache (`ModelSpec` satisfies it)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """Element type of the cache: `auto` follows the model's dtype, else the named type."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be auto or one of {', '.join(_KV_DTYPES)}; got {kv_cache_dtype!r}"
        )
    return _KV_DTYPES[kv_cache_dtype]


def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * element_bytes


def num_kv_blocks(
    spec: KVCacheSpec, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many whole blocks fit in `budget_bytes` (0 when not even one does)."""
    return max(0, budget_bytes // bytes_per_block(spec, block_size, dtype))


def kv_cache_budget_bytes(
    device: torch.device,
    kv_cache_memory: int,
    gpu_memory_utilization: float,
    activation_bytes: int = DEFAULT_ACTIVATION_BYTES,
) -> int:
    """Bytes the KV cache may take on `device`, measured after the weights are loaded.

    CPU: `kv_cache_memory`. CUDA: `gpu_memory_utilization * total - in_use - activation_bytes`,
    where `in_use` (from `torch.cuda.mem_get_info`) already counts the weights and anything else
    resident on the GPU, so the cache never pushes the process past its share.
    """
    if device.type != "cuda":
        return kv_cache_memory
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    in_use_bytes = total_bytes - free_bytes
    return max(0, int(gpu_memory_utilization * total_bytes) - in_use_bytes - activation_bytes)


def allocate_kv_cache(
    spec: KVCacheSpec,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Zeroed cache, seen as `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`.

    Zeroed rather than empty so that padded (masked) reads never see NaN bit patterns: a masked
    score is dropped by the softmax, but NaN * 0 in the value product would still be NaN.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    storage = torch.zeros(
        (spec.num_layers, num_blocks, 2, spec.num_kv_heads, block_size, spec.head_dim),
        dtype=dtype,
        device=device,
    )
    return storage.permute(0, 2, 1, 4, 3, 5)


def layer_rows(kv_cache: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """One layer's cache as rows `[num_blocks * 2 * num_kv_heads, block_size, head_dim]`.

    Row `(block * 2 + kind) * num_kv_heads + head` holds the K (kind 0) or V (kind 1) of `head`
    for the block's tokens. `kv_cache` must come from `allocate_kv_cache` (RuntimeError else).
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache[layer_idx].shape
    storage = kv_cache[layer_idx].permute(1, 0, 3, 2, 4)  # [num_blocks, 2, kv, bs, d]
    if not storage.is_contiguous():
        raise RuntimeError("kv_cache is not laid out by allocate_kv_cache")
    return storage.view(num_blocks * 2 * num_kv_heads, block_size, head_dim)
