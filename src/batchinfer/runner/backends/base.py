"""What every attention backend here shares: the cache tensor it allocates, in its own layout,
and how K/V are stored in it (as is, or as FP8 with a per-layer scale)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from batchinfer.models.spec import LayerAttention
from batchinfer.native.memory import huge_page_buffer, huge_pages_supported
from batchinfer.runner.input_batch import AttentionMetadata
from batchinfer.runner.kv_cache import KVCacheSpec

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# `calculate_kv_scales` maps a layer's largest |K| (|V|) of the first step to this fraction of the
# FP8 type's largest value: room for later tokens a little larger than the first ones.
CALIBRATION_HEADROOM = 0.5
# A swap copies at most this many bytes of blocks at once (a temporary on the device).
SWAP_CHUNK_BYTES = 64 << 20


class BackendBase:
    """Holds `kv_cache` (empty until `allocate_kv_cache`) and checks a step fits it.

    A subclass names its layout by `_cache_shape`; the tensor always holds
    `2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim` elements, so
    `kv_cache.bytes_per_block` sizes every backend's cache alike.

    FP8 caches (`float8_e4m3fn`, `float8_e5m2`) store `K / k_scale` and `V / v_scale`, clamped
    to the type's range, with one scale pair per layer: 1.0, or with `calculate_kv_scales` the
    first step's largest |K| and |V| of that layer over `CALIBRATION_HEADROOM` times the type's
    largest value. Subclasses write through `quantize`; reading needs no conversion pass:
    `q . (K k_scale) = (q . K) k_scale` folds into the softmax scale and `V v_scale` into the
    output (`attend_chunks`, `PagedRowsBackend.__call__`).

    Every backend writes all of a step's new K/V before any row attends, so one-token rows
    that are successive positions of one sequence (speculative decoding's verification rows)
    each attend to the ones before them.

    Swap space (`allocate_swap_space`): host blocks in the cache's own layout, `block_dim` being
    the dimension that numbers blocks; `swap_out` / `swap_in` copy whole blocks, bytes as they
    are (an FP8 block keeps its layer's scales, which are per layer, not per block).

    `layers` says how each layer attends (`LayerAttention`: scale, sliding window,
    soft-capping; `set_layers`); a backend without them attends every layer causally over its
    whole context at `1 / sqrt(head_dim)`.
    """

    name = "base"
    block_dim = 1  # the dimension of `kv_cache` that numbers blocks

    def __init__(
        self, device: torch.device, kv_dtype: torch.dtype, calculate_kv_scales: bool = False
    ) -> None:
        self.device = device
        self.kv_dtype = kv_dtype
        self.block_size = 0
        self.kv_cache = torch.empty(0, dtype=kv_dtype, device=device)
        self.quantized = kv_dtype in FP8_DTYPES
        self.calculate_kv_scales = calculate_kv_scales and self.quantized
        # Per layer (k_scale, v_scale), as Python floats: multiplying by one costs no sync.
        self.kv_scales: list[tuple[float, float]] = []
        self._calibrated: list[bool] = []
        self.swap_space = torch.empty(0, dtype=kv_dtype)
        self.layers: tuple[LayerAttention, ...] = ()

    def set_layers(self, layers: Sequence[LayerAttention]) -> None:
        """How each layer attends from now on (one entry per layer, or none: plain)."""
        self.layers = tuple(layers)

    def layer(self, layer_idx: int, head_dim: int) -> LayerAttention:
        """How layer `layer_idx` attends (plain causal at `1 / sqrt(head_dim)` without
        `layers`)."""
        if self.layers:
            return self.layers[layer_idx]
        return LayerAttention(head_dim**-0.5)

    def quantize(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`k`, `v` as stored in the cache (its dtype; FP8: divided by the layer's scales)."""
        if not self.quantized:
            return k.to(self.kv_dtype), v.to(self.kv_dtype)
        k_scale, v_scale = self.layer_scales(layer_idx, k, v)
        top = torch.finfo(self.kv_dtype).max
        return ((k / k_scale).clamp_(-top, top).to(self.kv_dtype),
                (v / v_scale).clamp_(-top, top).to(self.kv_dtype))

    def layer_scales(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[float, float]:
        """The layer's (k_scale, v_scale), calibrated from this step's `k`, `v` when asked to
        and not yet done (1.0 for caches that are not FP8)."""
        if self.calculate_kv_scales and not self._calibrated[layer_idx]:
            limit = torch.finfo(self.kv_dtype).max * CALIBRATION_HEADROOM
            k_max, v_max = (float(x.abs().amax()) if x.numel() else 0.0 for x in (k, v))
            self.kv_scales[layer_idx] = (max(k_max / limit, 1e-8), max(v_max / limit, 1e-8))
            self._calibrated[layer_idx] = True
        return self.kv_scales[layer_idx]

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
        if self.device.type == "cpu" and huge_pages_supported():
            # decode attention streams the cache as the linears stream the weights
            element_bytes = torch.empty((), dtype=self.kv_dtype).element_size()
            # Written through now, as torch.zeros would: the pages are had at start-up, not
            # faulted in by the first steps (nor by the start-up measurements' probes).
            self.kv_cache = huge_page_buffer(math.prod(shape) * element_bytes).view(
                self.kv_dtype).view(shape).zero_()
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.block_size = block_size
        self.reset_kv_scales()

    def reset_kv_scales(self) -> None:
        """Scales back to 1.0, to be calibrated again by the next step when asked to (after a
        start-up measurement ran on dummy tokens)."""
        num_layers = self.kv_cache.shape[0]
        self.kv_scales = [(1.0, 1.0)] * num_layers
        self._calibrated = [False] * num_layers

    def allocate_swap_space(self, num_blocks: int) -> None:
        """Host memory for `num_blocks` swapped-out blocks (pinned next to a GPU, for fast
        copies). Left uninitialised: only blocks copied out are ever copied back in."""
        shape = list(self.kv_cache.shape)
        shape[self.block_dim] = num_blocks
        pin = self.device.type == "cuda"
        self.swap_space = torch.empty(shape, dtype=self.kv_dtype, device="cpu", pin_memory=pin)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the (device block, host block) pairs' device blocks into their host blocks."""
        cache, space = _bytes(self.kv_cache), _bytes(self.swap_space)
        for device_ids, host_ids in self._block_ids(pairs, 0):
            blocks = cache.index_select(self.block_dim, device_ids.to(self.device))
            space.index_copy_(self.block_dim, host_ids, blocks.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the (host block, device block) pairs' host blocks into their device blocks."""
        cache, space = _bytes(self.kv_cache), _bytes(self.swap_space)
        for device_ids, host_ids in self._block_ids(pairs, 1):
            blocks = space.index_select(self.block_dim, host_ids)
            cache.index_copy_(self.block_dim, device_ids.to(self.device),
                              blocks.to(self.device))

    def _block_ids(
        self, pairs: list[tuple[int, int]], device_column: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(device ids, host ids) of the pairs, in chunks of at most `SWAP_CHUNK_BYTES`: the
        gathered blocks are a temporary on the device, which no memory budget counts."""
        if not pairs:
            return
        block_bytes = self.kv_cache.nbytes // self.kv_cache.shape[self.block_dim]
        step = max(1, SWAP_CHUNK_BYTES // block_bytes)
        ids = torch.tensor(pairs, dtype=torch.long)
        for start in range(0, len(pairs), step):
            chunk = ids[start : start + step]
            yield chunk[:, device_column], chunk[:, 1 - device_column]

    def _check_step(self, metadata: AttentionMetadata) -> None:
        if self.kv_cache.numel() == 0:
            raise RuntimeError(f"{self.name}: build() before allocate_kv_cache()")
        if metadata.block_size != self.block_size:
            raise RuntimeError(
                f"{self.name}: step built for block_size {metadata.block_size}, "
                f"cache has {self.block_size}"
            )


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (FP8 as uint8: copies need no float8 kernels)."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache
