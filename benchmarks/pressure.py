"""Scheduling under pressure: `--scheduling-policy fcfs` against `--preset interactive`, side by
side on the same mixed load.

    .venv/bin/python benchmarks/pressure.py                      # defaults below, 1 round
    .venv/bin/python benchmarks/pressure.py --repeats 2 --num-prompts 60 --request-rate 0.5

Each configuration is a `batchinfer serve` subprocess with a small KV cache
(`--kv-cache-memory`, so the load runs under pressure), measured by `batchinfer bench serve`
with `--mix interactive:0.8,batch:0.2`:
- interactive: short chats (prompt `--interactive-input-len`, default 32:128; output
  `--interactive-output-len`, default 16:64) arriving at a Poisson `--request-rate`;
- batch: long background requests (prompt 1000:2000, output 256:512 by default) that all
  arrive at t=0, a burst.
With `--repeats N` the configurations alternate (fcfs, interactive, fcfs, ...) so machine drift
hits both alike; medians over the rounds are reported.

Targets (docs/scheduling.md): interactive TTFT p99 at least 5x lower with the preset than with
fcfs, total output throughput at least 85 % of fcfs, every background request finished (none
starved or failed), and the preemption rate of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from batchinfer.bench.config import BenchConfig
from batchinfer.bench.serve import bench_serve
from batchinfer.bench.sweep import SweepConfig, SweepServer, running_server
from batchinfer.core.cpu import cpu_model

CONFIGS = {
    "fcfs": ("--scheduling-policy", "fcfs"),
    "interactive": ("--preset", "interactive"),
}


def run_one(args: argparse.Namespace, name: str, round_index: int) -> dict[str, Any]:
    result_dir = Path(args.result_dir)
    bench = BenchConfig(
        endpoint="completions", num_prompts=args.num_prompts, request_rate=args.request_rate,
        seed=args.seed, mix={"interactive": 0.8, "batch": 0.2},
        input_len=args.interactive_input_len, output_len=args.interactive_output_len,
        class_input_len={"batch": args.batch_input_len},
        class_output_len={"batch": args.batch_output_len},
        mix_arrival={"batch": "burst"}, request_timeout_s=args.request_timeout_s,
        result_dir=str(result_dir), result_name=f"{name}-round{round_index}", plots=False,
        show_progress=False, num_warmups=args.num_warmups,
    )
    flags = (*CONFIGS[name], "--kv-cache-memory", args.kv_cache_memory,
             "--model", args.model, *args.server_args.split())
    server = SweepServer(label=name, batching="continuous", flags=flags)
    sweep = SweepConfig(bench=bench, result_dir=str(result_dir), batching=("continuous",))
    log_path = result_dir / f"{name}-round{round_index}.server.log"
    with running_server(server, sweep, log_path) as base_url:
        result = bench_serve(dataclasses.replace(bench, base_url=base_url))
    match = re.search(r"KV cache: (\d+) blocks of (\d+) tokens \((\d+) tokens",
                      log_path.read_text(errors="replace"))
    server_view = result.server
    classes = result.class_metrics
    inter, batch = classes.get("interactive"), classes.get("batch")
    return {
        "config": name,
        "round": round_index,
        "kv_tokens": int(match.group(3)) if match else None,
        "duration_s": result.metrics.duration_s,
        "output_tok_s": result.metrics.output_throughput,
        "interactive_ttft_p50_ms": inter.ttft.p50_ms if inter and inter.ttft else None,
        "interactive_ttft_p99_ms": inter.ttft.p99_ms if inter and inter.ttft else None,
        "interactive_tpot_p99_ms": inter.tpot.p99_ms if inter and inter.tpot else None,
        "interactive_done": inter.completed if inter else 0,
        "interactive_failed": inter.failed if inter else 0,
        "batch_done": batch.completed if batch else 0,
        "batch_failed": batch.failed if batch else 0,
        "batch_e2el_p99_s": batch.e2el.p99_ms / 1000 if batch and batch.e2el else None,
        "preemptions": server_view.deltas.get("preemptions") if server_view else None,
        "preemption_rate_mean": server_view.mean.get("preemption_rate") if server_view else None,
        "preemption_rate_max": server_view.max.get("preemption_rate") if server_view else None,
    }


def run_rounds(args: argparse.Namespace, names: list[str], run_one: Any) -> list[dict[str, Any]]:
    """`run_one(args, name, round)` for every name, `args.repeats` rounds alternating (machine
    drift hits every configuration alike); each row printed as it comes."""
    rows = []
    for round_index in range(args.repeats):
        for name in names:
            row = run_one(args, name, round_index)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--kv-cache-memory", default="320M",
                        help="KV cache of each server: small, so the load runs under pressure "
                        "(320M of float32 KV: 7,200 tokens of the default model)")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--request-rate", type=float, default=0.5,
                        help="Poisson rate of the interactive requests (req/s)")
    parser.add_argument("--interactive-input-len", default="32:128")
    parser.add_argument("--interactive-output-len", default="16:64")
    parser.add_argument("--batch-input-len", default="1000:2000")
    parser.add_argument("--batch-output-len", default="256:512")
    parser.add_argument("--num-warmups", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=1800.0)
    parser.add_argument("--server-args", default="--dtype float32",
                        help="more flags for both servers (default float32: the same KV size "
                        "on every CPU)")
    parser.add_argument("--result-dir", default="results/pressure")
    args = parser.parse_args()

    rows = run_rounds(args, list(CONFIGS), run_one)

    def med(name: str, key: str) -> float | None:
        return median([r for r in rows if r["config"] == name], key)

    print(f"\nCPU: {cpu_model()}; {args.repeats} round(s), medians")
    keys = ["kv_tokens", "output_tok_s", "interactive_ttft_p50_ms", "interactive_ttft_p99_ms",
            "interactive_tpot_p99_ms", "interactive_done", "interactive_failed", "batch_done",
            "batch_failed", "batch_e2el_p99_s", "preemptions", "preemption_rate_mean",
            "preemption_rate_max"]
    print(f"{'':28}" + "".join(f"{n:>14}" for n in CONFIGS))
    for key in keys:
        cells = [med(n, key) for n in CONFIGS]
        print(f"{key:28}" + "".join(f"{'n/a' if c is None else f'{c:.1f}':>14}" for c in cells))
    ttft_fcfs, ttft_preset = med("fcfs", "interactive_ttft_p99_ms"), med(
        "interactive", "interactive_ttft_p99_ms")
    tput_fcfs, tput_preset = med("fcfs", "output_tok_s"), med("interactive", "output_tok_s")
    ratio_ttft = ttft_fcfs / ttft_preset if ttft_fcfs and ttft_preset else None
    ratio_tput = tput_preset / tput_fcfs if tput_fcfs and tput_preset else None
    starved = sum(r["batch_failed"] for r in rows if r["config"] == "interactive")
    num_batch = [r["batch_done"] + r["batch_failed"] for r in rows]
    print(f"\ninteractive TTFT p99, fcfs / preset: {ratio_ttft and f'{ratio_ttft:.1f}x'} "
          "(target >= 5x)")
    print(f"output throughput, preset / fcfs: {ratio_tput and f'{ratio_tput:.0%}'} "
          "(target >= 85 %)")
    print(f"background requests not finished under the preset: {starved} of "
          f"{sum(num_batch) // len(num_batch) if num_batch else 0} per round (target 0)")
    summary = {"cpu": cpu_model(), "args": vars(args), "rows": rows,
               "ttft_p99_ratio": ratio_ttft, "throughput_ratio": ratio_tput}
    out = Path(args.result_dir) / "pressure.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"written: {out}")
    ok = (ratio_ttft or 0) >= 5 and (ratio_tput or 0) >= 0.85 and starved == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
