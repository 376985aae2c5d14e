"""Weights in the native kernels' layouts (see cpu_kernels.c) and a linear that runs them.

`q4`: GGUF Q4_1's grid (4-bit integers in groups of 32 with a scale and an offset), so a Q4_1
checkpoint's weights are the checkpoint's own; `q8`: symmetric int8 in groups of 32 with one
scale (GGUF Q8_0's grid: a Q8_0 tensor, such as the embedded model's token embedding, comes
back exactly). Their kernels round the activations to 16-bit integers per group of 32 (by the
group's largest value: an error of at most 1.5e-5 of it, about 250 times finer than bfloat16)
and multiply in integers, then scale in float32.
"""

from __future__ import annotations

import ctypes

import torch

from batchinfer import native
from batchinfer.native.memory import huge_page_copies, huge_pages_supported, return_freed_memory


class NativeLinear:
    """`y = x @ W.T + b` by `bi_linear_forward`, for float32 CPU inputs `[..., k]`.

    Holds the tensors its `struct` points into; `struct` is what the fused decode step reads.
    `int8_inputs`: products of 8 rows and more (prefill chunks, decode steps of 8+ sequences;
    native decode steps follow the same setting) round the inputs to 8 bits per group of 32
    rather than 16, where the library's level has 8-bit products (`bi_act8`: AVX2, AVX-512
    VNNI, NEON with dot products; `bi_linear_forward8`); set by `set_int8_inputs`.
    """

    int8_inputs = False

    def __init__(self, lib: ctypes.CDLL, kind: int, n: int, k: int,
                 tensors: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> None:
        self.lib = lib
        self.n, self.k = n, k
        self.tensors = tensors
        self.bias = bias
        pointers = [t.data_ptr() for t in tensors] + [None] * (3 - len(tensors))
        self.struct = native.Linear(kind, n, k, 0, *pointers,
                                    None if bias is None else bias.data_ptr())

    def point_at(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Read the weights from `tensors` (same shapes and values as `self.tensors`, e.g.
        copies in huge pages) from now on; structs copied from `struct` before keep the old
        pointers."""
        self.tensors = tensors
        self.struct.weight, self.struct.scale, self.struct.offset = (
            [t.data_ptr() for t in tensors] + [None] * (3 - len(tensors)))

    @property
    def nbytes(self) -> int:
        parts = [*self.tensors] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        out = torch.empty((rows.shape[0], self.n), dtype=torch.float32)
        self._run(rows, out, accumulate=False)
        return out.view(*x.shape[:-1], self.n).to(x.dtype)

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """`y += x @ W.T + b` in the kernel's own epilogue (no product tensor, no second pass
        over `y`): `y` a contiguous float32 `[rows, n]` on the CPU."""
        rows = self._rows(x)
        if (y.dtype != torch.float32 or y.device.type != "cpu" or not y.is_contiguous()
                or y.shape != (rows.shape[0], self.n)):
            raise ValueError(f"add_into takes a contiguous float32 [{rows.shape[0]}, {self.n}] "
                             "CPU tensor")
        self._run(rows, y, accumulate=True)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.k)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        return rows

    def _run(self, rows: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        forward = self.lib.bi_linear_forward8 if self.int8_inputs else \
            self.lib.bi_linear_forward
        if rows.shape[0] and forward(
                ctypes.byref(self.struct), rows.shape[0], rows.data_ptr(), out.data_ptr(),
                int(accumulate), torch.get_num_threads()):
            raise MemoryError("the native linear could not allocate its scratch")


def check_shape(n: int, k: int, kind: str) -> None:
    """ValueError unless the native layouts take an `[n, k]` weight."""
    if n % native.TILE or k % native.GROUP:
        raise ValueError(f"the {kind} native kernel needs outputs a multiple of {native.TILE} "
                         f"and inputs a multiple of {native.GROUP}, not a {n}x{k} weight")


# Weight scales the kernels take: 0 or |scale| in [2^-66, 2^31), where the many-row kernels
# may fold an input's power-of-two scale into one by adding to its exponent (common.h,
# `input_scale16`) and still hold the exact product.
SMALLEST_SCALE = 2.0 ** -66
LARGEST_SCALE = 2.0 ** 31


def kernel_scales(q: torch.Tensor, scale: torch.Tensor, kind: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Integers `[n, groups, 32]` and their scales `[n, groups]` as the kernels take them: a
    group whose |scale| is below SMALLEST_SCALE (0 included) becomes integers 0 at scale 1, the
    same weights (q4: its offset; q8: 0) within 15 * 2^-66; a scale of LARGEST_SCALE or more is
    a ValueError."""
    magnitude = scale.abs()
    if bool((magnitude >= LARGEST_SCALE).any()):
        raise ValueError(f"a {kind} weight scale of {float(magnitude.max()):g} is out of the "
                         f"native kernels' range (below {LARGEST_SCALE:g})")
    small = magnitude < SMALLEST_SCALE
    if not bool(small.any()):
        return q, scale
    return (q.masked_fill(small[..., None], 0),
            scale.masked_fill(small, 1.0))


def pack_q4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit integers `[n, k]` (0..15) and their per-group `scale`, `offset` (`[n, k/32]`,
    weight = q * scale + offset) -> the q4 layout: bytes `[n/16, k/32, 8, 32]` (chunk i, byte
    2j+e: q[j][2i+e] | q[j][2i+16+e] << 4 for output j of the tile), scale and offset
    `[n/16, k/32, 16]`."""
    n, k = q.shape
    check_shape(n, k, "q4")
    tiles, groups = n // native.TILE, k // native.GROUP
    q, scale = kernel_scales(q.reshape(n, groups, native.GROUP), scale, "q4")
    q = q.reshape(n, k)
    by_group = q.to(torch.uint8).view(tiles, native.TILE, groups, native.GROUP).transpose(1, 2)
    # [tiles, groups, 16 outputs, 32]: elements 0-15 go low, 16-31 high; (2i + e) -> (i, e)
    low = by_group[..., :16].reshape(tiles, groups, native.TILE, 8, 2)
    high = by_group[..., 16:].reshape(tiles, groups, native.TILE, 8, 2)
    packed = (low | (high << 4)).permute(0, 1, 3, 2, 4).reshape(tiles, groups, 8, 32)
    return packed.contiguous(), _by_tile(scale, n, groups), _by_tile(offset, n, groups)


def pack_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in groups of 32 (scale = the group's largest |w| / 127) in the q8
    layout: bytes `[n/16, k/32, 16, 32]` (chunk p, byte 2j+e: q[j][2p+e]) and scales
    `[n/16, k/32, 16]`."""
    return pack_q8_groups(*quantize_q8(weight))


def pack_q8_groups(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 `[n, k/32, 32]` and per-group scales `[n, k/32]` in the q8 layout. Per-channel
    int8 (one scale per output) is the case of every group of an output sharing its scale."""
    n, groups = scale.shape
    check_shape(n, groups * native.GROUP, "q8")
    tiles = n // native.TILE
    q, scale = kernel_scales(q.reshape(n, groups, native.GROUP), scale, "q8")
    by_group = q.reshape(tiles, native.TILE, groups, native.GROUP).transpose(1, 2)
    packed = by_group.reshape(tiles, groups, native.TILE, 16, 2).permute(0, 1, 3, 2, 4)
    return packed.reshape(tiles, groups, 16, 32).contiguous(), _by_tile(scale, n, groups)


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 `[n, k/32, 32]` and scales `[n, k/32]`: each group of 32 scaled by its largest |w|
    / 127 (GGUF Q8_0's rule, so a Q8_0 tensor comes back as its own integers)."""
    n, k = weight.shape
    if k % native.GROUP:
        raise ValueError(f"q8 needs the input size ({k}) to be a multiple of {native.GROUP}")
    w = weight.detach().float().view(n, k // native.GROUP, native.GROUP)
    scale = w.abs().amax(dim=2) / 127.0
    q = torch.round(w / scale.clamp_min(1e-30)[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _by_tile(t: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """Per-(output, group) values `[n, groups]` as `[n/16, groups, 16]`."""
    return t.float().reshape(n // native.TILE, native.TILE, groups).transpose(1, 2).contiguous()


def dequantize_q8(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 `[n, k]` weights a q8 layout holds (for tests and quality checks)."""
    tiles, groups = packed.shape[:2]
    q = packed.view(tiles, groups, 16, native.TILE, 2).permute(0, 1, 3, 2, 4)
    w = q.reshape(tiles, groups, native.TILE, native.GROUP).float() * scale[..., None]
    return w.transpose(1, 2).reshape(tiles * native.TILE, groups * native.GROUP)


def move_forms_to_huge_pages(forms: list[NativeLinear]) -> int:
    """Copy the quantized forms' tensors (float32 forms read the model's weight itself, which
    `move_to_huge_pages` places) into one huge-page mapping, in the order given (the order a
    decode step reads them), and point the forms there. Returns the bytes moved."""
    moving = list({id(f): f for f in forms if f.struct.kind != native.F32}.values())
    if not moving or not huge_pages_supported():
        return 0
    copies, moved = huge_page_copies([t for form in moving for t in form.tensors])
    taken = iter(copies)
    for form in moving:
        form.point_at(tuple(next(taken) for _ in form.tensors))
    return_freed_memory()
    return moved
