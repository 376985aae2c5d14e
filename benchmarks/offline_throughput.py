"""Offline throughput, side by side in one process: batchinfer (continuous, static) against
Hugging Face `generate` (static batches with left padding, and one prompt at a time).

    .venv/bin/python benchmarks/offline_throughput.py                 # the full comparison
    .venv/bin/python benchmarks/offline_throughput.py --systems continuous --dtypes bfloat16

Every system gets the same prompts (token ids) and output lengths (`ignore_eos`), so "useful
output tokens" are the same for all; padding and over-generation count as waste. Prints a table
and writes JSON (`--json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from batchinfer import LLM, SamplingParams


@dataclass
class Result:
    system: str
    dtype: str
    num_prompts: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    peak_rss_gib: float = 0.0  # of the process during this run (see `measure_peak_rss`)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def make_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*input_len))],
         rng.randint(*output_len))
        for _ in range(n)
    ]


def run_batchinfer(system: str, dtype: str, workload, args) -> Result:
    """`continuous`, `static`, `dynamic`: the whole workload in one `generate` call;
    `single`: one prompt per `generate` call, the engine's single-stream speed."""
    form = "continuous" if system == "single" else system
    llm = LLM("default", dtype=dtype, batching=form, max_batch_size=args.static_batch_size,
              kv_cache_memory=args.kv_cache_memory)
    prompts = [p for p, _ in workload]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    if system == "single":
        outs = [llm.generate([p], [sp], use_tqdm=False)[0]
                for p, sp in zip(prompts, params, strict=True)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(m for _, m in workload)
    return Result(system, dtype, len(workload), seconds, sum(map(len, prompts)), produced)


def load_hf(dtype: str):
    from transformers import AutoModelForCausalLM

    from batchinfer.models.loader import load_model

    # The converted Hugging Face folder of the embedded GGUF: the very same weights.
    path = load_model("default", torch.float32, torch.device("cpu")).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model


def hf_generate(model, batch: list[tuple[list[int], int]], pad_id: int) -> None:
    longest = max(len(p) for p, _ in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(batch):  # left padding
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    new = max(m for _, m in batch)
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, pad_token_id=pad_id)


def run_hf(name: str, dtype: str, workload, batch_size: int, model) -> Result:
    hf_generate(model, workload[:1], 0)  # warm-up
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(workload), batch_size):
            hf_generate(model, workload[i:i + batch_size], 0)
    seconds = time.perf_counter() - start
    return Result(name, dtype, len(workload), seconds, sum(len(p) for p, _ in workload),
                  sum(m for _, m in workload))


def measure_peak_rss(run):
    """`run()` and the process's peak RSS in GiB during it: Linux's VmHWM, reset first by
    writing 5 to /proc/self/clear_refs (elsewhere, the peak since the process started)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    result = run()
    try:
        status = Path("/proc/self/status").read_text()
        kib = int(status.split("VmHWM:")[1].split()[0])
    except (OSError, IndexError, ValueError):
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result.peak_rss_gib = kib / (1 << 20)
    return result


SYSTEMS = ("continuous", "static", "dynamic", "single", "hf-static", "hf-single")


def run_system(system: str, dtype: str, workload, args) -> Result:
    """One run of `system` (one of `SYSTEMS`). Each holds only its own model: HF's is loaded
    for its runs and freed after, so every row's peak RSS is that system's alone."""
    if system.endswith("single"):  # one at a time is slow: the first prompts only
        workload = workload[:args.single_prompts]
    if not system.startswith("hf-"):
        return measure_peak_rss(lambda: run_batchinfer(system, dtype, workload, args))
    model = load_hf(dtype)
    batch_size = 1 if system == "hf-single" else args.static_batch_size
    return measure_peak_rss(lambda: run_hf(system, dtype, workload, batch_size, model))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="32:512")
    parser.add_argument("--output-len", default="32:256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--systems", default="continuous,static,hf-static,single,hf-single")
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--single-prompts", type=int, default=8,
                        help="one-at-a-time systems (single, hf-single) run on the first N prompts"
                             " only (it is slow)")
    parser.add_argument("--kv-cache-memory", default="2G")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per system, round robin; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="results/offline_throughput.json")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    workload = make_workload(args.num_prompts, parse_range(args.input_len),
                             parse_range(args.output_len), 49152, args.seed)
    results: list[Result] = []  # the median run of each system
    all_runs: list[Result] = []
    systems = args.systems.split(",")
    unknown = [system for system in systems if system not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    console = Console(width=max(Console().width, 110))  # a full table in logs too
    for dtype in args.dtypes.split(","):
        runs: dict[str, list[Result]] = {system: [] for system in systems}
        # Round robin over the systems, so a noisy stretch of the machine hits them alike.
        for repeat in range(args.repeats):
            for system in systems:
                result = run_system(system, dtype, workload, args)
                runs[system].append(result)
                console.print(f"{system:12s} {dtype:9s} {result.output_tok_s:8.1f} out tok/s "
                              f"{result.total_tok_s:8.1f} total tok/s ({result.seconds:.1f} s, "
                              f"run {repeat + 1}/{args.repeats})")
        for system in systems:
            results.append(sorted(runs[system], key=lambda r: r.seconds)[args.repeats // 2])
            all_runs.extend(runs[system])

    table = Table(title=f"offline throughput: {args.num_prompts} prompts, input {args.input_len},"
                        f" output {args.output_len} (torch threads {torch.get_num_threads()})")
    for col in ("system", "dtype", "prompts", "seconds", "useful out tok/s", "total tok/s",
                "vs HF", "peak RSS GiB"):
        table.add_column(col, justify="right")
    runs_of: dict[tuple[str, str], list[Result]] = {}
    for run in all_runs:
        runs_of.setdefault((run.system, run.dtype), []).append(run)
    # Batched systems compare with HF static batches, one-at-a-time ones with HF one at a time.
    hf = {(r.system, r.dtype): r.output_tok_s for r in results if r.system.startswith("hf-")}
    for r in results:
        key = ("hf-single" if r.system.endswith("single") else "hf-static", r.dtype)
        ratio = f"{r.output_tok_s / hf[key]:.2f}x" if key in hf else "-"
        table.add_row(r.system, r.dtype, str(r.num_prompts), f"{r.seconds:.1f}",
                      f"{r.output_tok_s:.1f}", f"{r.total_tok_s:.1f}", ratio,
                      f"{max(x.peak_rss_gib for x in runs_of[r.system, r.dtype]):.2f}")
    console.print(table)
    console.print("peak RSS: the process's, highest over that system's runs; each run holds only "
                  "its own model")
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "config": vars(args),
        "results": [asdict(r) | {"output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s}
                    for r in results],
        "runs": [asdict(r) | {"output_tok_s": r.output_tok_s} for r in all_runs],
        "peak_rss_gib": peak_rss_gib,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
