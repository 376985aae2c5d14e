"""What every attention backend here shares: the cache tensor it allocates, in its own layout."""

from __future__ import annotations

import torch

from batchinfer.runner.input_batch import AttentionMetadata
from batchinfer.runner.kv_cache import KVCacheSpec


class BackendBase:
    """Holds `kv_cache` (empty until `allocate_kv_cache`) and checks a step fits it.

    A subclass names its layout by `_cache_shape`; the tensor always holds
    `2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim` elements, so
    `kv_cache.bytes_per_block` sizes every backend's cache alike.
    """

    name = "base"

    def __init__(self, device: torch.device, kv_dtype: torch.dtype) -> None:
        self.device = device
        self.kv_dtype = kv_dtype
        self.block_size = 0
        self.kv_cache = torch.empty(0, dtype=kv_dtype, device=device)

    def _cache_shape(
        self, spec: KVCacheSpec, num_blocks: int, block_size: int
    ) -> tuple[int, ...]:
        raise NotImplementedError

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, block_size: int) -> None:
        """Allocate the zeroed cache of `num_blocks` blocks of `block_size` tokens.

        Zeroed rather than empty so that padded (masked) reads never see NaN bit patterns: a
        masked score is dropped by the softmax, but NaN * 0 in the value product would still
        be NaN.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        shape = self._cache_shape(spec, num_blocks, block_size)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.block_size = block_size

    def _check_step(self, metadata: AttentionMetadata) -> None:
        if self.kv_cache.numel() == 0:
            raise RuntimeError(f"{self.name}: build() before allocate_kv_cache()")
        if metadata.block_size != self.block_size:
            raise RuntimeError(
                f"{self.name}: step built for block_size {metadata.block_size}, "
                f"cache has {self.block_size}"
            )
