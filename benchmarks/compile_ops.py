"""Per-call cost of the decoder's small elementwise ops, eager vs `torch.compile` (inductor, CPU).

    .venv/bin/python benchmarks/compile_ops.py

RMSNorm + residual add, SiLU(gate) x up and RoPE as `models/llama.py` writes them, on
SmolLM2-135M's sizes, at 1 row (one-sequence decode) and 32 rows; microseconds per call,
median of 5 x 3,000 calls after a warm-up. At decode sizes a compiled call's own overhead
(guards, wrapper) outweighs what it fuses: see docs/architecture.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM = 576, 1536, 15, 64


def rms_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return x, (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * weight


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def per_call_us(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], calls: int) -> float:
    for _ in range(200):
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
    print(f"{'op':14}{'rows':>6}{'eager us':>10}{'compiled us':>13}")
    for rows in (1, 32):
        cases = {
            "rmsnorm+add": (rms_add, (torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN),
                                      torch.randn(HIDDEN))),
            "silu*mul": (silu_mul, (torch.randn(rows, 2 * INTERMEDIATE),)),
            "rope": (rope, (torch.randn(rows, HEADS, HEAD_DIM),
                            torch.randn(rows, 1, HEAD_DIM // 2),
                            torch.randn(rows, 1, HEAD_DIM // 2))),
        }
        for name, (fn, inputs) in cases.items():
            compiled = torch.compile(fn, dynamic=False)
            print(f"{name:14}{rows:6}{per_call_us(fn, inputs, args.calls):10.1f}"
                  f"{per_call_us(compiled, inputs, args.calls):13.1f}")


if __name__ == "__main__":
    main()
