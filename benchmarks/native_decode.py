"""A decode step by the torch model against the same step in one native call, on one cache.

    .venv/bin/python benchmarks/native_decode.py                      # q4 and none, 1-32 rows
    .venv/bin/python benchmarks/native_decode.py --weights q4 --rows 1,8 --context 512
    .venv/bin/python benchmarks/native_decode.py --weights q4,q4+a8 --levels avx512,avx2,portable

Loads the embedded model per `--weights` form (kernels `auto`, as the engine chooses them;
the native forms of every row bucket kept, where the engine keeps only those its start-up
measurement takes), then for each row count builds one decode step of that many sequences at
`--context` tokens (`prepare_inputs`, as the runner does) and times `NativeDecoder.logits` and
the runner's torch path on it alternately, `--repeats` times each: median milliseconds per
step. A row count whose bucket has no native form for every linear shows the torch figure only;
the last column says which way the engine's own start-up measurement chose for that bucket.
A `+a8` form takes `--prefill-activations int8` (steps of 8+ sequences round the layers' inputs
to 8 bits where the level has 8-bit products). `--levels`: the native step once per
instruction-set level named (`BATCHINFER_CPU_ISA`'s names, each built for this CPU: one
library per level, reading the same weights and cache), in turn with the torch step, which
runs the level that loads. `--floor`: a third contender in the same rotation, one sum over a
buffer as large as the weights a one-row step reads (`step_profile.stream_seconds`' pass),
printed as the floor's milliseconds and floor / native: each step next to the memory's speed
of that moment, where this machine's bandwidth comes and goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from batchinfer import LLM, SamplingParams, native
from batchinfer.core.cpu import cpu_model
from batchinfer.core.outputs import ScheduledSequence
from batchinfer.models.linear_kernels import BUCKET_NAMES, bucket_of
from batchinfer.runner import model_runner
from batchinfer.runner.input_batch import prepare_inputs
from batchinfer.runner.native_decode import NativeDecoder, choose_buckets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import stream_buffer, weight_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="q4,none",
                        help="--quantization forms; +a8: with --prefill-activations int8")
    parser.add_argument("--rows", default="1,4,16,32", help="sequences per step")
    parser.add_argument("--context", type=int, default=256, help="tokens in each context")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--floor", action="store_true",
                        help="time streaming the weights' bytes in the same rotation")
    parser.add_argument("--levels", default=None,
                        help="native steps at these instruction-set levels (default: the one "
                             "that loads)")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    loaded = native.isa_level()
    levels = args.levels.split(",") if args.levels else [loaded or "native"]
    libs = {}
    for level in levels if loaded else []:
        built = native.library(level=level)
        if built is None:
            sys.exit(f"the native kernels cannot be built here at the {level} level")
        libs[level] = built
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"native ISA level {loaded} (BATCHINFER_CPU_ISA); contexts of "
          f"{args.context} tokens; median of {args.repeats} steps")
    named = len(levels) > 1
    print(f"{'weights':8}{'rows':>6}{'torch ms':>10}"
          + "".join(f"{(level + ' ms') if named else 'native ms':>13}{'speed-up':>10}"
                    for level in levels) + f"{'engine runs':>13}"
          + (f"{'floor ms':>10}{'floor/native':>14}" if args.floor else ""))
    chosen: list[tuple[bool, ...]] = []

    def keep_every_bucket(decoder: NativeDecoder, *rest: Any) -> tuple[bool, ...]:
        chosen.append(choose_buckets(decoder, *rest))  # what the engine would keep
        return decoder.buckets

    for form in args.weights.split(","):
        chosen.clear()
        model_runner.choose_buckets = keep_every_bucket
        quantization, _, extra = form.partition("+")
        try:
            llm = LLM("default", dtype="float32", quantization=quantization,
                      enable_prefix_caching=False, kv_cache_memory="1G",
                      prefill_activations="int8" if extra == "a8" else "int16")
        finally:
            model_runner.choose_buckets = choose_buckets
        runner = llm.engine.worker.runner
        taken = [name for name, on in zip(BUCKET_NAMES, chosen[0], strict=True) if on] if (
            chosen) else []
        # A decoder over every bucket that has native forms, whatever start-up chose.
        decoder, why = NativeDecoder.build(llm.engine.worker.loaded.model, runner.attention)
        buffer = stream_buffer(weight_bytes(llm.engine.worker.loaded.model)) if (
            args.floor) else None
        block_size = llm.engine.config.block_size
        per_seq = -(-(args.context + 1) // block_size)
        for rows in rows_list:
            params = SamplingParams(max_tokens=1)
            inputs = prepare_inputs(
                [ScheduledSequence(str(r), [1], args.context,
                                   list(range(r * per_seq, (r + 1) * per_seq)), True, params,
                                   args.context) for r in range(rows)],
                block_size, torch.device("cpu"))
            ways = {"torch": runner._torch_logits}
            if decoder is not None and decoder.accepts(inputs):
                for level, lib in libs.items():
                    ways[level] = NativeDecoder(lib, decoder.model, decoder.backend,
                                                decoder.buckets).logits
            if buffer is not None:
                ways["floor"] = lambda _inputs, b=buffer: b.sum()
            times: dict[str, list[float]] = {name: [] for name in ways}
            with torch.inference_mode():
                for step in range(args.repeats + 1):
                    for name, run in ways.items():
                        start = time.perf_counter()
                        run(inputs)
                        if step:  # the first of each is a warm-up
                            times[name].append(time.perf_counter() - start)
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            cells = "".join(f"{ms[level]:13.1f}{ms['torch'] / ms[level]:9.2f}x" if (
                level in ms) else f"{'-':>13}{'':>10}" for level in levels)
            bucket = BUCKET_NAMES[bucket_of(rows)]
            floor = ""
            if "floor" in ms:
                native_ms = ms[levels[0]] if levels[0] in ms else ms["torch"]
                floor = f"{ms['floor']:10.1f}{ms['floor'] / native_ms:13.2f}x"
            print(f"{form:8}{rows:6}{ms['torch']:10.1f}{cells}"
                  f"{'native' if bucket in taken else 'torch':>13}{floor}", flush=True)
        if decoder is None:
            print(f"{form}: no native decode steps ({why})")
        del llm, decoder, buffer


if __name__ == "__main__":
    main()
