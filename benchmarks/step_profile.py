"""Where the CPU time of a generative step goes: linear / attention / gather / other.

    .venv/bin/python benchmarks/step_profile.py                  # the default workload, 1 thread
    .venv/bin/python benchmarks/step_profile.py --ops            # plus top ops per step type
    .venv/bin/python benchmarks/step_profile.py --num-prompts 16 --decode-steps 4   # quicker

Builds the default model (SmolLM2-135M) in float32 and drives `LLMEngine.step()` over a fixed
workload: `--num-prompts` random prompts of `--prompt-len` tokens (`ignore_eos`, long
`max_tokens`), so the first steps are prefill-heavy (full token budget, decodes riding along);
once every prompt is in, `--decode-steps` pure decode steps with all of them; then half of the
requests are aborted and as many decode steps run with the other half. With the default 64
prompts of 200-400 tokens that gives decodes of 64 and 32 sequences at 200-500-token contexts.

Times are the CPU time of this thread (`time.thread_time`) with torch on one thread (the
default `--threads 1`): on a shared machine, wall time mostly measures the neighbours, and with
one thread the thread's CPU time is exactly the work done. With `--threads N > 1` they are wall
time, since the other threads' work would not show in this thread's CPU time. Each step's time
is split by wrapping, for the run only:
- linear:    every projection and the LM head (`KernelLinear`, whichever kernel it chose);
- attention: the attention backend's `__call__` minus the two below (scores, softmax,
             weighted sum);
- gather:    KV cache copies: block gathers (`paged_rows.gather_blocks`) and this step's K/V
             writes (`paged_rows.write_kv`). With the `cpu_sparse` backend (the default for CPU
             float32) decodes read the cache in place, without a gather, so their cache reads
             count as attention;
- native:    a whole decode step run as one native call (`--native-decode`, on by default
             where the start-up measurement took it for the step's row count): the model,
             attention and LM head together;
- other:     the rest of the step (embedding, norms, RoPE, activations, residuals, sampling,
             input preparation, scheduler).
Each bucket is self time: a wrapped call nested in another is subtracted from its parent.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from batchinfer import SamplingParams
from batchinfer.engine.llm_engine import LLMEngine
from batchinfer.engine.outputs import RequestOutputKind
from batchinfer.models.linear_kernels import KernelLinear
from batchinfer.native.memory import huge_page_buffer, huge_pages_supported
from batchinfer.runner.backends import gather, paged_rows
from batchinfer.runner.backends.sdpa import SdpaBackend
from batchinfer.runner.native_decode import NativeDecoder

BUCKETS = ("linear", "attention", "gather", "native", "other")
# (owner, attribute, bucket): the callables timed, patched for the duration of the run.
_TIMED: list[tuple[Any, str, str]] = [
    (F, "linear", "linear"),
    (KernelLinear, "forward", "linear"),
    (KernelLinear, "add_into", "linear"),  # o_proj / down_proj adding into the residual
    (paged_rows.PagedRowsBackend, "__call__", "attention"),
    (SdpaBackend, "__call__", "attention"),
    (paged_rows, "gather_blocks", "gather"),
    (gather, "gather_blocks", "gather"),  # imported by name there
    (paged_rows, "write_kv", "gather"),
    (NativeDecoder, "logits", "native"),
]


class SplitTimer:
    """Self time per bucket of the wrapped callables, reset per step, read from `clock`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # [start, time spent in nested wrapped calls]

    def wrap(self, fn: Callable[..., Any], bucket: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [self.clock(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = self.clock() - frame[0]
                self.seconds[bucket] += elapsed - frame[1]
                if self._stack:
                    self._stack[-1][1] += elapsed

        return timed

    @contextmanager
    def patched(self) -> Iterator[None]:
        originals = []
        for owner, name, bucket in _TIMED:
            original = getattr(owner, name, None)
            if original is None:
                raise RuntimeError(f"{owner.__name__}.{name} is gone; update _TIMED")
            originals.append((owner, name, original))
            setattr(owner, name, self.wrap(original, bucket))
        try:
            yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)


@dataclass
class StepRecord:
    kind: str
    num_seqs: int
    num_tokens: int
    max_context: int
    seconds: dict[str, float] = field(default_factory=dict)


def timed_step(
    engine: LLMEngine, timer: SplitTimer, kind: str, op_tables: dict[str, str] | None
) -> StepRecord:
    """One `engine.step()`, recorded under `kind` with its time split.

    With `op_tables`, the first step of each kind also runs under torch.profiler and its
    top ops by self CPU time are kept there (that step's split includes profiler overhead).
    """
    if op_tables is not None and kind not in op_tables:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profiler:
            record = timed_step(engine, timer, kind, None)
        op_tables[kind] = profiler.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48
        )
        return record
    timer.seconds.clear()
    start = timer.clock()
    # The body of `LLMEngine.step()` (`EngineCore.step` + output processing), inlined to see
    # what was scheduled.
    core = engine.core
    scheduler_output = core.scheduler.schedule()
    if scheduler_output.is_empty:
        raise RuntimeError("nothing scheduled; the workload is too small for the step counts")
    runner_output = core.runner.execute(scheduler_output)
    engine.process_outputs(core.scheduler.update_from_output(scheduler_output, runner_output))
    total = timer.clock() - start
    split = {bucket: timer.seconds.get(bucket, 0.0) for bucket in BUCKETS[:-1]}
    split["other"] = total - sum(split.values())
    seqs = scheduler_output.sequences
    return StepRecord(
        kind,
        len(seqs),
        scheduler_output.num_scheduled_tokens,
        max(s.num_computed_tokens + s.num_tokens for s in seqs),
        split,
    )


def run_workload(
    engine: LLMEngine,
    args: argparse.Namespace,
    timer: SplitTimer,
    op_tables: dict[str, str] | None,
) -> list[StepRecord]:
    rng = random.Random(args.seed)
    low, high = args.prompt_len
    vocab = engine.processor.vocab_size
    params = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)
    request_ids = [
        engine.add_request([rng.randrange(100, vocab) for _ in range(rng.randint(low, high))],
                           params, kind=RequestOutputKind.FINAL_ONLY)
        for _ in range(args.num_prompts)
    ]
    records = []
    scheduler = engine.core.scheduler
    # Prefill-heavy: until every prompt is in (decodes of the early ones ride along).
    while scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        records.append(timed_step(engine, timer, "prefill-heavy", op_tables))
    for half in dict.fromkeys((args.num_prompts, args.num_prompts // 2)):
        if half < 1:
            continue  # one prompt: its decode steps only
        for request_id in request_ids[half:]:
            engine.abort_request(request_id)
        for _ in range(args.decode_steps):
            records.append(timed_step(engine, timer, f"decode {half}", op_tables))
    return records


def report(records: list[StepRecord]) -> None:
    kinds = list(dict.fromkeys(r.kind for r in records))
    header = f"{'step type':15} {'steps':>5} {'seqs':>5} {'tokens':>6} {'ctx max':>7} {'ms/step':>8}"
    print(header + "".join(f" {b:>15}" for b in BUCKETS))
    for kind in kinds:
        group = [r for r in records if r.kind == kind]
        # Median per bucket: robust to a step that caught a page-fault storm or a neighbour.
        ms = {b: 1e3 * statistics.median(r.seconds[b] for r in group) for b in BUCKETS}
        total = sum(ms.values())
        cells = "".join(f" {ms[b]:8.1f} ({ms[b] / total:4.0%})" for b in BUCKETS)
        seqs = statistics.median(r.num_seqs for r in group)
        tokens = statistics.median(r.num_tokens for r in group)
        context = max(r.max_context for r in group)
        print(f"{kind:15} {len(group):5} {seqs:5.0f} {tokens:6.0f} {context:7} {total:8.1f}{cells}")
    print("(median ms per step of each bucket, seqs and tokens; ms/step is the buckets' sum)")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-row forward pass reads in full: each linear's weight in the form its
    one-row kernel reads (`KernelLinear.read_bytes`: int8, 4-bit, dense or packed; the native
    form where one-row decode steps run natively), the other
    parameters and buffers (norms), less the embedding table (one row per token) unless the LM
    head reads it (tied), and the RoPE tables (one row per position)."""
    linears = [m for m in model.modules() if isinstance(m, KernelLinear)]
    total = sum(m.read_bytes[0] if m.native[0] is None else m.native[0].nbytes
                for m in linears)
    skip = {id(model.rope_cos), id(model.rope_sin)}
    if getattr(model, "lm_head", None) is not None:
        skip.add(id(model.embed_tokens.weight))
    inside = {id(t) for m in linears for t in [*m.parameters(), *m.buffers()]}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]
               if id(t) not in skip and id(t) not in inside}
    return total + sum(t.numel() * t.element_size() for t in tensors.values()
                       if t.device.type != "meta" and t.layout == torch.strided)


def stream_buffer(num_bytes: int) -> torch.Tensor:
    """A float32 buffer of `num_bytes`, in huge pages where the platform has them (as the
    weights are)."""
    count = max(1, num_bytes // 4)
    if huge_pages_supported():
        return huge_page_buffer(count * 4).view(torch.float32).fill_(1.0)
    return torch.ones(count)


def stream_seconds(num_bytes: int, passes: int = 5) -> float:
    """Time to read `num_bytes` once from memory (a float32 sum over `stream_buffer`, the
    median of `passes` passes: this machine's bandwidth comes and goes, and a step is quoted
    as a median too): a decode step's floor, whatever form the weights take."""
    buffer = stream_buffer(num_bytes)
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_memory_floor(engine: LLMEngine, records: list[StepRecord]) -> None:
    """The fixed cost of a one-sequence decode step next to the time to stream the weights."""
    model = engine.worker.loaded.model
    one = [sum(r.seconds.values()) for r in records if r.num_seqs == 1 and r.num_tokens == 1]
    size = weight_bytes(model)
    floor_s = stream_seconds(size)
    print(f"weights read per step: {size / 2**20:.0f} MiB; streaming them once: "
          f"{floor_s * 1e3:.1f} ms ({size / floor_s / 1e9:.1f} GB/s)")
    if one:
        step_s = statistics.median(one)
        print(f"one-token step of one sequence: {step_s * 1e3:.1f} ms, "
              f"{step_s / floor_s:.1f}x the time to stream the weights")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=lambda s: tuple(map(int, s.split(":"))),
                        default=(200, 400), help="LOW:HIGH prompt tokens")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--linear-kernels", default="auto",
                        help="the engine's --linear-kernels (default auto: measured)")
    parser.add_argument("--quantization", default="none", help="the engine's --quantization")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the engine's --kv-cache-dtype")
    parser.add_argument("--prefill-activations", default="int16",
                        help="the engine's --prefill-activations")
    parser.add_argument("--attention-backend", default="auto",
                        help="the engine's --attention-backend")
    parser.add_argument("--native-decode", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's --native-decode")
    parser.add_argument("--ops", action="store_true",
                        help="also print torch.profiler's top ops of one step of each type")
    args = parser.parse_args()
    engine = LLMEngine.from_kwargs(
        model="default", dtype="float32", num_threads=args.threads,
        max_num_seqs=max(64, args.num_prompts), linear_kernels=args.linear_kernels,
        quantization=args.quantization, attention_backend=args.attention_backend,
        prefill_activations=args.prefill_activations, kv_cache_dtype=args.kv_cache_dtype,
        native_decode=args.native_decode,
    )
    # Warm-up: first-call allocations and lazy initialisation stay out of the figures.
    engine.add_request(list(range(100, 164)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    timer = SplitTimer(time.thread_time if args.threads == 1 else time.perf_counter)
    op_tables: dict[str, str] | None = {} if args.ops else None
    with timer.patched():
        records = run_workload(engine, args, timer, op_tables)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{engine.worker.spec.num_layers} layers, block_size {engine.config.block_size}")
    report(records)
    print_memory_floor(engine, records)
    for kind, table in (op_tables or {}).items():
        print(f"\n{kind}: top ops of its first step (torch.profiler)\n{table}")

if __name__ == "__main__":
    main()
