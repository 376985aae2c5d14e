"""Linear layers whose weights are pre-packed for oneDNN: the CPU float32 matmul fast path.

`F.linear` with a dense weight on CPU goes to MKL's sgemm, which re-blocks the weight matrix
inside every call. oneDNN can instead reorder a weight once, at load time, into the blocked
layout its kernels read (`torch.ops.mkldnn._reorder_linear_weight`), and run every later
product on it (`torch.ops.mkldnn._linear_pointwise`). The packed tensor replaces the dense one,
so memory is unchanged, except a tied LM head, which gets a packed copy of the embedding table
(the table itself stays dense for the token lookup).

Decode-sized products (a few rows against a large weight) gain the most, since there the
per-call re-blocking is a large share of the work; prefill-sized ones run about as fast either
way (figures and the command in docs/architecture.md, "Measured figures behind design
choices"). Results match dense `F.linear` to float32 rounding (another summation order), not
bit for bit.

Only float32 on CPU: oneDNN's bf16 packing needs AVX-512 (or AVX-NE-CONVERT), and on GPUs the
dense path is already the vendor library's.
"""

from __future__ import annotations

import torch
from torch import nn

# Rows the packed layout is tuned for: decode-sized. Measured: the hint changes little, and
# prefill-sized products run as fast on a decode-tuned layout as dense ones do.
_BATCH_SIZE_HINT = 32


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `prepack_linears` applies to weights of `dtype` on `device`."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` with `weight` held in oneDNN's packed layout.

    Inference only: the packed weight is a buffer, not a parameter, and it is not part of the
    state dict (the checkpoint's dense tensors are the source of truth).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_SIZE_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().contiguous(), persistent=False
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """`gelu(self(x))` (erf form), the GELU applied by oneDNN as the product's post-op:
        no second pass over the output (the same values as `F.gelu` after `forward`)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "gelu", [],
                                                  "none")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def prepack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear`, in place; returns how many.

    Call only where `prepack_supported` says so, after the weights are loaded and on their
    device: the dense weights are dropped (unless something else holds them).
    """
    # By name, one at a time: each dense weight is freed as soon as its packed copy exists, so
    # the allocator reuses its memory for the next (holding the modules in a list would keep
    # every dense weight alive until the end and leave RSS a whole model higher).
    names = [name for name, child in module.named_modules() if isinstance(child, nn.Linear)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, attr, PackedLinear.from_linear(getattr(parent, attr)))
    return len(names)
