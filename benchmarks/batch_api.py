"""The Batch API against the engine's own offline path, and its effect on interactive traffic.

    .venv/bin/python benchmarks/batch_api.py                     # both parts, 2,000 lines
    .venv/bin/python benchmarks/batch_api.py --part offline --num-lines 500

offline: `--num-lines` chat lines (questions cut from this repository's docs, `--max-tokens`
greedy tokens each, `ignore_eos` so both sides generate the same number) answered by
`run_batch_file` (what `batchinfer run-batch` runs: every line through the server's handlers
in this process) and by `LLM.generate` on the same messages (what `batchinfer generate
--input` runs), each in its own process, alternately `--repeats` times; output tokens per
second after the model loaded, medians. Target: run-batch within 5 % of generate.

interactive: `batchinfer serve` with `bench serve` at a fixed `--rate` (Poisson, prompts
`--input-len`, outputs `--output-len`), alone and then while a `--num-lines` batch runs on the
same server (the batch's lines are in the background class); interactive TTFT p50 / p99 and
the batch lines finished meanwhile. Target: TTFT p99 with the batch within 1.5x of alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from batchinfer import LLM, SamplingParams
from batchinfer.bench.config import BenchConfig
from batchinfer.bench.serve import bench_serve
from batchinfer.bench.sweep import SweepConfig, SweepServer, running_server
from batchinfer.core.config import EngineConfig
from batchinfer.core.cpu import cpu_model
from batchinfer.server.offline import run_batch_file

ROOT = Path(__file__).resolve().parent.parent


def questions(n: int, seed: int) -> list[str]:
    """Sentences of the docs, turned into requests of varied length."""
    text = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if 40 < len(s) < 400]
    rng = random.Random(seed)
    return [f"Explain this in simple words: {rng.choice(sentences)}" for _ in range(n)]


def batch_lines(prompts: list[str], max_tokens: int) -> list[str]:
    return [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "default", "max_tokens": max_tokens,
                                 "temperature": 0, "ignore_eos": True,
                                 "messages": [{"role": "user", "content": p}]}})
            for i, p in enumerate(prompts)]


def one_side(args: argparse.Namespace, engine: dict[str, Any]) -> float:
    """Output tokens per second after the model loaded, of `args.side` alone in this process."""
    prompts = questions(args.num_lines, args.seed)
    if args.side == "generate":
        llm = LLM("default", **engine)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - start)
    work = Path(tempfile.mkdtemp(prefix="batch-api-"))
    source = work / "in.jsonl"
    source.write_text("\n".join(batch_lines(prompts, args.max_tokens)) + "\n")
    result = asyncio.run(run_batch_file(source, work / "out.jsonl", EngineConfig.from_kwargs(
        model="default", **engine), max_in_flight=args.max_in_flight, progress=False))
    assert result.counts.completed == args.num_lines, result.counts
    return result.counts.output_tokens / result.elapsed_s


def offline(args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    """Each side in its own process, alternately: two engines in one process slow each other
    (each Python thread that ran torch keeps its own OpenMP team)."""
    runs: dict[str, list[float]] = {"generate": [], "run-batch": []}
    for r in range(args.repeats):
        for side in runs:
            command = [sys.executable, __file__, "--side", side, *sys.argv[1:]]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs[side].append(float(out.strip().splitlines()[-1]))
        print(f"  repeat {r + 1}: generate {runs['generate'][-1]:.1f} tok/s, run-batch "
              f"{runs['run-batch'][-1]:.1f} tok/s", flush=True)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    return {"runs": runs, "median_tok_s": medians,
            "ratio": medians["run-batch"] / medians["generate"]}


def interactive(args: argparse.Namespace) -> dict[str, Any]:
    result_dir = Path(args.result_dir)
    bench = BenchConfig(endpoint="completions", num_prompts=args.num_requests,
                        request_rate=args.rate, input_len=args.input_len,
                        output_len=args.output_len, seed=args.seed, num_warmups=2,
                        result_dir=str(result_dir), plots=False, show_progress=False)
    flags = ("--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs),
             "--batch-dir", tempfile.mkdtemp(prefix="batch-api-dir-"), *args.server_flags.split())
    server = SweepServer(label="batch-api", batching="continuous", flags=flags)
    sweep = SweepConfig(bench=bench, result_dir=str(result_dir), batching=("continuous",))
    out: dict[str, Any] = {}
    with running_server(server, sweep, result_dir / "server.log") as base_url:
        alone = bench_serve(dataclasses.replace(bench, base_url=base_url, result_name="alone"))
        out["alone"] = _ttft(alone)
        print(f"  alone: {out['alone']}", flush=True)
        lines = batch_lines(questions(args.num_lines, args.seed + 1), args.max_tokens)
        api = httpx.Client(base_url=f"{base_url}/v1", timeout=60)
        upload = api.post("/files", data={"purpose": "batch"},
                          files={"file": ("in.jsonl", ("\n".join(lines) + "\n").encode())})
        upload.raise_for_status()
        created = api.post("/batches", json={"input_file_id": upload.json()["id"],
                                             "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"})
        created.raise_for_status()
        batch = created.json()
        deadline = time.monotonic() + 300
        while api.get(f"/batches/{batch['id']}").json()["request_counts"]["completed"] < 1:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.5)
        before = api.get(f"/batches/{batch['id']}").json()["request_counts"]["completed"]
        start = time.perf_counter()
        loaded = bench_serve(dataclasses.replace(bench, base_url=base_url,
                                                 result_name="with-batch"))
        elapsed = time.perf_counter() - start
        after = api.get(f"/batches/{batch['id']}").json()
        out["with_batch"] = _ttft(loaded)
        out["batch_lines_per_s_meanwhile"] = \
            (after["request_counts"]["completed"] - before) / elapsed
        out["batch_status"] = after["status"]
        print(f"  with batch: {out['with_batch']}; batch lines/s meanwhile "
              f"{out['batch_lines_per_s_meanwhile']:.2f}", flush=True)
        api.post(f"/batches/{batch['id']}/cancel")
    out["ttft_p99_ratio"] = out["with_batch"]["ttft_p99_ms"] / out["alone"]["ttft_p99_ms"]
    return out


def _ttft(result: Any) -> dict[str, float]:
    m = result.metrics
    return {"ttft_p50_ms": m.ttft.p50_ms, "ttft_p99_ms": m.ttft.p99_ms,
            "output_tok_s": m.output_throughput, "completed": m.completed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("offline", "interactive", "both"), default="both")
    parser.add_argument("--num-lines", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-in-flight", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rate", type=float, default=1.0, help="interactive requests/s")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--input-len", default="64:256")
    parser.add_argument("--output-len", default="32:64")
    parser.add_argument("--server-flags", default="--scheduling-policy priority",
                        help="more `batchinfer serve` flags for the interactive part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", default="results/batch_api")
    parser.add_argument("--side", choices=("generate", "run-batch"), default=None,
                        help=argparse.SUPPRESS)  # one side of the offline part (a subprocess)
    args = parser.parse_args()
    engine = {"dtype": "float32", "max_num_seqs": args.max_num_seqs,
              "enable_prefix_caching": False}
    if args.side is not None:
        print(one_side(args, engine))
        return
    summary: dict[str, Any] = {"cpu": cpu_model(), "args": vars(args)}
    if args.part in ("offline", "both"):
        summary["offline"] = offline(args, engine)
        o = summary["offline"]
        print(f"offline, {args.num_lines} chat lines x {args.max_tokens} tokens: generate "
              f"{o['median_tok_s']['generate']:.1f} tok/s, run-batch "
              f"{o['median_tok_s']['run-batch']:.1f} tok/s: {o['ratio']:.3f}x", flush=True)
    if args.part in ("interactive", "both"):
        summary["interactive"] = i = interactive(args)
        print(f"interactive TTFT p99 at {args.rate} req/s: alone "
              f"{i['alone']['ttft_p99_ms']:.0f} ms, with a batch running "
              f"{i['with_batch']['ttft_p99_ms']:.0f} ms: {i['ttft_p99_ratio']:.2f}x")
    print(f"CPU: {summary['cpu']}")
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.result_dir) / "batch_api.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.exit(main())
