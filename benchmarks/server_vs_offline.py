"""HTTP serving against offline `LLM.generate` on the same workload, measured in one run.

    .venv/bin/python benchmarks/server_vs_offline.py                    # 64 prompts, default model
    .venv/bin/python benchmarks/server_vs_offline.py --num-prompts 32 --input-len 32:128 \
        --output-len 32:128 --repeats 2        # smaller, alternated twice (a shared machine)

The workload is the offline benchmark's (`offline_throughput.make_workload`: token-id prompts of
`--input-len` tokens, `--output-len` output tokens, `ignore_eos`, greedy, fixed seed). First
`LLM.generate` runs it in this process; then a `batchinfer serve` subprocess serves it to
`--concurrency` streaming clients over loopback (a minimal client: raw SSE, one timestamp per
read). Throughput is useful output tokens per second of wall time; the target is HTTP >= 85 % of
offline. `--concurrency` clients can keep at most that many requests in flight, so the server's
batch is capped there while `LLM.generate` batches up to `max_num_seqs`; `LLM.generate` with
`max_num_seqs = --concurrency` also runs (`--no-capped-offline` skips it) to separate the cost of
serving from the cost of the smaller batch. TTFT and ITL (gaps between content chunks of a
request) are reported as p50 / p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batchinfer import LLM, SamplingParams  # noqa: E402

HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
from offline_throughput import make_workload, parse_range  # noqa: E402


def run_offline(args, workload, **engine_knobs) -> dict:
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, **engine_knobs)
    prompts = [p for p, _ in workload]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    cpu_s = time.process_time()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_s
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm, outputs
    gc.collect()
    return {"seconds": seconds, "output_tokens": num_output, "output_tok_s": num_output / seconds,
            "cpu_s": cpu_s}


@dataclass(slots=True)
class Timed:
    """One streamed request: when it was sent, when each content chunk arrived, its usage."""

    start_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None


async def send_request(client: httpx.AsyncClient, url: str, body: bytes) -> Timed:
    """POST a streamed request; time every SSE chunk that carries text (raw bytes, no JSON
    parsing except for the usage chunk, so the client stays cheap)."""
    result = Timed(time.perf_counter())
    async with client.stream("POST", url, content=body, headers=HEADERS) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        pending = b""
        async for data in response.aiter_raw():
            now = time.perf_counter()
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                if b'"usage":{' in line:
                    result.num_output_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                elif b'"text":""' not in line:
                    result.chunk_times_s.append(now)
                if line.startswith(b'data: {"error"'):
                    result.error = line[6:200].decode(errors="replace")
    if not result.chunk_times_s and result.error is None:
        result.error = "no content"
    return result


def start_server(args, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "batchinfer.cli.main", "serve", "--model", args.model,
               "--port", str(port), "--dtype", args.dtype, "--kv-cache-memory",
               args.kv_cache_memory, "--log-level", "warning", *args.server_args.split()]
    return subprocess.Popen(command)


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health").status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit("the server did not become healthy")


async def run_clients(base_url: str, workload, concurrency: int,
                      on_start=lambda: None) -> tuple[float, list]:
    url = f"{base_url}/v1/completions"
    bodies = [json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                          "temperature": 0, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode()
              for prompt, max_tokens in workload]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(send_request(client, url, b) for b in bodies[:2]))  # warm-up
        semaphore = asyncio.Semaphore(concurrency)

        async def one(body: bytes) -> Timed:
            async with semaphore:
                return await send_request(client, url, body)

        on_start()
        start = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - start, results


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    values = sorted(values)
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50_ms": 1000 * statistics.median(values), "p99_ms": 1000 * q[98]}


def run_server(args, workload, port: int) -> dict:
    base_url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    try:
        wait_healthy(base_url, proc)
        cpu_at_start: list[float] = []

        def on_start() -> None:  # after the warm-up
            cpu_at_start[:] = [process_cpu_s(proc.pid), time.process_time()]

        seconds, results = asyncio.run(run_clients(base_url, workload, args.concurrency,
                                                   on_start))
        cpu_s = process_cpu_s(proc.pid) - cpu_at_start[0]
        client_cpu_s = time.process_time() - cpu_at_start[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    failed = [r for r in results if r.error is not None]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    num_output = sum(r.num_output_tokens for r in results)
    ttfts = [r.chunk_times_s[0] - r.start_s for r in results]
    itls = [b - a for r in results
            for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:], strict=False)]
    return {"seconds": seconds, "output_tokens": num_output, "output_tok_s": num_output / seconds,
            "ttft": percentiles(ttfts), "itl": percentiles(itls), "cpu_s": cpu_s,
            "client_cpu_s": client_cpu_s, "ttfts_s": ttfts, "itls_s": itls}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux `/proc`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pooled_tok_s(runs: list[dict]) -> float:
    """Output tokens over seconds of all runs together (alternated runs share the noise)."""
    return sum(r["output_tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="2G")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="32:512")
    parser.add_argument("--output-len", default="32:256")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=49152,
                        help="prompt token ids are drawn below this (default: SmolLM2's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--server-args", default="", help="extra flags for batchinfer serve")
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate offline and server runs this many times and pool them "
                        "(the machine is shared: alternation spreads its noise over both)")
    parser.add_argument("--capped-offline", action=argparse.BooleanOptionalAction, default=True,
                        help="also run LLM.generate with max_num_seqs = --concurrency: the "
                        "offline speed at the batch the clients allow (default: on)")
    parser.add_argument("--json", default="results/server_vs_offline.json")
    args = parser.parse_args(argv)
    # A SIGTERM (e.g. from `timeout`) unwinds normally, so the server subprocess is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    workload = make_workload(args.num_prompts, parse_range(args.input_len),
                             parse_range(args.output_len), args.vocab_size, args.seed)
    offline_runs, capped_runs, server_runs = [], [], []
    for _ in range(args.repeats):
        offline_runs.append(run_offline(args, workload))
        print(f"offline  {offline_runs[-1]['output_tok_s']:8.1f} out tok/s "
              f"({offline_runs[-1]['seconds']:.1f} s, {offline_runs[-1]['cpu_s']:.1f} CPU s)",
              flush=True)
        if args.capped_offline:
            capped_runs.append(run_offline(args, workload, max_num_seqs=args.concurrency))
            print(f"offline, max_num_seqs={args.concurrency}  "
                  f"{capped_runs[-1]['output_tok_s']:8.1f} out tok/s "
                  f"({capped_runs[-1]['seconds']:.1f} s, {capped_runs[-1]['cpu_s']:.1f} CPU s)",
                  flush=True)
        server_runs.append(run_server(args, workload, args.port))
        server = server_runs[-1]
        print(f"server   {server['output_tok_s']:8.1f} out tok/s ({server['seconds']:.1f} s, "
              f"{args.concurrency} streaming clients; server {server['cpu_s']:.1f} CPU s, "
              f"client {server['client_cpu_s']:.1f} CPU s)", flush=True)
    offline_tok_s, server_tok_s = pooled_tok_s(offline_runs), pooled_tok_s(server_runs)
    ratio = server_tok_s / offline_tok_s
    ttft = percentiles([t for r in server_runs for t in r["ttfts_s"]])
    itl = percentiles([t for r in server_runs for t in r["itls_s"]])
    print(f"all runs: offline {offline_tok_s:.1f}, server {server_tok_s:.1f} out tok/s "
          f"= {100 * ratio:.1f} % of offline")
    capped_tok_s = pooled_tok_s(capped_runs) if capped_runs else None
    if capped_tok_s:
        print(f"offline with at most {args.concurrency} sequences in flight (as many as the "
              f"clients): {capped_tok_s:.1f} out tok/s; server = "
              f"{100 * server_tok_s / capped_tok_s:.1f} % of it")
    print(f"TTFT p50 {ttft['p50_ms']:.0f} ms, p99 {ttft['p99_ms']:.0f} ms; "
          f"ITL p50 {itl['p50_ms']:.1f} ms, p99 {itl['p99_ms']:.1f} ms")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "config": vars(args), "offline_runs": offline_runs, "server_runs": server_runs,
        "offline_tok_s": offline_tok_s, "server_tok_s": server_tok_s, "ratio": ratio,
        "capped_offline_runs": capped_runs, "capped_offline_tok_s": capped_tok_s,
        "ttft": ttft, "itl": itl,
        "cpu_count": os.cpu_count(),
    }, indent=2))
    return 0 if ratio >= 0.85 else 1


if __name__ == "__main__":
    sys.exit(main())
