"""batchinfer behind Ray Serve against `batchinfer serve` alone, on the same machine.

    .venv/bin/python benchmarks/ray_serve.py                          # 3 layouts, 2 rounds
    .venv/bin/python benchmarks/ray_serve.py --num-prompts 32 --repeats 1

Layouts, each started as its own process (`batchinfer serve ...`), alternately `--repeats`
times:
- `serve`: one server, `--num-threads` = every core;
- `ray x1`: `serve --ray --num-replicas 1`, the replica holding every core: what the Ray hop
  (proxy -> ingress -> replica) costs;
- `ray xN`: `serve --ray --num-replicas N` (`--replicas`), the cores split between them.

Each runs the same `bench serve` burst (`--num-prompts` random prompts `--input-len`, outputs
`--output-len`, `--max-concurrency`, 2 warm-ups) after a discarded one of `--warmup-prompts`
(another seed): the first burst through a fresh Ray deployment ran ~20 % slower than the next
ones on the development machine (89.6 against 112.9 and 115.4 tok/s). Printed: output tok/s,
TTFT p50/p99 and the server-side running requests and sequences per step, read for the Ray layouts from Ray's
metrics export (`--metrics-url`: every replica's series, running summed over them). Medians
over the rounds; the CPU model with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from batchinfer.bench.config import BenchConfig
from batchinfer.bench.serve import bench_serve
from batchinfer.bench.sweep import SweepConfig, SweepServer, free_port, running_server
from batchinfer.core.cpu import cpu_model


def layouts(args: argparse.Namespace) -> list[tuple[str, tuple[str, ...], int | None]]:
    """(label, serve flags, Ray metrics export port or None)."""
    cores = args.cores or os.cpu_count() or 1
    common = ("--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs),
              "--shutdown-timeout", "5", *args.server_flags.split())
    out: list[tuple[str, tuple[str, ...], int | None]] = [
        ("serve", (*common, "--num-threads", str(cores)), None)]
    for replicas in (1, args.replicas):
        port = free_port()
        out.append((f"ray x{replicas}", (
            *common, "--ray", "--num-replicas", str(replicas), "--ray-cpus-per-replica",
            str(cores / replicas), "--ray-metrics-export-port", str(port)), port))
    return out


def one_run(args: argparse.Namespace, label: str, flags: tuple[str, ...],
            metrics_port: int | None, round_index: int) -> dict[str, Any]:
    result_dir = Path(args.result_dir)
    bench = BenchConfig(endpoint="completions", num_prompts=args.num_prompts,
                        input_len=args.input_len, output_len=args.output_len,
                        max_concurrency=args.max_concurrency, seed=args.seed, num_warmups=2,
                        result_dir=str(result_dir), plots=False, show_progress=False,
                        metrics_url=(f"http://127.0.0.1:{metrics_port}/metrics"
                                     if metrics_port else None),
                        result_name=f"{label.replace(' ', '-')}-{round_index}")
    server = SweepServer(label=label.replace(" ", "-"), batching="continuous", flags=flags)
    sweep = SweepConfig(bench=bench, result_dir=str(result_dir), batching=("continuous",),
                        server_start_timeout_s=600)
    log = result_dir / f"server-{label.replace(' ', '-')}-{round_index}.log"
    with running_server(server, sweep, log) as base_url:
        if args.warmup_prompts:
            bench_serve(dataclasses.replace(bench, base_url=base_url, seed=args.seed + 1000,
                                            num_prompts=args.warmup_prompts,
                                            result_dir=None))
        result = bench_serve(dataclasses.replace(bench, base_url=base_url))
    m = result.metrics
    server_mean = result.server.mean if result.server is not None else {}
    return {"output_tok_s": m.output_throughput, "ttft_p50_ms": m.ttft.p50_ms,
            "ttft_p99_ms": m.ttft.p99_ms, "completed": m.completed,
            "server_running": server_mean.get("running"),
            "server_batch_size": server_mean.get("batch_size")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="64:256")
    parser.add_argument("--output-len", default="32:96")
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--warmup-prompts", type=int, default=32,
                        help="a discarded burst of this many prompts first (0: none)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--cores", type=int, default=None,
                        help="cores to use (default: all of this machine)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-flags", default="", help="more flags for every layout")
    parser.add_argument("--result-dir", default=None)
    args = parser.parse_args()
    args.result_dir = args.result_dir or tempfile.mkdtemp(prefix="ray-serve-bench-")
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_index in range(args.repeats):
        for label, flags, port in layouts(args):
            print(f"round {round_index + 1}: {label}", flush=True)
            runs.setdefault(label, []).append(one_run(args, label, flags, port, round_index))
    print(f"\nCPU: {cpu_model()}, {args.cores or os.cpu_count()} cores; {args.num_prompts} "
          f"prompts {args.input_len} -> {args.output_len}, concurrency {args.max_concurrency}; "
          f"medians of {args.repeats}")
    print(f"{'layout':<10} {'out tok/s':>10} {'TTFT p50':>10} {'TTFT p99':>10} "
          f"{'running':>8} {'seqs/step':>10}")
    base = statistics.median(r["output_tok_s"] for r in runs["serve"])
    summary: dict[str, Any] = {}
    for label, rows in runs.items():
        med = {key: statistics.median([r[key] for r in rows if r[key] is not None] or [0.0])
               for key in rows[0]}
        summary[label] = {"median": med, "runs": rows}
        print(f"{label:<10} {med['output_tok_s']:>10.1f} {med['ttft_p50_ms']:>9.0f}ms "
              f"{med['ttft_p99_ms']:>9.0f}ms {med['server_running']:>8.1f} "
              f"{med['server_batch_size']:>10.1f}   {med['output_tok_s'] / base:.2f}x serve")
    path = Path(args.result_dir) / "ray_serve.json"
    path.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "layouts": summary},
                               indent=2))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
