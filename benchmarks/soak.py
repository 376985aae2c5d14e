"""Soak: many mixed requests, some abandoned by their clients, then check that nothing leaked.

    .venv/bin/python benchmarks/soak.py --num-requests 2000 --concurrency 32 --abort-share 0.2

Starts `batchinfer serve` (the default model plus the embedded encoder) on a free loopback port
and sends `--num-requests` requests, `--concurrency` at a time: completions, chat completions and
embeddings, streamed and not, with short random prompts and outputs. A share of the clients
leave early (a streamed one after its first chunk, a non-streamed one after a random delay).
Afterwards it prints what was sent, completed, aborted by the client and errored; the server's
finish counters; KV usage, running and waiting requests, and the encoder's queue (all must be
back to 0); and the server's RSS after warm-up and after the run. Exit status 1 if anything
did not return to 0 or an unexpected error came back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

WORDS = ["batching", "many", "requests", "at", "once", "keeps", "the", "hardware", "busy",
         "while", "each", "request", "stays", "within", "its", "latency", "budget", "scheduler",
         "admits", "waiting", "work", "every", "step"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metrics(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def make_request(rng: random.Random) -> tuple[str, dict, bool]:
    """(path, body, streamed) of one random request."""
    kind = rng.choice(("completion", "chat", "embeddings"))
    if kind == "embeddings":
        return "/v1/embeddings", {"input": [text(rng, 3, 40) for _ in range(rng.randint(1, 8))]}, False
    stream = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(4, 32), "temperature": rng.choice((0.0, 0.8)),
                  "stream": stream}
    if kind == "chat":
        return "/v1/chat/completions", body | {
            "messages": [{"role": "user", "content": text(rng, 4, 60)}]}, stream
    return "/v1/completions", body | {"prompt": text(rng, 4, 120)}, stream


async def one(client: httpx.AsyncClient, rng: random.Random, abort: bool, tally: Counter) -> None:
    path, body, stream = make_request(rng)
    tally["sent"] += 1
    try:
        if stream:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    tally[f"error {response.status_code}"] += 1
                    return
                last = ""
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    if abort:
                        tally["aborted"] += 1
                        return  # leaving the block closes the connection
                    if '"error"' in line[:16]:
                        tally["error event"] += 1
                    last = line
                tally["completed" if last == "data: [DONE]" else "stream without [DONE]"] += 1
            return
        request = client.post(path, json=body)
        if abort:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(request, timeout=rng.uniform(0.01, 0.5))
                tally["completed"] += 1
                return
            tally["aborted"] += 1
            return
        response = await request
        tally["completed" if response.status_code == 200 else f"error {response.status_code}"] += 1
    except httpx.HTTPError as exc:
        tally[f"client error {type(exc).__name__}"] += 1


async def soak(base_url: str, args: argparse.Namespace) -> Counter:
    rng = random.Random(args.seed)
    tally: Counter = Counter()
    semaphore = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

        async def guarded(seed: int) -> None:
            async with semaphore:
                local = random.Random(seed)
                await one(client, local, local.random() < args.abort_share, tally)

        started = time.perf_counter()
        tasks = [asyncio.ensure_future(guarded(rng.randrange(1 << 30)))
                 for _ in range(args.num_requests)]
        for done, task in enumerate(asyncio.as_completed(tasks), start=1):
            await task
            if done % max(1, args.num_requests // 10) == 0:
                print(f"  {done}/{args.num_requests} requests, "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--abort-share", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the run; RSS after each round tells a one-off high-water "
                        "mark (allocator caches) from a leak (growth every round)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="extra flags for batchinfer serve")
    args = parser.parse_args()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "batchinfer.cli.main", "serve", "--port", str(port),
               "--embedding-model", "default", "--log-level", "warning", *args.server_args.split()]
    server = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health").status_code == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        warm = argparse.Namespace(**{**vars(args), "num_requests": 20, "abort_share": 0.0})
        asyncio.run(soak(base_url, warm))
        rss_before = rss_mib(server.pid)
        before = metrics(base_url)
        started = time.perf_counter()
        tally: Counter = Counter()
        rss_rounds = []
        for round_index in range(args.rounds):
            round_args = argparse.Namespace(**{**vars(args), "seed": args.seed + round_index})
            tally += asyncio.run(soak(base_url, round_args))
            rss_rounds.append(rss_mib(server.pid))
        elapsed_s = time.perf_counter() - started
        settled = time.monotonic() + 60
        after = metrics(base_url)
        gauges = ("batchinfer_num_requests_running", "batchinfer_num_requests_waiting",
                  "batchinfer_kv_cache_usage_perc", "batchinfer_encoder_num_items_waiting")
        while any(after.get(g, 0.0) for g in gauges) and time.monotonic() < settled:
            time.sleep(0.5)
            after = metrics(base_url)
        rss_after = rss_mib(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    print(f"\n{args.rounds} x {args.num_requests} requests at concurrency {args.concurrency}, "
          f"{args.abort_share:.0%} abandoned by their clients, in {elapsed_s:.0f} s")
    print("client side: " + json.dumps(dict(sorted(tally.items()))))
    finished = {reason: after.get(f'batchinfer_request_success_total{{finished_reason="{reason}"}}',
                                  0.0) - before.get(
        f'batchinfer_request_success_total{{finished_reason="{reason}"}}', 0.0)
                for reason in ("stop", "length", "abort")}
    print("server finish counters (sequences): " + json.dumps(finished))
    print("after the run: " + ", ".join(f"{g} {after.get(g, 0.0):g}" for g in gauges))
    print(f"server RSS: {rss_before:.0f} MiB after warm-up, after each round "
          + ", ".join(f"{r:.0f}" for r in rss_rounds) + f" MiB, {rss_after:.0f} MiB at the end")
    unexpected = {k: v for k, v in tally.items()
                  if k not in ("sent", "completed", "aborted")}
    leaked = [g for g in gauges if after.get(g, 0.0)]
    if unexpected or leaked:
        print(f"FAILED: unexpected {unexpected}, not back to 0: {leaked}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
