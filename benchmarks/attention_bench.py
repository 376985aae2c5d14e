"""Time one layer of paged attention, every attention backend side by side.

    .venv/bin/python benchmarks/attention_bench.py [--decodes 64] [--context 300] [--threads N]

The default shape is SmolLM2-135M's attention (9 heads, 3 KV heads, head_dim 64), block size
16: `--decodes` decodes with contexts `--context` +- 20 % over shuffled blocks. `cpu_sparse`
runs only on float32 caches. Figures are in docs/architecture.md ("Attention backends").
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from batchinfer.core.outputs import ScheduledSequence
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.runner.attention import select_attention_backend
from batchinfer.runner.backends.cpu_sparse import supports_cpu_sparse
from batchinfer.runner.input_batch import prepare_inputs

BACKENDS = ("sdpa", "gather", "cpu_sparse")


class _Spec:
    num_layers = 1

    def __init__(self, num_kv_heads: int, head_dim: int) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim


def _decode_batch(
    num_decodes: int, context: int, spread: int, block_size: int, num_blocks: int
) -> list[ScheduledSequence]:
    rng = random.Random(0)
    free = list(range(num_blocks))
    rng.shuffle(free)
    sequences = []
    for i in range(num_decodes):
        context_len = context + rng.randint(-spread, spread)
        n = -(-context_len // block_size)
        table, free = free[:n], free[n:]
        sequences.append(ScheduledSequence(
            f"r{i}", [1], context_len - 1, table, True, SamplingParams(), context_len - 1
        ))
    return sequences


def time_attention(
    backend_name: str,
    num_decodes: int,
    context: int,
    dtype: torch.dtype,
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    repeats: int = 30,
) -> float:
    """Fastest of `repeats` attention calls, in seconds (the step is built outside the timing).

    The minimum, not the median: on a shared machine the median mostly measures the neighbours.
    With one torch thread the clock is the thread's CPU time (immune to being descheduled);
    with more it is wall time, since the other threads' work would not show in CPU time.
    """
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    spread = max(1, context // 5)
    num_blocks = num_decodes * (-(-(context + spread) // block_size)) + 1
    cpu = torch.device("cpu")
    backend = select_attention_backend(cpu, dtype, backend_name)
    backend.allocate_kv_cache(_Spec(num_kv_heads, head_dim), num_blocks, block_size)
    backend.kv_cache.normal_()
    sequences = _decode_batch(num_decodes, context, spread, block_size, num_blocks)
    inputs = prepare_inputs(sequences, block_size, cpu)
    q = torch.randn(num_decodes, num_heads, head_dim).to(dtype)
    k = torch.randn(num_decodes, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(num_decodes, num_kv_heads, head_dim).to(dtype)
    times = []
    with torch.inference_mode():
        backend.build(inputs.attention)
        for _ in range(repeats + 3):
            start = clock()
            backend(0, q, k, v)
            times.append(clock() - start)
    return min(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        for name in BACKENDS:
            if name == "cpu_sparse" and not supports_cpu_sparse(cpu, dtype):
                continue
            seconds = time_attention(name, args.decodes, args.context, dtype)
            print(f"{str(dtype):15} {name:11} {seconds * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
