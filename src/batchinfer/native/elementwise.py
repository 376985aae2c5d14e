"""A layer's element-wise steps in one native pass each (`cpu_kernels.c`).

Torch runs an RMSNorm as six passes over the rows (square, mean, add, rsqrt, two products),
a rotation as seven, SiLU(gate) x up as two plus the copy the next product needs of the strided
gate half (an encoder's residual add and LayerNorm two, its GELU one slow one); on a CPU each
pass streams the whole `[rows, width]` activation through memory. These do each in one pass,
a row per task across the threads, on float32 CPU rows. `library_for` says whether they apply;
the models keep torch's ops elsewhere (other dtypes, GPUs, no C compiler).
"""

from __future__ import annotations

import ctypes

import torch

from batchinfer import native


def _float32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def library_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The native library where every tensor is float32 on the CPU, else None."""
    return native.library() if _float32_cpu(*tensors) else None


def library_for_dtype(dtype: torch.dtype, device: torch.device) -> ctypes.CDLL | None:
    """The native library for float32 activations on the CPU, else None."""
    if dtype != torch.float32 or device.type != "cpu":
        return None
    return native.library()


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float
             ) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension of `x` `[rows, hidden]`
    (rows of unit stride), as a new contiguous tensor."""
    rows, hidden = x.shape
    if (not _float32_cpu(x, weight) or x.stride(1) != 1 or weight.shape != (hidden,)
            or not weight.is_contiguous()):
        raise ValueError("rms_norm takes float32 CPU rows of unit stride and a contiguous "
                         "[hidden] weight")
    out = torch.empty((rows, hidden), dtype=torch.float32)
    lib.bi_rms_norm_rows(x.data_ptr(), x.stride(0), weight.data_ptr(), rows, hidden, eps,
                         out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a contiguous `[rows, 2 * inter]` (gate, then up), as a new
    contiguous `[rows, inter]`."""
    rows, width = gate_up.shape
    if width % 2 or not gate_up.is_contiguous() or not _float32_cpu(gate_up):
        raise ValueError("silu_mul takes contiguous float32 CPU [rows, 2 * inter] rows")
    out = torch.empty((rows, width // 2), dtype=torch.float32)
    lib.bi_silu_mul_rows(gate_up.data_ptr(), rows, width // 2, out.data_ptr(),
                         torch.get_num_threads())
    return out


def rotate_(lib: ctypes.CDLL, x: torch.Tensor, heads: int, positions: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate, in place, the first `heads` heads of `x` `[rows, all_heads, head_dim]` (heads
    side by side in a row) by each row's position: pairs `(i, i + head_dim / 2)` by the angles
    of `cos`, `sin` `[max_positions, head_dim / 2]` (the "rotate_half" form). `positions`
    `[rows]` int64 must lie in the tables: the caller checks them once a step."""
    rows, all_heads, head_dim = x.shape
    if (not _float32_cpu(x, cos, sin) or positions.device.type != "cpu"
            or x.stride(2) != 1 or x.stride(1) != head_dim or not 0 <= heads <= all_heads
            or cos.shape != sin.shape or cos.shape[1] * 2 != head_dim
            or not (cos.is_contiguous() and sin.is_contiguous())
            or positions.shape != (rows,) or positions.dtype != torch.int64
            or not positions.is_contiguous()):
        raise ValueError("rotate_ takes [rows, heads, head_dim] rows, [rows] int64 positions "
                         "and contiguous [positions, head_dim / 2] tables")
    lib.bi_rope_rows(x.data_ptr(), x.stride(0), rows, heads, head_dim, positions.data_ptr(),
                     cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())


def add_layer_norm(lib: ctypes.CDLL, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """`layer_norm(a + b) * weight + bias` over the last dimension of `[rows, hidden]` `a` and
    `b` (an encoder layer's residual add and norm in one pass), into `out` (a new tensor by
    default; any `[rows, hidden]` rows of unit stride, `a` or `b` included)."""
    rows, hidden = a.shape
    if out is None:
        out = torch.empty((rows, hidden), dtype=torch.float32)
    if (not _float32_cpu(a, b, weight, bias, out) or b.shape != a.shape or out.shape != a.shape
            or any(t.stride(1) != 1 for t in (a, b, out))
            or weight.shape != (hidden,) or bias.shape != (hidden,)
            or not (weight.is_contiguous() and bias.is_contiguous())):
        raise ValueError("add_layer_norm takes [rows, hidden] rows of unit stride and "
                         "contiguous [hidden] weight and bias")
    lib.bi_add_layer_norm_rows(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
                               weight.data_ptr(), bias.data_ptr(), rows, hidden, eps,
                               out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out


def gelu_(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """GELU in its erf form (`F.gelu`'s default), in place on a contiguous tensor, to within
    ~1e-7 of torch's (erf by a rational approximation); returns `x`."""
    if not x.is_contiguous() or not _float32_cpu(x):
        raise ValueError("gelu_ takes a contiguous float32 CPU tensor")
    lib.bi_gelu(x.data_ptr(), x.numel(), torch.get_num_threads())
    return x
