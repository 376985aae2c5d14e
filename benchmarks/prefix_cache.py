"""Prefix caching on against off, side by side: many requests sharing one long system prompt.

    .venv/bin/python benchmarks/prefix_cache.py                 # 64 requests, 1,000-token prefix
    .venv/bin/python benchmarks/prefix_cache.py --repeats 2 --request-rate 4

Each configuration is a `batchinfer serve` subprocess (`--enable-prefix-caching` or
`--no-enable-prefix-caching`, the rest identical), measured by `batchinfer bench serve
--dataset shared-prefix --shared-prefix-len 1000 --num-prefixes 1`: every prompt is the same
1,000-token prefix plus its own `--input-len` tokens, `--output-len` tokens out. With
`--repeats N` the two alternate (on, off, on, ...) and medians are reported.

Targets (docs/architecture.md): TTFT p50 at least 3x lower and output throughput higher with
caching than without.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from batchinfer.bench.config import BenchConfig
from batchinfer.bench.serve import bench_serve
from batchinfer.bench.sweep import SweepConfig, SweepServer, running_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pressure import cpu_model, run_rounds  # noqa: E402

CONFIGS = {"on": ("--enable-prefix-caching",), "off": ("--no-enable-prefix-caching",)}


def run_one(args: argparse.Namespace, name: str, round_index: int) -> dict[str, Any]:
    result_dir = Path(args.result_dir)
    bench = BenchConfig(
        endpoint="completions", dataset="shared-prefix", num_prompts=args.num_prompts,
        shared_prefix_len=args.prefix_len, num_prefixes=1, input_len=args.input_len,
        output_len=args.output_len, request_rate=args.request_rate, seed=args.seed,
        result_dir=str(result_dir), result_name=f"{name}-round{round_index}", plots=False,
        show_progress=False, num_warmups=args.num_warmups,
    )
    flags = (*CONFIGS[name], "--model", args.model, *args.server_args.split())
    server = SweepServer(label=name, batching="continuous", flags=flags)
    sweep = SweepConfig(bench=bench, result_dir=str(result_dir), batching=("continuous",))
    log_path = result_dir / f"{name}-round{round_index}.server.log"
    with running_server(server, sweep, log_path) as base_url:
        result = bench_serve(dataclasses.replace(bench, base_url=base_url))
    m = result.metrics
    deltas = result.server.deltas if result.server else {}
    queries = deltas.get("prefix_cache_queries") or 0.0
    return {
        "config": name, "round": round_index, "completed": m.completed, "failed": m.failed,
        "duration_s": m.duration_s, "output_tok_s": m.output_throughput,
        "ttft_p50_ms": m.ttft.p50_ms if m.ttft else None,
        "ttft_p99_ms": m.ttft.p99_ms if m.ttft else None,
        "tpot_p50_ms": m.tpot.p50_ms if m.tpot else None,
        "hit_rate": deltas.get("prefix_cache_hits", 0.0) / queries if queries else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--input-len", default="16:64", help="tokens after the shared prefix")
    parser.add_argument("--output-len", default="32")
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--num-warmups", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="--dtype float32",
                        help="more flags for both servers")
    parser.add_argument("--result-dir", default="results/prefix-cache")
    args = parser.parse_args()

    rows = run_rounds(args, list(CONFIGS), run_one)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["config"] == name)

    print(f"\nCPU: {cpu_model()}; {args.repeats} round(s), medians")
    print(f"{'':16}{'on':>12}{'off':>12}")
    for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "hit_rate",
                "duration_s"):
        print(f"{key:16}{med('on', key):>12.2f}{med('off', key):>12.2f}")
    ttft_ratio = med("off", "ttft_p50_ms") / med("on", "ttft_p50_ms")
    tput_ratio = med("on", "output_tok_s") / med("off", "output_tok_s")
    print(f"\nTTFT p50 off / on: {ttft_ratio:.1f}x (target >= 3x); "
          f"throughput on / off: {tput_ratio:.2f}x (target > 1)")
    out = Path(args.result_dir) / "prefix_cache.json"
    out.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args), "rows": rows,
                               "ttft_p50_ratio": ttft_ratio, "throughput_ratio": tput_ratio},
                              indent=2))
    print(f"written: {out}")
    return 0 if ttft_ratio >= 3 and tput_ratio > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
