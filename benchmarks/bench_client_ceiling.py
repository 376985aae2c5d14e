"""How many streamed requests per second can the bench client itself sustain?

Starts the fake OpenAI-compatible server (`tests/fake_openai_server.py`, zero delays: each
response is written at once) in a subprocess on a free port, then runs the bench client against
it with all requests released at once and a fixed number in flight, and prints requests/s and
chunks/s. The client must not be the bottleneck of a benchmark: the target is >= 200 req/s with
100 output tokens (100 SSE chunks) each on a 2-core machine, server included.

    .venv/bin/python benchmarks/bench_client_ceiling.py [--num-prompts 2000] [--max-concurrency 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx

from batchinfer.bench.config import BenchConfig
from batchinfer.bench.loadgen import run_benchmark
from batchinfer.bench.serve import run_async
from batchinfer.bench.sweep import free_port, stop_process

FAKE_SERVER = Path(__file__).resolve().parents[1] / "tests" / "fake_openai_server.py"


def wait_healthy(base_url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("fake server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=100)
    parser.add_argument("--endpoint", default="completions", choices=("completions", "chat"))
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, str(FAKE_SERVER), "--port", str(port)],
                              stdout=subprocess.DEVNULL)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url)
        config = BenchConfig(base_url=base_url, num_prompts=args.num_prompts,
                             input_len="32", output_len=str(args.output_len),
                             endpoint=args.endpoint, max_concurrency=args.max_concurrency,
                             num_warmups=args.max_concurrency, show_progress=False, plots=False)
        cpu_start_s = time.process_time()
        result = run_async(run_benchmark(config))
        cpu_s = time.process_time() - cpu_start_s
    finally:
        stop_process(server, timeout_s=10)
    m = result.metrics
    chunks = sum(len(r.chunk_times_s) for r in result.results)
    # Client CPU per request (warm-ups included) does not depend on what else the machine runs.
    cpu_ms = 1000 * cpu_s / (args.num_prompts + config.num_warmups + 1)
    print(f"{m.completed} requests ({m.failed} failed) x {args.output_len} tokens, "
          f"concurrency {args.max_concurrency}, {args.endpoint}: "
          f"{m.request_throughput:.0f} req/s, {chunks / m.duration_s:.0f} chunks/s, "
          f"{m.duration_s:.2f} s; client CPU {cpu_ms:.2f} ms/request "
          f"(= {1000 / cpu_ms:.0f} req/s on one free core)")


if __name__ == "__main__":
    main()
