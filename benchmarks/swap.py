"""Preemption modes side by side: `--preemption-mode recompute`, `swap` and `auto` on a load that
forces preemption.

    .venv/bin/python benchmarks/swap.py                  # defaults below, 1 round
    .venv/bin/python benchmarks/swap.py --repeats 2

Each configuration is a `batchinfer serve` subprocess with a small KV cache (`--kv-cache-memory`,
default 80M of float32 KV: about 1,800 tokens of the default model) and the same burst of
`--num-prompts` requests with short prompts and long outputs (prompt `--input-len`, output
`--output-len`), all at t=0, measured by `batchinfer bench serve`: many are admitted on their
prompts' size, then grow while they decode and preempt each other. With
`--repeats N` the configurations alternate, so machine drift hits all alike; medians are
reported.

Time lost to preemption, per configuration: the swap copies' time (the server's
`batchinfer_swap_time_seconds`) plus the tokens preemption dropped
(`batchinfer_recomputed_tokens`) times the prefill time per token that `auto` measures at
start-up (read from its log; the same machine and model serve all three).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from batchinfer.bench.config import BenchConfig
from batchinfer.bench.serve import bench_serve
from batchinfer.bench.sweep import SweepConfig, SweepServer, running_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pressure import cpu_model, median, run_rounds  # noqa: E402

CONFIGS = ("recompute", "swap", "auto")
COSTS_LINE = re.compile(r"preemption costs measured: recompute ([\d.]+) ms/token, swap "
                        r"([\d.]+) ms/block")


def server_counters(base_url: str) -> dict[str, float]:
    """The preemption counters by mode, and the swap and recompute totals, from /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if name == "batchinfer_num_preemptions_total":
                key = f"preemptions_{labels['mode']}"
                out[key] = out.get(key, 0.0) + sample.value
            elif name == "batchinfer_swapped_blocks_total":
                out[f"swapped_{labels['direction']}_blocks"] = sample.value
            elif name in ("batchinfer_swap_time_seconds_total",
                          "batchinfer_recomputed_tokens_total"):
                out[name.removeprefix("batchinfer_").removesuffix("_total")] = sample.value
    return out


def run_one(args: argparse.Namespace, name: str, round_index: int) -> dict[str, Any]:
    result_dir = Path(args.result_dir)
    bench = BenchConfig(
        endpoint="completions", num_prompts=args.num_prompts, request_rate=float("inf"),
        seed=args.seed, input_len=args.input_len, output_len=args.output_len,
        request_timeout_s=args.request_timeout_s, result_dir=str(result_dir),
        result_name=f"{name}-round{round_index}", plots=False, show_progress=False,
        num_warmups=args.num_warmups,
    )
    flags = ("--preemption-mode", name, "--kv-cache-memory", args.kv_cache_memory,
             "--model", args.model, *args.server_args.split())
    server = SweepServer(label=name, batching="continuous", flags=flags)
    sweep = SweepConfig(bench=bench, result_dir=str(result_dir), batching=("continuous",))
    log_path = result_dir / f"{name}-round{round_index}.server.log"
    with running_server(server, sweep, log_path) as base_url:
        before = server_counters(base_url)
        result = bench_serve(dataclasses.replace(bench, base_url=base_url))
        after = server_counters(base_url)
    counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    costs = COSTS_LINE.search(log_path.read_text(errors="replace"))
    m = result.metrics
    return {
        "config": name,
        "round": round_index,
        "duration_s": m.duration_s,
        "completed": m.completed,
        "failed": m.failed,
        "output_tok_s": m.output_throughput,
        "ttft_p99_s": m.ttft.p99_ms / 1000 if m.ttft else None,
        "e2el_p50_s": m.e2el.p50_ms / 1000 if m.e2el else None,
        "e2el_p99_s": m.e2el.p99_ms / 1000 if m.e2el else None,
        "preemptions_recompute": counters.get("preemptions_recompute", 0.0),
        "preemptions_swap": counters.get("preemptions_swap", 0.0),
        "recomputed_tokens": counters.get("recomputed_tokens", 0.0),
        "swapped_out_blocks": counters.get("swapped_out_blocks", 0.0),
        "swap_time_s": counters.get("swap_time_seconds", 0.0),
        "prefill_ms_per_token": float(costs.group(1)) if costs else None,
        "swap_ms_per_block": float(costs.group(2)) if costs else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--kv-cache-memory", default="80M",
                        help="KV cache of each server: small, so the burst preempts")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", default="64:192")
    parser.add_argument("--output-len", default="256:384")
    parser.add_argument("--num-warmups", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=1800.0)
    parser.add_argument("--server-args", default="--dtype float32",
                        help="more flags for every server (default float32: the same KV size on "
                        "every CPU)")
    parser.add_argument("--result-dir", default="results/swap")
    args = parser.parse_args()

    rows = run_rounds(args, list(CONFIGS), run_one)
    prefill_ms = median([r for r in rows if r["config"] == "auto"], "prefill_ms_per_token")
    for row in rows:
        recompute_s = row["recomputed_tokens"] * (prefill_ms or 0.0) / 1000
        row["time_lost_s"] = recompute_s + row["swap_time_s"]

    def med(name: str, key: str) -> float | None:
        return median([r for r in rows if r["config"] == name], key)

    print(f"\nCPU: {cpu_model()}; {args.repeats} round(s), medians; prefill measured by auto: "
          f"{prefill_ms} ms/token, swap {med('auto', 'swap_ms_per_block')} ms/block out+in")
    keys = ["output_tok_s", "duration_s", "completed", "failed", "ttft_p99_s", "e2el_p50_s",
            "e2el_p99_s", "preemptions_recompute", "preemptions_swap", "recomputed_tokens",
            "swapped_out_blocks", "swap_time_s", "time_lost_s"]
    print(f"{'':24}" + "".join(f"{n:>14}" for n in CONFIGS))
    for key in keys:
        cells = [med(n, key) for n in CONFIGS]
        print(f"{key:24}" + "".join(f"{'n/a' if c is None else f'{c:.2f}':>14}" for c in cells))
    summary = {"cpu": cpu_model(), "args": vars(args), "rows": rows}
    out = Path(args.result_dir) / "swap.json"
    out.write_text(json.dumps(summary, indent=2))
    print(f"written: {out}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
