"""The attention backend contract, and the choice of a backend at start-up.

An `AttentionBackend` owns the paged KV cache (`allocate_kv_cache`, in a layout only it knows)
and computes attention over it. Once per step the runner calls `build(metadata)` with that
step's `AttentionMetadata` (generic: per sequence its query rows, `num_computed_tokens`,
context length and block table, plus the slot mapping; see `input_batch.py`); the backend
prepares everything that depends only on the step (row indices, masks, decode grouping) and is
then handed to `model.forward` as its `attention(layer_idx, q, k, v)` callable, so the metadata
travels explicitly, never through a global. Per layer, `__call__` writes this step's K/V at
their slots and returns the attention output; q and k arrive with RoPE applied. How each layer
attends is the model's (`set_layers`, one `LayerAttention` per layer from `ModelSpec`): the
softmax scale (`1 / sqrt(head_dim)`, or Gemma's `query_pre_attn_scalar`), a sliding window
(Mistral, Qwen2, Phi-3, Gemma's local layers: a query at `p` sees keys `p - window + 1 .. p`)
and soft-capped scores (Gemma 2). Every backend follows the same rules (causal over the
context, within the layer's window; a first chunk attends to its own K/V at model precision;
see `backends/prefill.py`), so they agree to rounding.

Backends (`runner/backends/`), by name:
- `sdpa`: one SDPA per sequence; any device and dtype; the reference the others are tested
  against, not tuned;
- `gather`: decodes in groups of similar context length, each group's K/V gathered into a
  workspace and attended by one SDPA call; any device and dtype;
- `cpu_sparse`: decodes in groups read straight from the cache by a sampled matmul and an
  `embedding_bag`; CPU float32 caches only;
- `triton`: Triton kernels (paged decode with split-K, varlen extend, the KV write) reading
  every KV dtype natively; CUDA (or a CPU under `TRITON_INTERPRET=1`, for tests);
- `auto`: `triton` on CUDA where Triton is installed, `cpu_sparse` where it runs, else
  `gather`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from batchinfer.core.config import ATTENTION_BACKENDS
from batchinfer.models.spec import LayerAttention
from batchinfer.runner.backends.cpu_sparse import CpuSparseBackend, supports_cpu_sparse
from batchinfer.runner.backends.gather import GatherBackend
from batchinfer.runner.backends.sdpa import SdpaBackend
from batchinfer.runner.backends.triton import TritonBackend, triton_available
from batchinfer.runner.input_batch import AttentionMetadata
from batchinfer.runner.kv_cache import KVCacheSpec


class AttentionBackend(Protocol):
    """Paged attention over a KV cache the backend allocates and lays out itself.

    `kv_cache` is the cache tensor, in the backend's own layout (empty before
    `allocate_kv_cache`); it takes `num_blocks * kv_cache.bytes_per_block(...)` bytes, like
    every backend's. `build` is called once per step, `__call__` once per layer of that step.
    """

    name: str
    kv_cache: torch.Tensor

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int, block_size: int) -> None:
        """Allocate the zeroed cache: `num_blocks` blocks of `block_size` tokens, all layers."""
        ...

    def set_layers(self, layers: Sequence[LayerAttention]) -> None:
        """How each layer attends (scale, window, soft-capping); plain causal without it."""
        ...

    def build(self, metadata: AttentionMetadata) -> None:
        """Prepare one step; RuntimeError if the cache is not allocated for its block size."""
        ...

    def reset_kv_scales(self) -> None:
        """FP8: scales back to 1.0 (calibrated again by the next step if asked to)."""
        ...

    def allocate_swap_space(self, num_blocks: int) -> None:
        """Host memory for `num_blocks` swapped-out blocks, in the cache's layout."""
        ...

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, host block) pairs out to the swap space."""
        ...

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host block, device block) pairs back into the cache."""
        ...

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write `k`, `v` at the step's slots of layer `layer_idx`, return the attention.

        q: `[num_tokens, num_heads, head_dim]`; k, v: `[num_tokens, num_kv_heads, head_dim]`;
        returns `[num_tokens, num_heads, head_dim]` in q's dtype.
        """
        ...


def select_attention_backend(
    device: torch.device,
    kv_dtype: torch.dtype,
    name: str = "auto",
    calculate_kv_scales: bool = False,
) -> AttentionBackend:
    """The backend called `name` for a cache of `kv_dtype` on `device` (not yet allocated).

    `auto` picks `triton` on CUDA where Triton imports, `cpu_sparse` on CPU with a float32
    cache, else `gather`. ValueError naming
    `attention_backend` for an unknown name, or `cpu_sparse` where it cannot run. With an FP8
    cache, `calculate_kv_scales` sets each layer's scales from the first step.
    """
    if name == "auto":
        if device.type == "cuda" and triton_available():
            name = "triton"
        else:
            name = "cpu_sparse" if supports_cpu_sparse(device, kv_dtype) else "gather"
    if name == "sdpa":
        return SdpaBackend(device, kv_dtype, calculate_kv_scales)
    if name == "gather":
        return GatherBackend(device, kv_dtype, calculate_kv_scales)
    if name == "cpu_sparse":
        return CpuSparseBackend(device, kv_dtype)
    if name == "triton":
        return TritonBackend(device, kv_dtype, calculate_kv_scales)
    raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
