"""This checkout's native products against another checkout's, side by side in one process.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python benchmarks/kernel_ab.py --against /tmp/before [--level avx2]

Builds the other checkout's `native/cpu_kernels.c` at the same instruction-set level (its
own cache folder) and runs both libraries' q4 and q8 products (16-bit inputs) on the same
packed weights, SmolLM2's gate+up (3072x576) and down (576x1536) shapes at 16-1,024 rows,
alternately (`--rounds` each, medians): milliseconds, before / after, and the largest
difference between the two outputs relative to the largest output.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from batchinfer import native
from batchinfer.core.cpu import cpu_model
from batchinfer.models.linear_kernels import q4_affine, quantize_q4
from batchinfer.native.linear import NativeLinear, pack_q4, pack_q8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the other checkout's root")
    parser.add_argument("--level", default=None, help="BATCHINFER_CPU_ISA's names")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    after = native.library(level=args.level)
    if after is None:
        raise SystemExit("the native kernels cannot be built here")
    level = native.isa_level(after)
    source = Path(args.against) / "src/batchinfer/native/cpu_kernels.c"
    before = native.build_and_load(Path(args.against) / ".kernel_ab",
                                   native.level_flags(level or "portable"), source)
    if before is None:
        raise SystemExit(f"{source} does not build")
    print(f"CPU: {cpu_model()}; level {level}; {torch.get_num_threads()} threads; medians of "
          f"{args.rounds} alternated runs")
    torch.manual_seed(0)
    for n, k in ((3072, 576), (576, 1536)):
        w = torch.randn(n, k) * 0.05
        q, pairs = quantize_q4(w)
        forms = {"q4": (native.Q4, pack_q4(q, *q4_affine(pairs))),
                 "q8": (native.Q8, pack_q8(w))}
        for name, (kind, tensors) in forms.items():
            new = NativeLinear(after, kind, n, k, tensors, None)
            old = NativeLinear(before, kind, n, k, tensors, None)
            for rows in (16, 32, 256, 1024):
                x = torch.randn(rows, k)
                want = old(x)
                differs = float((new(x) - want).abs().max() / want.abs().max())
                times: dict[str, list[float]] = {"before": [], "after": []}
                for _ in range(args.rounds):
                    for label, form in (("before", old), ("after", new)):
                        start = time.perf_counter()
                        form(x)
                        times[label].append(time.perf_counter() - start)
                ms = {label: 1e3 * statistics.median(t) for label, t in times.items()}
                print(f"{name} {n}x{k} {rows:5d} rows: before {ms['before']:7.3f} ms, after "
                      f"{ms['after']:7.3f} ms, {ms['before'] / ms['after']:.3f}x; outputs differ "
                      f"by {differs:.1e}", flush=True)


if __name__ == "__main__":
    main()
