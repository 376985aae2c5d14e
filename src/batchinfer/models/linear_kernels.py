"""Linear layers whose kernel is chosen by measuring on this machine, per weight shape and per
number of rows.

Which matmul kernel is fastest depends on the CPU (AVX2, AVX-512, AMX), on torch's build, on
the shape and on whether the weights stay in cache: oneDNN's packed layout wins some products
and loses others by 2x; torch's int8 and int4 kernels run 5-10x faster with bfloat16
activations than with float32 ones on some CPUs; a kernel that wins at 256 rows (a prefill
chunk) can lose at one row (a single-stream decode); and a quarter-size weight may stay in the
last-level cache from one step to the next where float32 weights cannot. So at start-up every
candidate kernel runs whole passes over all the model's linears, in model order, at each row
bucket (1 row; 2-8; 9-32; 33 and more), and per weight shape and bucket the fastest is kept
(`choose_kernels`): timing a product alone, on a weight that stays hot in cache, would reward
kernels a real step never sees. The choice is cached under the cache folder, keyed by CPU
model, torch version, threads, dtype, weight form and shapes, so a restart measures nothing.

Candidates, by weight form (`quantization`):
- `none`: `dense` (`F.linear`: MKL / the vendor library) and `packed` (oneDNN's blocked
  layout, `prepack.PackedLinear`; CPU float32 only);
- `int8`: symmetric int8 weights per output channel (a quarter of float32's bytes), run by
  `int8` (torch's `_weight_int8pack_mm`), `int8_bf16` (the same with the activations rounded
  to bfloat16 for the call: float32 models) or `int8_dense` (the weight dequantized in the
  call, then `F.linear`: for large row counts the dequantization is a small share);
- `q4`: 4-bit weights in groups of 32 with a scale and a zero (GGUF Q4_1's grid, an eighth of
  float32's bytes), run by `q4` (torch's `_weight_int4pack_mm_for_cpu`), `q4_bf16` or
  `q4_dense`, likewise, or `q4_native` (`native/cpu_kernels.c`: integer dot products of the
  4-bit weights with the activations rounded to 16 bits per group of 32, an error of at most
  1.5e-5 of the group's largest value);
- the LM head of a quantized model: its float kernels, or `q8_native` (int8 in groups of 32,
  GGUF Q8_0's grid, a quarter of float32's bytes);
- `int8` weights also run by `int8_native`, the native 8-bit kernel with each output's one
  scale;
- `q8`: int8 weights in groups of 32 with a scale each (GGUF Q8_0's grid: a quarter of
  float32's bytes, and an error per weight of at most 1/254 of its group's largest, where
  `int8`'s is of its whole row's), run by `q8_native`, or `q8_dense` (dequantized in the call;
  slow at few rows). It needs the native kernels; a shape their layout refuses keeps its float
  weights (`dense`), as an LM head that `q8_native` cannot take does.

`KernelLinear` holds only the weight forms its chosen kernels read, and dispatches on the
number of rows. Every kernel computes the same product as `F.linear` on the same (quantized)
weights, to float32 rounding, or bfloat16's for the `_bf16` ones, or that of activations
rounded to 16 bits per group of 32 for the `_native` ones (tests/test_linear_kernels.py,
tests/test_native.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer import native
from batchinfer.core.cpu import cpu_model
from batchinfer.models.files import write_cache_json
from batchinfer.models.prepack import PackedLinear, prepack_supported
from batchinfer.native.linear import (
    NativeLinear,
    check_shape,
    pack_q4,
    pack_q8_groups,
    quantize_q8,
)

logger = logging.getLogger(__name__)

KERNELS_BY_QUANTIZATION: dict[str, tuple[str, ...]] = {
    "none": ("dense", "packed"),
    "int8": ("int8", "int8_bf16", "int8_dense", "int8_native"),
    "q4": ("q4", "q4_bf16", "q4_dense", "q4_native"),
    "q8": ("q8_native", "q8_dense"),
}
# The LM head of a quantized model: its float kernels, or 8-bit groups of 32 (`q8_native`).
HEAD_KERNELS = ("q8_native",)
# Kernels of `native/cpu_kernels.c` (CPU, float32 activations, built for this machine).
NATIVE_KERNELS = ("q4_native", "q8_native", "int8_native")
# A kernel that cannot take one weight (a shape its packing refuses) leaves it to this one.
# `dense` (the float weights, unquantized) takes every weight: a shape q4 cannot group in 32s.
FALLBACK = {"packed": "dense", "int8": "int8_dense", "int8_bf16": "int8_dense",
            "int8_dense": "dense", "q4": "q4_dense", "q4_bf16": "q4_dense", "q4_dense": "dense",
            "q4_native": "q4_dense", "q8_native": "dense", "q8_dense": "dense",
            "int8_native": "int8_dense"}
# torch's bfloat16 int8 kernel reads past the end of rows of other lengths (wrong values, or
# a crash): it is offered only where the input size is a multiple of this.
INT8_BF16_K_MULTIPLE = 32
Q4_GROUP_SIZE = 32  # weights per (scale, zero) pair along the input dimension, as GGUF's Q4_1
# Row buckets (a decode of one sequence; a few; a batch of decodes; prefill chunks) and the
# row count each is timed at.
BUCKET_NAMES = ("1", "2-8", "9-32", "33+")
PROBE_ROWS = (1, 8, 32, 256)
# Timing: a warm-up pass, then this many timed passes (the median counts). A kernel whose
# warm-up pass takes more than `PRUNE_FACTOR` times the best one's at a bucket is not timed
# there; one of `ROW_BOUND` (their cost per row does not fall with more rows: a slow one at 8
# rows is slower still at 256) is not tried at the larger buckets either. The `_dense` ones,
# slow at one row (a whole weight dequantized per call) and fine at 256, always are.
PROBE_PASSES = 3
PRUNE_FACTOR = 3.0
ROW_BOUND = ("int8", "int8_bf16", "q4", "q4_bf16")


def quantize_q4(weight: torch.Tensor, group_size: int = Q4_GROUP_SIZE
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit weights in groups of `group_size` along the input dimension: integers
    `q` in 0..15 `[out, in]` (int32) and `[in / group_size, out, 2]` (scale, zero) pairs, with
    `weight ~= (q - 8) * scale + zero`, torch's int4 kernels' convention. A GGUF Q4_1 block
    (d * q + m, its minimum at q = 0 and maximum at q = 15) comes back as the same integers."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"q4 needs the input size ({k}) to be a multiple of {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
    scale = ((high - low) / 15).clamp_min(1e-8)
    q = torch.round((w - low) / scale).clamp_(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale
    pairs = torch.cat([scale, zero], dim=2).transpose(0, 1).contiguous()  # [groups, n, 2]
    return q, pairs


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit integers `[out, in]` (0..15) two to a byte: `[out, in / 2]` uint8, even columns in
    the low nibble."""
    q8 = q.to(torch.uint8)
    return (q8[:, 0::2] | (q8[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: `[out, in]` uint8."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)


def q4_affine(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset), each `[out, groups, 1]`: `weight = q * scale + offset` per group."""
    scale, zero = pairs.transpose(0, 1)[..., 0:1], pairs.transpose(0, 1)[..., 1:2]
    return scale.contiguous(), (zero - 8 * scale).contiguous()


def dequantize_q4(q: torch.Tensor, pairs: torch.Tensor, group_size: int = Q4_GROUP_SIZE,
                  affine: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """float32 weights from 4-bit integers and their (scale, zero) pairs (`affine`: the same
    pairs as `q4_affine` gives them, precomputed): one conversion and one fused multiply-add."""
    n, k = q.shape
    scale, offset = affine if affine is not None else q4_affine(pairs)
    grouped = q.view(n, k // group_size, group_size).to(torch.float32)
    return torch.addcmul(offset, grouped, scale).view(n, k)


def q4_supported(device: torch.device, weight_shape: tuple[int, int]) -> bool:
    """Whether torch's packed int4 CPU kernel takes this weight (its packing wants the output
    size a multiple of 32 and the input size a multiple of the group size)."""
    n, k = weight_shape
    return (device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and n % 32 == 0 and k % Q4_GROUP_SIZE == 0)


def bucket_of(rows: int) -> int:
    return 0 if rows <= 1 else 1 if rows <= 8 else 2 if rows <= 32 else 3


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: `weight ~= q * scale[:, None]`, |q| <= 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(weight.dtype).contiguous()


class WeightForms:
    """One linear's weight in the forms kernels read, each made on demand from the dense
    weight, once (the kernel name says which form)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach().contiguous()
        self._packed: PackedLinear | None = None
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # packed, q, pairs
        self._q8: tuple[torch.Tensor, torch.Tensor] | None = None  # int8 groups, scales
        self._native: dict[str, NativeLinear] = {}

    def kernel(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The callable computing `x @ W.T + b` with kernel `name`; `ValueError` when that
        kernel does not take this weight (a shape its packing refuses)."""
        bias = self.bias
        if name in NATIVE_KERNELS:
            return self._native_linear(name)
        if name == "dense":
            weight = self.weight
            return lambda x: F.linear(x, weight, bias)
        if name == "packed":
            if self._packed is None:
                self._packed = PackedLinear(self.weight, bias)
            return self._packed.forward
        if name == "q8_dense":
            if self._q8 is None:
                self._q8 = quantize_q8(self.weight)  # ValueError: a shape q8 cannot group
            q8, group_scale = self._q8
            shape = self.weight.shape
            return lambda x: F.linear(
                x, (q8.to(x.dtype) * group_scale.to(x.dtype)[..., None]).view(shape), bias)
        if name.startswith("int8"):
            if self._int8 is None:
                self._int8 = quantize_int8(self.weight)
            q, scale = self._int8
            if name == "int8_dense":
                return lambda x: F.linear(x, q.to(x.dtype).mul_(scale.to(x.dtype)[:, None]),
                                          bias)
            bf16 = name.endswith("_bf16")
            if ((bf16 or self.weight.dtype != torch.float32)
                    and q.shape[1] % INT8_BF16_K_MULTIPLE):
                raise ValueError(f"the {name} kernel with 16-bit activations needs the input "
                                 f"size ({q.shape[1]}) to be a multiple of "
                                 f"{INT8_BF16_K_MULTIPLE}")
            scales = _by_dtype(scale, bf16, self.weight.dtype)
            return _rows_kernel(lambda rows: torch._weight_int8pack_mm(rows, q, scales),
                                bias, bf16)
        if name.startswith("q4"):
            if self._q4 is None:
                q4, pairs = quantize_q4(self.weight)  # ValueError: a shape q4 cannot group
                packed = torch.empty(0)
                if q4_supported(self.weight.device, (q4.shape[0], q4.shape[1])):
                    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
                self._q4 = (packed, pack_nibbles(q4), pairs)
            packed, nibbles, pairs = self._q4
            if name == "q4_dense":
                affine = q4_affine(pairs)
                return lambda x: F.linear(
                    x, dequantize_q4(unpack_nibbles(nibbles), pairs, affine=affine).to(x.dtype),
                    bias)
            if not packed.numel():
                raise ValueError(f"the {name} kernel does not take a {tuple(self.weight.shape)} "
                                 "weight here")
            bf16 = name.endswith("_bf16")
            cast_pairs = _by_dtype(pairs, bf16, self.weight.dtype)
            return _rows_kernel(lambda rows: torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, packed, Q4_GROUP_SIZE, cast_pairs), bias, bf16)
        raise ValueError(f"unknown linear kernel {name!r}")

    def _native_linear(self, name: str) -> NativeLinear:
        if name not in self._native:
            weight = self.weight
            if weight.device.type != "cpu" or weight.dtype != torch.float32:
                raise ValueError(f"the {name} kernel runs float32 weights on the CPU only")
            lib = native.library()
            if lib is None:
                raise ValueError(f"the {name} kernel is not built on this machine")
            n, k = weight.shape
            check_shape(n, k, name)
            if name == "q4_native":
                q, pairs = quantize_q4(weight)
                scale, offset = q4_affine(pairs)
                tensors: tuple[torch.Tensor, ...] = pack_q4(q, scale, offset)
                kind = native.Q4
            elif name == "int8_native":  # the int8 weights as they are, one scale per output
                if self._int8 is None:
                    self._int8 = quantize_int8(weight)
                q8, channel = self._int8
                groups = k // native.GROUP
                tensors = pack_q8_groups(q8.view(n, groups, native.GROUP),
                                         channel.float()[:, None].expand(n, groups))
                kind = native.Q8
            else:  # q8_native: the groups q8_dense reads too, quantized once
                if self._q8 is None:
                    self._q8 = quantize_q8(weight)
                tensors, kind = pack_q8_groups(*self._q8), native.Q8
            self._native[name] = NativeLinear(lib, kind, n, k, tensors, self.bias)
        return self._native[name]

    def nbytes(self, name: str) -> int:
        """Bytes kernel `name` reads per call (its weight form, scales and bias), once
        `kernel(name)` has made that form."""
        def size(*tensors: torch.Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        if name in self._native:
            return self._native[name].nbytes
        if name.startswith("int8") and self._int8 is not None:
            total = size(*self._int8)
        elif name == "q8_dense" and self._q8 is not None:
            total = size(*self._q8)
        elif name.startswith("q4") and self._q4 is not None:
            packed, nibbles, pairs = self._q4
            total = size(nibbles if name == "q4_dense" else packed, pairs)
        else:  # dense, and packed (oneDNN's layout holds as many elements of the same type)
            total = size(self.weight)
        return total + size(self.bias)

    def release(self) -> None:
        """Drop the converted forms (the dense weight stays)."""
        self._packed = self._int8 = self._q4 = self._q8 = None
        self._native = {}


def _by_dtype(t: torch.Tensor, bf16: bool, dtype: torch.dtype) -> torch.Tensor:
    """Scales in the activations' dtype, cast once rather than every call."""
    return t.to(torch.bfloat16 if bf16 else dtype).contiguous()


def _rows_kernel(
    mm: Callable[[torch.Tensor], torch.Tensor], bias: torch.Tensor | None, bf16: bool,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A 2-D product `mm(rows)` as a kernel for `[..., in]` inputs; `bf16` runs it on
    activations rounded to bfloat16 and returns the input's dtype."""

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = mm(rows.to(torch.bfloat16 if bf16 else x.dtype).contiguous()).to(x.dtype)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out.add_(bias)

    return run


class KernelLinear(nn.Module):
    """`y = x @ W.T + b`, by the kernel chosen for the row bucket of `x` (`[..., in]`: rows
    are all but the last dimension)."""

    def __init__(self, forms: WeightForms, kernels: Sequence[str],
                 decode_kernel: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = forms.weight.shape
        # A kernel that cannot take this weight (a cached or forced choice) runs its fallback.
        self.kernels = tuple(runnable(forms, name) for name in kernels)
        # The kernels hold the tensors they read; `forms`, and with it every form no chosen
        # kernel reads (the dense weight too, unless a dense kernel was chosen), is dropped.
        # Inference only, built on the weights' device: not moved with `.to()` afterwards.
        self._fns = [forms.kernel(name) for name in self.kernels]
        # Bytes each bucket's kernel reads per call (a step's memory traffic for the weights).
        self.read_bytes = tuple(forms.nbytes(name) for name in self.kernels)
        # Per bucket, the weight as the native decode step reads it (`runner/native_decode.py`):
        # a native kernel's own form, or the dense float32 weight itself; else the form of
        # `decode_kernel` (`q4_native` for the q4 kernels, `dense` for the float ones), made
        # for the buckets whose chosen kernel has none but reads the same weights: whether a
        # whole native step beats the torch one there is measured per step (a kernel timed
        # alone pays a call's fixed cost that a native step does not).
        extra = None
        if decode_kernel is not None and runnable(forms, decode_kernel) == decode_kernel:
            extra = _native_form(forms, forms.kernel(decode_kernel), decode_kernel)
        self.native = tuple(
            _native_form(forms, fn, name)
            or (extra if _family(name) == _family(decode_kernel) else None)
            for fn, name in zip(self._fns, self.kernels, strict=True))

    def keep_native(self, buckets: Sequence[bool]) -> None:
        """Drop the native forms of the buckets whose decode steps do not run natively (a form
        made only for them is freed; a chosen kernel's own stays with the kernel)."""
        self.native = tuple(form if keep else None
                            for form, keep in zip(self.native, buckets, strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fns[bucket_of(x.numel() // x.shape[-1])](x)

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor | None:
        """`gelu(self(x))` (erf form) fused into the product where the bucket's kernel is
        oneDNN's prepacked one (`PackedLinear.forward_gelu`); None elsewhere, for the caller's
        own GELU."""
        owner = getattr(self._fns[bucket_of(x.numel() // x.shape[-1])], "__self__", None)
        return owner.forward_gelu(x) if isinstance(owner, PackedLinear) else None

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """`y += self(x)` in place: inside a native kernel's epilogue where the bucket's kernel
        is one and `y` is a contiguous float32 CPU tensor, else by an addition."""
        fn = self._fns[bucket_of(x.numel() // x.shape[-1])]
        if (isinstance(fn, NativeLinear) and y.dtype == torch.float32 and y.device.type == "cpu"
                and y.is_contiguous()):
            fn.add_into(y, x)
        else:
            y.add_(fn(x))

    def extra_repr(self) -> str:
        chosen = ", ".join(f"{b}: {k}" for b, k in zip(BUCKET_NAMES, self.kernels, strict=True))
        return f"in_features={self.in_features}, out_features={self.out_features}, {chosen}"


def set_int8_inputs(module: nn.Module, skip: Collection[str] = ("lm_head",)) -> int:
    """Let every native quantized kernel under `module`, but those of the sites named in
    `skip` (the LM head: its rounding moves every logit at once), round the inputs of products
    of many rows to 8 bits (`NativeLinear.int8_inputs`, `--prefill-activations int8`); returns
    how many kernels take it: none where the library has no 8-bit path (`bi_act8`: AVX2,
    AVX-512 VNNI and NEON with dot products have one; AVX-512 without VNNI, NEON without dot
    products and the portable level do not)."""
    lib = native.library()
    if lib is None or not lib.bi_act8():
        return 0
    kernels = {id(fn): fn for name, layer in module.named_modules()
               if isinstance(layer, KernelLinear) and name not in skip
               for fn in layer._fns
               if isinstance(fn, NativeLinear) and fn.struct.kind != native.F32}
    for fn in kernels.values():
        fn.int8_inputs = True
    return len(kernels)


def _family(kernel: str | None) -> str | None:
    """Kernels of one family read the same weights (float; 4-bit groups; int8 per channel;
    int8 in groups of 32)."""
    if kernel is None:
        return None
    return "float" if kernel in ("dense", "packed") else kernel.split("_")[0]


def _native_form(forms: WeightForms, fn: Callable[[torch.Tensor], torch.Tensor], name: str
                 ) -> NativeLinear | None:
    if isinstance(fn, NativeLinear):
        return fn
    weight = forms.weight
    if (name == "dense" and weight.shape[0] % native.TILE_F32 == 0 and weight.is_contiguous()
            and native_available(weight.device, weight.dtype)):
        lib = native.library()
        assert lib is not None
        return NativeLinear(lib, native.F32, weight.shape[0], weight.shape[1], (weight,),
                            forms.bias)
    return None


@dataclass(frozen=True)
class KernelPlan:
    """The kernel per row bucket for each weight shape `(out, in)`, and whether it was
    measured now or read from the cache."""

    choice: dict[tuple[int, int], tuple[str, ...]]
    source: str  # "measured", "cached" or "forced"

    def describe(self) -> str:
        parts = []
        for (n, k), kernels in sorted(self.choice.items()):
            cells = ", ".join(f"{b} {name}" for b, name in zip(BUCKET_NAMES, kernels,
                                                                strict=True))
            parts.append(f"{n}x{k}: {cells}")
        return "; ".join(parts)

    def as_json(self) -> dict[str, list[str]]:
        return {f"{n}x{k}": list(v) for (n, k), v in sorted(self.choice.items())}


def candidates(quantization: str, device: torch.device, dtype: torch.dtype,
               allow_packed: bool = True) -> tuple[str, ...]:
    """The kernels that can run weights of this form on this device and dtype."""
    names = KERNELS_BY_QUANTIZATION[quantization]
    if not (allow_packed and prepack_supported(device, dtype)):
        names = tuple(n for n in names if n != "packed")
    if device.type != "cpu":  # torch's int8 / int4 weight kernels used here are CPU ones
        names = tuple(n for n in names if n not in ("int8", "int8_bf16", "q4", "q4_bf16"))
    if dtype != torch.float32:  # the activations are not float32: no rounding variant
        names = tuple(n for n in names if not n.endswith("_bf16"))
    if any(n in NATIVE_KERNELS for n in names) and not native_available(device, dtype):
        names = tuple(n for n in names if n not in NATIVE_KERNELS)
    return names


def native_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the native kernels run here: CPU, float32, and the library built."""
    return device.type == "cpu" and dtype == torch.float32 and native.library() is not None


Timings = dict[str, list[dict[tuple[int, int], float]]]  # kernel -> per bucket -> shape -> s


def measure(sites: Sequence[WeightForms], names: Sequence[str], dtype: torch.dtype,
            probe_rows: Sequence[int] = PROBE_ROWS) -> Timings:
    """Seconds per pass that each kernel spends on each weight shape, per row bucket: passes
    over every site (one linear each, in model order, so weights leave the cache as in a real
    step), a warm-up pass then `PROBE_PASSES` timed ones (median), at each bucket's
    `probe_rows`. A kernel pruned
    (`PRUNE_FACTOR`, `ROW_BOUND`) is infinitely slow there. A shape the kernel refuses runs
    its fallback in the pass and cannot choose it. Each kernel's converted weights are dropped before the next kernel's are made, so the
    model is at most twice in memory."""
    timings: Timings = {name: [] for name in names}
    generator = torch.Generator().manual_seed(0)
    device = sites[0].weight.device
    inputs = {
        (rows, k): torch.randn(rows, k, generator=generator).to(device=device, dtype=dtype)
        for rows in probe_rows for k in {forms.weight.shape[1] for forms in sites}
    }
    pruned: set[str] = set()
    with torch.inference_mode():
        for rows in probe_rows:
            warm: dict[str, float] = {}
            per_shape: dict[str, dict[tuple[int, int], float]] = {}
            for name in names:
                if name in pruned:
                    continue
                # Where the kernel cannot take a weight, its fallback runs (as it would
                # in the model), but that shape cannot choose it.
                taken = [runnable(forms, name) for forms in sites]
                fns = [forms.kernel(kernel) for forms, kernel in zip(sites, taken, strict=True)]
                refused = {(f.weight.shape[0], f.weight.shape[1])
                           for f, kernel in zip(sites, taken, strict=True) if kernel != name}
                warm[name] = sum(_pass(sites, fns, inputs, rows).values())
                if warm[name] <= PRUNE_FACTOR * min(warm.values()):
                    passes = [_pass(sites, fns, inputs, rows) for _ in range(PROBE_PASSES)]
                    per_shape[name] = {
                        shape: math.inf if shape in refused
                        else statistics.median(p[shape] for p in passes)
                        for shape in passes[0]}
                del fns
                for forms in sites:
                    forms.release()
            fastest_warm = min(warm.values(), default=math.inf)
            for name in names:
                if name in per_shape and warm[name] <= PRUNE_FACTOR * fastest_warm:
                    timings[name].append(per_shape[name])
                else:
                    timings[name].append({})
                    if name in ROW_BOUND:
                        pruned.add(name)
    return timings


def _pass(sites: Sequence[WeightForms],
          fns: Sequence[Callable[[torch.Tensor], torch.Tensor]],
          inputs: dict[tuple[int, int], torch.Tensor], rows: int
          ) -> dict[tuple[int, int], float]:
    """One pass over the sites at `rows` rows: seconds per weight shape."""
    per_shape: dict[tuple[int, int], float] = {}
    for forms, fn in zip(sites, fns, strict=True):
        shape = (forms.weight.shape[0], forms.weight.shape[1])
        x = inputs[(rows, shape[1])]
        start = time.perf_counter()
        fn(x)
        per_shape[shape] = per_shape.get(shape, 0.0) + time.perf_counter() - start
    return per_shape


def fastest(timings: Timings, names: Sequence[str], shapes: Sequence[tuple[int, int]]
            ) -> dict[tuple[int, int], tuple[str, ...]]:
    """Per shape, the kernel with the least time at each bucket (unmeasured = infinite)."""
    def seconds(name: str, bucket: int, shape: tuple[int, int]) -> float:
        return timings[name][bucket].get(shape, math.inf)

    return {shape: tuple(min(names, key=lambda n: seconds(n, b, shape))
                         for b in range(len(BUCKET_NAMES)))
            for shape in shapes}


def cache_key(shapes: Sequence[tuple[int, int]], names: Sequence[str], dtype: torch.dtype,
              device: torch.device, probe_rows: Sequence[int] = PROBE_ROWS) -> str:
    """What a choice depends on: CPU model, torch version, threads, dtype, kernels, shapes."""
    facts = {
        "cpu": cpu_model(), "machine": platform.machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "dtype": str(dtype), "device": str(device),
        "kernels": list(names), "shapes": list(shapes), "probe_rows": list(probe_rows),
        "method": "passes-v2",  # bump when measurement or kernels change
    }
    if any(name in NATIVE_KERNELS for name in names):  # the native kernels' own code
        facts["native"] = native.source_digest()
        facts["isa"] = native.isa_level()
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def choose_kernels(
    sites: Sequence[WeightForms],
    names: Sequence[str],
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: Path | None,
    probe_rows: Sequence[int] = PROBE_ROWS,
) -> KernelPlan:
    """The fastest of `names` per row bucket for each weight shape of the `sites` (every
    linear of a model, in order), measured at `probe_rows` (one row count per bucket), from
    the cache when this machine measured the same thing before. One candidate: forced (where
    it cannot take a shape, its fallback)."""
    shapes = list(dict.fromkeys((f.weight.shape[0], f.weight.shape[1]) for f in sites))
    if len(names) == 1:
        forced = {}
        for forms in sites:
            shape = (forms.weight.shape[0], forms.weight.shape[1])
            if shape not in forced:
                forced[shape] = (runnable(forms, names[0]),) * len(BUCKET_NAMES)
                forms.release()
        return KernelPlan(forced, "forced")
    all_shapes = [(f.weight.shape[0], f.weight.shape[1]) for f in sites]
    path = None
    if cache_dir is not None:
        key = cache_key(all_shapes, names, dtype, device, probe_rows)
        path = cache_dir / "linear-kernels" / f"{key}.json"
        try:
            stored = json.loads(path.read_text())
            choice = {_shape(key): tuple(value) for key, value in stored["choice"].items()}
            if set(choice) == set(shapes) and all(
                    len(v) == len(BUCKET_NAMES) and set(v) <= set(names)
                    for v in choice.values()):
                return KernelPlan(choice, "cached")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # not measured yet here, or unreadable: measure
    timings = measure(sites, names, dtype, probe_rows)
    # A bucket where every kernel that takes a shape was pruned leaves only refusals (all
    # infinitely slow): such a choice becomes the first fallback that takes the shape.
    first_site = {(f.weight.shape[0], f.weight.shape[1]): f for f in reversed(sites)}
    choice = {shape: tuple(runnable(first_site[shape], name) for name in kernels)
              for shape, kernels in fastest(timings, names, shapes).items()}
    for forms in sites:
        forms.release()
    plan = KernelPlan(choice, "measured")
    if path is not None:
        seconds = {name: [{f"{n}x{k}": t for (n, k), t in bucket.items()} for bucket in buckets]
                   for name, buckets in timings.items()}
        write_cache_json(path, {"cpu": cpu_model(), "torch": torch.__version__,
                                "choice": plan.as_json(), "seconds_per_pass": seconds},
                         "the linear kernel choice")
    return plan


@dataclass(frozen=True, slots=True)
class FormChoice:
    """`quantization auto`'s answer: the weight form to run, and why (for the start-up log)."""

    form: str
    reason: str


# `quantization auto` compares the weight forms at these row counts: a decode step of one
# sequence, where a quantized weight's fewer bytes pay most, and of a few.
FORM_PROBE_ROWS = (1, 8)


def choose_weight_form(module: nn.Module, stored_form: str, stored: str, device: torch.device,
                       dtype: torch.dtype, cache_dir: Path | None, allow_packed: bool = True,
                       heads: Collection[str] = ()) -> FormChoice:
    """`quantization auto`: keep a checkpoint stored as `stored_form` (q4, q8; `stored` says
    how, for the log) in that form where a one-row pass over the decoder linears (`module`'s
    `nn.Linear`s but `heads`), each shape at its fastest kernel, measured faster than
    float32's; else dequantize (`none`). Floats stay floats without measuring. The timings are
    cached like the kernel choice, so a restart measures nothing."""
    if stored_form == "none":
        return FormChoice("none", f"the checkpoint stores {stored}: float weights")
    quantized = candidates(stored_form, device, dtype, allow_packed)
    if not quantized or (stored_form == "q8" and "q8_native" not in quantized):
        return FormChoice("none", f"the checkpoint stores {stored}, whose kernels do not run "
                                  f"here ({device}, {dtype}): float weights")
    floats = candidates("none", device, dtype, allow_packed)
    sites = [WeightForms(child.weight, child.bias) for name, child in module.named_modules()
             if isinstance(child, nn.Linear) and name not in heads]
    all_shapes = [(f.weight.shape[0], f.weight.shape[1]) for f in sites]
    path = None
    seconds: dict[str, list[float]] | None = None
    if cache_dir is not None:
        key = cache_key(all_shapes, (*quantized, "|", *floats), dtype, device, FORM_PROBE_ROWS)
        path = cache_dir / "weight-forms" / f"{key}.json"
        try:
            seconds = {form: [float(t) for t in stored_seconds] for form, stored_seconds
                       in json.loads(path.read_text())["seconds_per_pass"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            seconds = None  # not measured yet here, or unreadable: measure
    if seconds is None or set(seconds) != {stored_form, "none"}:
        float_s = _fastest_per_shape(sites, floats, dtype)
        # A shape no quantized kernel takes keeps its float weights: float32's time.
        seconds = {"none": [sum(bucket.values()) for bucket in float_s],
                   stored_form: [sum(t if math.isfinite(t) else float_bucket[shape]
                                     for shape, t in bucket.items())
                                 for bucket, float_bucket in zip(
                                     _fastest_per_shape(sites, quantized, dtype), float_s,
                                     strict=True)]}
        if path is not None:
            write_cache_json(path, {"cpu": cpu_model(), "rows": FORM_PROBE_ROWS,
                                    "seconds_per_pass": seconds}, "the weight form choice")
    for forms in sites:
        forms.release()
    ms = {form: " / ".join(f"{t * 1e3:.2f}" for t in values) for form, values in seconds.items()}
    measured = (f"a pass over the decoder linears at {' / '.join(map(str, FORM_PROBE_ROWS))} "
                f"rows: {stored_form} {ms[stored_form]} ms, float32 {ms['none']} ms")
    if seconds[stored_form][0] < seconds["none"][0]:
        return FormChoice(stored_form, f"the checkpoint stores {stored}; kept: {measured}")
    return FormChoice("none", f"the checkpoint stores {stored}; dequantized to float32, "
                              f"faster here: {measured}")


def _fastest_per_shape(sites: Sequence[WeightForms], names: Sequence[str],
                       dtype: torch.dtype) -> list[dict[tuple[int, int], float]]:
    """Per `FORM_PROBE_ROWS` entry, each weight shape's seconds per pass at its fastest of
    `names` (infinite where none takes it)."""
    timings = measure(sites, names, dtype, FORM_PROBE_ROWS)
    shapes = dict.fromkeys((f.weight.shape[0], f.weight.shape[1]) for f in sites)
    return [{shape: min(timings[n][bucket].get(shape, math.inf) for n in names)
             for shape in shapes} for bucket in range(len(FORM_PROBE_ROWS))]


def runnable(forms: WeightForms, name: str) -> str:
    """`name`, or the first of its fallbacks that takes this weight (`dense` takes any)."""
    while name != "dense":
        try:
            forms.kernel(name)
            return name
        except ValueError:
            name = FALLBACK[name]
    return name


def _shape(key: str) -> tuple[int, int]:
    n, k = key.split("x")
    return int(n), int(k)


def kernel_names(quantization: str, kernels: str, device: torch.device, dtype: torch.dtype,
                 allow_packed: bool = True) -> tuple[str, ...]:
    """The candidates `auto` measures, or the one kernel asked for; `ValueError` naming the
    knob when that kernel cannot run this weight form, device or dtype."""
    names = candidates(quantization, device, dtype, allow_packed)
    if quantization == "q8" and "q8_native" not in names:
        raise ValueError("quantization 'q8' runs on the native CPU kernels: float32 on a CPU "
                         "with a C compiler (BATCHINFER_NATIVE not 0); use int8 or q4 here")
    if kernels == "auto":
        return names
    if kernels not in KERNELS_BY_QUANTIZATION[quantization]:
        raise ValueError(
            f"linear_kernels {kernels!r} does not run quantization {quantization!r} "
            f"weights; choose one of auto, {', '.join(KERNELS_BY_QUANTIZATION[quantization])}")
    if kernels not in names:
        raise ValueError(f"linear_kernels {kernels!r} cannot run here ({device}, {dtype}); "
                         "use auto or dense")
    return (kernels,)


def apply_kernels(module: nn.Module, quantization: str, kernels: str, device: torch.device,
                  dtype: torch.dtype, cache_dir: Path | None, allow_packed: bool = True,
                  extra: dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None = None,
                  heads: Collection[str] = (),
                  native_decode: bool = False,
                  probe_rows: Sequence[int] = PROBE_ROWS) -> KernelPlan:
    """Replace every `nn.Linear` under `module` (and the `extra` attribute name -> (weight,
    bias) pairs, such as a tied LM head) by a `KernelLinear` whose kernels are `kernels` (a
    name) or, with `auto`, the fastest measured here. With quantized weights the sites named
    in `heads` (the LM head) are not 4-bit: their kernels are measured among the float ones and
    `HEAD_KERNELS` (8-bit groups), whatever `kernels` says. `native_decode`: every site of
    q4 weights also gets its `q4_native` form (int8: `int8_native`; q8: `q8_native`, its only
    fast kernel anyway), every float layer keeps its float32 weight, and
    an `extra` head (a tied one, whose float weight stays anyway) its float32 form, for native
    decode steps (`KernelLinear.native`). `probe_rows`: the row count each bucket is measured
    at (a model whose products of many rows are larger than `PROBE_ROWS`' 256, such as an
    encoder's batches, measures its 33+ bucket there).
    `ValueError` names the knob when the kernel cannot run this weight form or device."""
    names = kernel_names(quantization, kernels, device, dtype, allow_packed)
    extra = extra or {}
    site_names = [name for name, child in module.named_modules()
                  if isinstance(child, nn.Linear)] + list(extra)

    def weight_of(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if name in extra:
            return extra[name]
        linear = module.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        return linear.weight, linear.bias

    # (candidate kernels, sites): the kernel names carry the weight form
    groups = [(names, site_names)]
    if quantization != "none":
        head_names = kernel_names("none", "auto", device, dtype, allow_packed)
        head_names += tuple(n for n in HEAD_KERNELS if native_available(device, dtype))
        groups = [(names, [n for n in site_names if n not in heads]),
                  (head_names, [n for n in site_names if n in heads])]
    choice: dict[tuple[int, int], tuple[str, ...]] = {}
    sources = []
    native = native_decode and native_available(device, dtype)

    def decode_kernel(name: str) -> str | None:
        if not native:
            return None
        if name in heads:  # never a copy of a float weight that would not stay anyway
            return "dense" if name in extra else None
        # A float layer keeps its float32 weight for native decode steps even where packed
        # won (then both forms are held), until the start-up choice of native steps drops it
        # for the row buckets they do not take (`KernelLinear.keep_native`).
        return {"q4": "q4_native", "int8": "int8_native", "q8": "q8_native",
                "none": "dense"}.get(quantization)

    for group_names, group in groups:
        if not group:
            continue
        sites = [WeightForms(*weight_of(name)) for name in group]
        plan = choose_kernels(sites, group_names, dtype, device, cache_dir, probe_rows)
        del sites
        sources.append(plan.source)
        # One at a time, by name: a dense weight no kernel reads is freed as soon as its
        # replacement exists, so peak memory stays near one model's weights (plus, with
        # `native_decode`, the decode forms above until the runner keeps or drops them).
        for name in group:
            weight, bias = weight_of(name)
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            shape = (weight.shape[0], weight.shape[1])
            layer = KernelLinear(WeightForms(weight, bias), plan.choice[shape],
                                 decode_kernel(name))
            setattr(parent, attr, layer)
            choice[shape] = layer.kernels  # what runs (a refused choice: its fallback)
            del weight, bias
    return KernelPlan(choice, "+".join(dict.fromkeys(sources)))
