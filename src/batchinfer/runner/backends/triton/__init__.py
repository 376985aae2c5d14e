"""`triton`: paged attention in Triton kernels, reading the cache through the block table.

The cache has `sdpa`'s layout, `[layers, 2, blocks, block_size, kv_heads, head_dim]`, in any
KV dtype (float32, bfloat16, float16, FP8 e4m3 / e5m2 with per-layer scales), read and written
natively by the kernels. Per layer a step is at most three launches:
- `kv_write`: every new token's K and V stored at its slot (FP8: scaled and clamped);
- `decode`: the decodes (one query, something cached before it), split-K over their blocks, the
  query heads of a KV head together;
- `extend`: every other chunk (prefills, later chunks, a one-token prompt), varlen, causal.
The rules are every backend's (`backends/prefill.py`: sliding windows and soft-capping
included), so tokens agree with `sdpa`'s.

It runs where Triton does: CUDA, or a CPU under `TRITON_INTERPRET=1` (the interpreter, for
tests: slow, exact).
"""

from __future__ import annotations

import os

import torch

from batchinfer.runner.backends.base import BackendBase
from batchinfer.runner.input_batch import AttentionMetadata
from batchinfer.runner.kv_cache import KVCacheSpec


def triton_available() -> bool:
    """True where the `triton` package imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def supports_triton(device: torch.device) -> bool:
    """True where these kernels can run on `device`: CUDA with Triton, or a CPU with Triton's
    interpreter turned on (`TRITON_INTERPRET=1`)."""
    if not triton_available():
        return False
    return device.type == "cuda" or (device.type == "cpu"
                                     and os.environ.get("TRITON_INTERPRET") == "1")


class TritonBackend(BackendBase):
    """Triton kernels over a `[layers, 2, blocks, block_size, kv_heads, d]` cache."""

    name = "triton"
    block_dim = 2

    def __init__(
        self, device: torch.device, kv_dtype: torch.dtype, calculate_kv_scales: bool = False
    ) -> None:
        if not supports_triton(device):
            raise ValueError(
                "attention_backend triton needs the triton package and a CUDA device (or, on "
                "a CPU, TRITON_INTERPRET=1: the interpreter, for tests)")
        super().__init__(device, kv_dtype, calculate_kv_scales)
        self._metadata: AttentionMetadata | None = None
        self._first_decode = 0  # decodes [first_decode, num_decodes) run in `decode`
        self._num_splits = 1
        self._extend: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    def _cache_shape(
        self, spec: KVCacheSpec, num_blocks: int, block_size: int
    ) -> tuple[int, ...]:
        return (spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)

    def build(self, metadata: AttentionMetadata) -> None:
        """Split the step: decodes with a cached context go to `decode` (in one launch, split
        by the longest context); the other chunks, one-token prompts included, to `extend`."""
        from batchinfer.runner.backends.triton.decode import num_splits_for

        self._check_step(metadata)
        self._metadata = metadata
        num_decodes = metadata.num_decodes
        # Decodes are sorted by context length: those with nothing cached (length 1) lead.
        first_decode = 0
        while first_decode < num_decodes and metadata.num_computed_tokens[first_decode] == 0:
            first_decode += 1
        self._first_decode = first_decode
        if first_decode < num_decodes:
            max_blocks = -(-metadata.context_lens[num_decodes - 1] // metadata.block_size)
            self._num_splits = num_splits_for(max_blocks, num_decodes - first_decode,
                                              self.kv_cache.shape[4])
        extend = list(range(first_decode)) + list(range(num_decodes, metadata.num_seqs))
        self._extend = None
        if extend:
            starts = metadata.query_starts
            max_queries = max(starts[i + 1] - starts[i] for i in extend)
            data = torch.tensor(extend + starts + metadata.num_computed_tokens,
                                dtype=torch.int32).to(self.device, non_blocking=True)
            n, s = len(extend), len(starts)
            self._extend = (data[:n], data[n : n + s], data[n + s :], max_queries)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        from batchinfer.runner.backends.triton.decode import decode_attention
        from batchinfer.runner.backends.triton.extend import extend_attention
        from batchinfer.runner.backends.triton.kv_write import write_kv

        metadata = self._metadata
        if metadata is None:
            raise RuntimeError(f"{self.name}: called before build()")
        q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
        key_cache, value_cache = self.kv_cache[layer_idx]
        scales = self.layer_scales(layer_idx, k, v)
        write_kv(k, v, key_cache, value_cache, metadata.slot_mapping, scales)
        layer = self.layer(layer_idx, q.shape[-1])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = metadata.num_decodes - self._first_decode
        decode_attention(out, q, key_cache, value_cache, metadata.block_ids,
                         metadata.block_starts_tensor, metadata.context_lens_tensor,
                         self._first_decode, num_decodes, self._num_splits, layer.scale, scales,
                         layer.window, layer.softcap)
        if self._extend is not None:
            seq_ids, query_starts, num_computed, max_queries = self._extend
            extend_attention(out, q, k, v, key_cache, value_cache, seq_ids, query_starts,
                             num_computed, metadata.block_ids, metadata.block_starts_tensor,
                             max_queries, layer.scale, scales, layer.window, layer.softcap)
        return out
