"""`sdpa`: one SDPA call per sequence over its whole context; the portable reference.

The simplest correct backend, for any device and dtype, against which the others are tested:
the cache is per layer a K and a V tensor `[num_blocks, block_size, num_kv_heads, head_dim]`
(one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`), slot `s` being
token `s % block_size` of block `s // block_size`. Each sequence, decode or prefill chunk, reads
its context with `cache[block_table]` (from the first block its layer's window reaches) and
attends through `prefill.attend_chunks`: no grouping, no workspace, one call per sequence and
layer.
"""

from __future__ import annotations

import torch

from batchinfer.runner.backends.base import BackendBase
from batchinfer.runner.backends.prefill import Chunk, attend_chunks, build_chunks
from batchinfer.runner.input_batch import AttentionMetadata
from batchinfer.runner.kv_cache import KVCacheSpec


class SdpaBackend(BackendBase):
    """Per-sequence SDPA over a `[layers, 2, blocks, block_size, kv_heads, d]` cache."""

    name = "sdpa"
    block_dim = 2

    def __init__(
        self, device: torch.device, kv_dtype: torch.dtype, calculate_kv_scales: bool = False
    ) -> None:
        super().__init__(device, kv_dtype, calculate_kv_scales)
        self._step: tuple[torch.Tensor, list[Chunk]] | None = None  # slot mapping, chunks

    def _cache_shape(
        self, spec: KVCacheSpec, num_blocks: int, block_size: int
    ) -> tuple[int, ...]:
        return (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)

    def build(self, metadata: AttentionMetadata) -> None:
        """Prepare the step: its slots and one chunk (span, mask, blocks) per sequence."""
        self._check_step(metadata)
        self._step = (metadata.slot_mapping, build_chunks(metadata, 0))

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        if self._step is None:
            raise RuntimeError(f"{self.name}: called before build()")
        slots, chunks = self._step
        key_cache, value_cache = self.kv_cache[layer_idx]  # [num_blocks, bs, kv_heads, d] each
        num_kv_heads, head_dim = key_cache.shape[-2:]
        k_stored, v_stored = self.quantize(layer_idx, k, v)
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = k_stored
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = v_stored

        def read_context(index: int, first_key: int) -> tuple[torch.Tensor, torch.Tensor]:
            chunk, block_size = chunks[index], key_cache.shape[1]
            first_block = first_key // block_size
            block_ids = chunk.block_ids[first_block:]
            span = slice(first_key - first_block * block_size,
                         chunk.context_len - first_block * block_size)
            keys = key_cache[block_ids].view(-1, num_kv_heads, head_dim)[span]
            values = value_cache[block_ids].view(-1, num_kv_heads, head_dim)[span]
            return keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, len, d]

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        attend_chunks(out, q, k, v, chunks, read_context, self.layer(layer_idx, head_dim),
                      self.kv_scales[layer_idx])
        return out
