"""Per-call cost of the decoder's small elementwise ops: torch eager, `torch.compile`
(inductor, CPU) and the native one-pass kernels the model runs on float32 CPU rows.

    .venv/bin/python benchmarks/compile_ops.py

RMSNorm, SiLU(gate) x up (into a new contiguous tensor, as the next product reads it) and RoPE
of q + k as `models/llama.py` writes them in torch, on SmolLM2-135M's sizes, at 1 row
(one-sequence decode), 32 rows and 2,048 (a prefill chunk); microseconds per call, median of 5
rounds after a warm-up. At decode sizes a compiled call's own overhead (guards, wrapper)
outweighs what it fuses; the native kernels (`native/elementwise.py`) do each op in one pass:
see docs/architecture.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from batchinfer import native
from batchinfer.native import elementwise

HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM = 576, 1536, 12, 64  # HEADS: q + k


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    inverse = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * inverse).mul_(weight)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def native_cases(rows: int) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    """The native kernels on the same sizes (empty where the library cannot be built)."""
    lib = native.library()
    if lib is None:
        return {}
    positions = torch.arange(rows, dtype=torch.int64)
    # true angles: rotating the same rows over and over keeps their size (no overflow, no
    # subnormals)
    angles = torch.rand(max(rows, 1), HEAD_DIM // 2) * 6.28
    return {
        "rmsnorm": (elementwise.rms_norm, (lib, torch.randn(rows, HIDDEN), torch.randn(HIDDEN),
                                           1e-5)),
        "silu*mul": (elementwise.silu_mul, (lib, torch.randn(rows, 2 * INTERMEDIATE))),
        "rope": (elementwise.rotate_, (lib, torch.randn(rows, HEADS + 3, HEAD_DIM), HEADS,
                                       positions, angles.cos(), angles.sin())),
    }


def per_call_us(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], calls: int) -> float:
    for _ in range(max(3, calls // 10)):
        fn(*args)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'op':14}{'rows':>6}{'eager us':>10}{'compiled us':>13}{'native us':>11}")
    for rows in (1, 32, 2048):
        calls = max(20, args.calls * 32 // max(rows, 32))
        cases = {
            "rmsnorm": (rms_norm, (torch.randn(rows, HIDDEN), torch.randn(HIDDEN))),
            "silu*mul": (silu_mul, (torch.randn(rows, 2 * INTERMEDIATE),)),
            "rope": (rope, (torch.randn(rows, HEADS, HEAD_DIM),
                            torch.randn(rows, 1, HEAD_DIM // 2),
                            torch.randn(rows, 1, HEAD_DIM // 2))),
        }
        natives = native_cases(rows)
        for name, (fn, inputs) in cases.items():
            compiled = torch.compile(fn, dynamic=False)
            own = ""
            if name in natives:
                own = f"{per_call_us(natives[name][0], natives[name][1], calls):11.1f}"
            print(f"{name:14}{rows:6}{per_call_us(fn, inputs, calls):10.1f}"
                  f"{per_call_us(compiled, inputs, calls):13.1f}{own}")


if __name__ == "__main__":
    main()
