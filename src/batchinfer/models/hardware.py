"""Device and dtype choice, one rule for every model: the generator and the encoder alike.

`resolve_device("auto")` is CUDA when present, else the CPU. `resolve_dtype("auto", device)` is
bfloat16 where the hardware multiplies it natively (CUDA with bf16; a CPU whose torch kernels
are AVX-512 and which has AVX512-BF16 or AMX), else float32: elsewhere bf16 matmuls are emulated
and slower than float32 (figures in docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

from batchinfer.core.config import DEVICES, DTYPES
from batchinfer.core.cpu import cpu_flags
from batchinfer.core.validation import check_choice

# The torch dtype of each name in `core.config.DTYPES` but "auto" (the config is torch-free).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """`"auto" | "cpu" | "cuda"` -> a torch device; `ValueError` for `cuda` without CUDA."""
    check_choice("device", name, DEVICES)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | str,
                  choices: Collection[str] = DTYPES) -> torch.dtype:
    """`name` (one of `choices`, a subset of `core.config.DTYPES`) -> the dtype for `device`.

    `auto`: bfloat16 where `device` runs it natively (see the module docstring), else float32.
    """
    check_choice("dtype", name, choices)
    if name != "auto":
        return TORCH_DTYPES[name]
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def cpu_has_fast_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when torch runs AVX-512 kernels and the CPU has bf16 dot products or AMX tiles.

    Both are needed: the flags alone do not help a torch build whose kernels stop at AVX2.
    Reads the `flags` line of `cpuinfo` (Linux); False where it cannot be read.
    """
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return False
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})
