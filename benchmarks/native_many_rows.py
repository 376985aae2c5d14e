"""The native CPU kernels at prefill and encoder sizes, against what they replace.

    .venv/bin/python benchmarks/native_many_rows.py [--rounds 15] [--threads N]
        [--cases encoder,prefill,products] [--levels avx512,avx2,portable]

- encoder attention: `native.packed_attention` (unmasked, all-MiniLM-L6-v2's 12 heads of 32)
  against the packed encoder's SDPA path (one call per run of equally long sentences), for
  batches of 32 sentences of about 40, 130 and 250 tokens;
- prefill attention: the same kernel, causal, SmolLM2's 9 query heads over 3 KV heads of 64,
  against one SDPA call per prompt (`prefill.chunk_attention`), for one 512-token prompt, ten
  of 200 and 32 of 64;
- products: `F.linear` against the q4 and q8 native kernels with 16-bit inputs and with 8-bit
  ones (`--prefill-activations int8`; the same as 16-bit where the level has no 8-bit products:
  portable, NEON without dot products, AVX-512 without VNNI), on SmolLM2's gate+up and down
  shapes at 256 and 1,024 rows.

`--levels`: every native contender once per instruction-set level named (`BATCHINFER_CPU_ISA`'s
names, each built for this CPU), side by side in the same rounds.

Every case runs its contenders in turn, `--rounds` times (a load that comes and goes falls on
all); medians in ms, and each one's speedup over the first.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from batchinfer import native
from batchinfer.models.linear_kernels import WeightForms
from batchinfer.models.packed_encoder import _equal_length_runs
from batchinfer.native.linear import NativeLinear
from batchinfer.runner.backends.prefill import chunk_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pressure import cpu_model  # noqa: E402


def race(name: str, contenders: dict[str, Callable[[], object]], rounds: int) -> None:
    for fn in contenders.values():
        fn()
    seconds: dict[str, list[float]] = {key: [] for key in contenders}
    for _ in range(rounds):
        for key, fn in contenders.items():
            start = time.perf_counter()
            fn()
            seconds[key].append(time.perf_counter() - start)
    medians = {key: statistics.median(v) * 1e3 for key, v in seconds.items()}
    base = next(iter(medians.values()))
    print(name)
    for key, ms in medians.items():
        print(f"  {key:24}{ms:9.2f} ms {base / ms:6.2f}x", flush=True)


def natives(libs: dict[str, ctypes.CDLL], run: Callable[[ctypes.CDLL], object]
            ) -> dict[str, Callable[[], object]]:
    """`run` on each level's library, named `native` (one level) or by the level."""
    return {("native" if len(libs) == 1 else level): partial(run, lib)
            for level, lib in libs.items()}


def encoder_attention(libs: dict[str, ctypes.CDLL], rounds: int) -> None:
    rng = random.Random(0)
    for around in (40, 130, 250):
        encoder_case(libs, sorted(rng.randint(around - 4, around + 4) for _ in range(32)),
                     f"encoder, 32 x ~{around} tokens", rounds)


def encoder_case(libs: dict[str, ctypes.CDLL], lengths: list[int], name: str, rounds: int
                 ) -> None:
    heads, head_dim = 12, 32
    q, k, v = (torch.randn(sum(lengths), heads * head_dim) for _ in range(3))
    runs = _equal_length_runs(lengths)

    def sdpa() -> torch.Tensor:
        out, start = torch.empty_like(q), 0
        for count, n in runs:
            end = start + count * n
            parts = (t[start:end].view(count, n, heads, head_dim).transpose(1, 2)
                     for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(*parts).transpose(1, 2).reshape(
                end - start, -1)
            start = end
        return out

    race(name, {"sdpa": sdpa, **natives(libs, lambda lib: native.packed_attention(
        lib, q, k, v, lengths, heads))}, rounds)


def prefill_attention(libs: dict[str, ctypes.CDLL], rounds: int) -> None:
    for lengths in ([512], [200] * 10, [64] * 32):
        prefill_case(libs, lengths, rounds)


def prefill_case(libs: dict[str, ctypes.CDLL], lengths: list[int], rounds: int) -> None:
    heads, kv_heads, head_dim = 9, 3, 64
    total = sum(lengths)
    q = torch.randn(total, heads * head_dim)
    k, v = torch.randn(total, kv_heads * head_dim), torch.randn(total, kv_heads * head_dim)

    def sdpa() -> torch.Tensor:
        out, start = torch.empty(total, heads, head_dim), 0
        for n in lengths:
            rows = slice(start, start + n)
            out[rows] = chunk_attention(q[rows].view(n, heads, head_dim),
                                        k[rows].view(n, kv_heads, head_dim).transpose(0, 1),
                                        v[rows].view(n, kv_heads, head_dim).transpose(0, 1),
                                        None, head_dim ** -0.5)
            start += n
        return out

    race(f"prefill, {len(lengths)} x {lengths[0]} tokens", {
        "sdpa": sdpa, **natives(libs, lambda lib: native.packed_attention(
            lib, q, k, v, lengths, heads, causal=True))}, rounds)


def products(libs: dict[str, ctypes.CDLL], rounds: int) -> None:
    for n, k in ((3072, 576), (576, 1536)):
        weight, bias = torch.randn(n, k) * 0.05, torch.randn(n)
        for rows in (256, 1024):
            product_case(libs, weight, bias, torch.randn(rows, k), rounds)


def product_case(libs: dict[str, ctypes.CDLL], weight: torch.Tensor, bias: torch.Tensor,
                 x: torch.Tensor, rounds: int) -> None:
    forms = WeightForms(weight, bias)
    contenders: dict[str, Callable[[], object]] = {"F.linear": lambda: F.linear(x, weight, bias)}
    for name in ("q4_native", "q8_native"):
        built = forms.kernel(name)
        assert isinstance(built, NativeLinear)
        for level, lib in libs.items():
            wide = NativeLinear(lib, built.struct.kind, built.n, built.k, built.tensors, bias)
            eight = NativeLinear(lib, built.struct.kind, built.n, built.k, built.tensors, bias)
            eight.int8_inputs = True
            tag = f"{level} {name[:2]}" if len(libs) > 1 else name[:2]
            contenders[f"{tag} 16-bit"] = partial(wide, x)
            contenders[f"{tag} 8-bit"] = partial(eight, x)
    n, k = weight.shape
    race(f"product {n}x{k}, {x.shape[0]} rows", contenders, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cases", default="encoder,prefill,products",
                        help="which of encoder, prefill, products to run")
    parser.add_argument("--levels", default=None,
                        help="the instruction-set levels to compare (default: the one that "
                             "loads)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = native.library()
    if lib is None:
        sys.exit("the native kernels cannot be built here")
    libs = {}
    for level in args.levels.split(",") if args.levels else [native.isa_level(lib)]:
        built = native.library(level=level)
        if built is None:
            sys.exit(f"the native kernels cannot be built here at the {level} level")
        libs[level] = built
    eight = ", ".join(f"{level} {'yes' if built.bi_act8() else 'no'}"
                      for level, built in libs.items())
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"level {native.isa_level(lib)}; 8-bit inputs: {eight}")
    cases = args.cases.split(",")
    with torch.inference_mode():
        if "encoder" in cases:
            encoder_attention(libs, args.rounds)
        if "prefill" in cases:
            prefill_attention(libs, args.rounds)
        if "products" in cases:
            products(libs, args.rounds)


if __name__ == "__main__":
    main()
