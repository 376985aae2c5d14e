"""Every linear kernel at every row bucket on the default model's weights, on this machine: what
`--linear-kernels auto` chooses from, as a table.

    .venv/bin/python benchmarks/linear_kernels.py               # float32 activations
    .venv/bin/python benchmarks/linear_kernels.py --threads 1

Each kernel runs whole passes over the model's linears in model order (the engine's start-up
measurement, `linear_kernels.measure`); the table gives, per weight shape and row count, the
milliseconds per pass all linears of that shape take (30 layers: 30 calls; the tied LM head:
one), medians of the timed passes. `-`: pruned (over 3x the best at that row count, or at a
smaller one). `*`: the fastest of all weight forms; `+`: the fastest of its own weight form.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from batchinfer import native
from batchinfer.models import linear_kernels as lk
from batchinfer.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pressure import cpu_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, torch.float32, "cpu").model
    weights = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights.append((model.embed_tokens.weight, None))  # the tied LM head
    shapes = list(dict.fromkeys(tuple(w.shape) for w, _ in weights))
    cpu = torch.device("cpu")
    timings: dict[str, list[dict[tuple[int, int], float]]] = {}
    best_of_form: dict[tuple[int, int, int], set[str]] = {}
    for quantization in lk.KERNELS_BY_QUANTIZATION:
        names = lk.candidates(quantization, cpu, torch.float32)
        sites = [lk.WeightForms(w, b) for w, b in weights]
        measured = lk.measure(sites, names, torch.float32)
        timings.update(measured)
        for shape, kernels in lk.fastest(measured, names, shapes).items():
            for bucket, name in enumerate(kernels):
                best_of_form.setdefault((*shape, bucket), set()).add(name)
    names = list(timings)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"native ISA level {native.isa_level()} (BATCHINFER_CPU_ISA); ms per pass")
    print(f"{'shape':>12} {'rows':>5}" + "".join(f"{n:>12}" for n in names))
    for shape in shapes:
        for bucket, rows in enumerate(lk.PROBE_ROWS):
            row = {n: timings[n][bucket].get(shape, math.inf) for n in names}
            best = min(names, key=row.__getitem__)
            cells = ""
            for n in names:
                mark = "*" if n == best else "+" if n in best_of_form[(*shape, bucket)] else " "
                cells += (f"{'-':>11} " if math.isinf(row[n]) else f"{row[n] * 1e3:11.2f}{mark}")
            print(f"{shape[0]:>6}x{shape[1]:<5} {rows:>5}{cells}")


if __name__ == "__main__":
    main()
