"""What structured outputs cost a burst: the same 64 chat requests with and without JSON
schemas on half of them, against one `batchinfer serve`, over HTTP, alternated round by round.

    .venv/bin/python benchmarks/structured.py                 # default model, 3 rounds
    .venv/bin/python benchmarks/structured.py --rounds 5 --num-requests 64 --max-tokens 128

Each round sends two bursts of `--num-requests` streamed chat requests at once: `plain` (no
constraint) and `mixed` (every other request carries `response_format` json_schema, each with a
schema of its own: benchmarks/data/json_schemas.json's twenty and variants of them with other
bounds, retitled every round so that every round compiles its grammars anew). The prompts,
`max_tokens` and greedy decoding are the same in both. Printed per round and as medians:
total output tok/s of the burst (target: mixed >= 0.9x plain) and the TPOT p50 of the requests
that are unconstrained in both (target: mixed within 10 % of plain), with TTFT p50, and how many
constrained outputs validate against their schema.

A constrained request ends when its JSON does, usually well before the same request
unconstrained, so `mixed` decodes fewer tokens than `plain` and its last steps run fewer
sequences (a smaller batch makes fewer tokens a second on the same step costs). A third burst,
`matched`, separates that from what the constraint itself costs: `plain`'s requests without
constraints, each with `max_tokens` set to the length of its output in `mixed` and
`ignore_eos` (the same tokens decoded, the same batch shape step by step).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema

from batchinfer.bench.client import RequestResult, build_request, send_request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pressure import cpu_model  # noqa: E402
from server_vs_offline import wait_healthy  # noqa: E402

SCHEMAS = json.loads((Path(__file__).resolve().parent / "data" / "json_schemas.json").read_text())


def distinct_schemas(count: int, round_index: int) -> list[dict]:
    """`count` distinct schemas: the twenty, then the same with their numeric bounds moved;
    each titled with the round so no round reuses another's compiled grammar."""
    out = []
    for i in range(count):
        spec = copy.deepcopy(SCHEMAS[i % len(SCHEMAS)])
        variant = i // len(SCHEMAS)
        if variant:
            _move_bounds(spec["schema"], variant)
        spec["schema"]["title"] = f"{spec['name']}-{variant}-round{round_index}"
        out.append(spec)
    return out


def _move_bounds(node: object, by: int) -> None:
    if isinstance(node, dict):
        for key in ("maximum", "maxLength", "maxItems"):
            if isinstance(node.get(key), int):
                node[key] += by
        for value in node.values():
            _move_bounds(value, by)
    elif isinstance(node, list):
        for value in node:
            _move_bounds(value, by)


def bodies(args, round_index: int, constrained: bool, lengths: list[int] | None = None
           ) -> list[tuple[bytes, dict | None]]:
    """The burst's requests (body, schema if constrained); `lengths`: each request decodes
    exactly that many tokens, unconstrained (`matched`)."""
    schemas = distinct_schemas(args.num_requests // 2, round_index)
    out = []
    for i in range(args.num_requests):
        spec = schemas[(i // 2) % len(schemas)]
        body = {"model": "default", "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"{spec['prompt']} Answer in JSON."}]}
        if lengths is not None:
            body["max_tokens"], body["ignore_eos"] = lengths[i], True
        schema = spec["schema"] if constrained and i % 2 == 0 else None
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": spec["name"], "schema": schema}}
        out.append((json.dumps(body).encode(), schema))
    return out


async def burst(url: str, requests: list[tuple[bytes, dict | None]]) -> tuple[float, list]:
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        built = [build_request(client, f"{url}/v1/chat/completions", body) for body, _ in requests]
        start = time.perf_counter()
        results: list[RequestResult] = await asyncio.gather(
            *(send_request(client, request) for request in built))
        wall_s = time.perf_counter() - start
    return wall_s, results


def tpot_s(result: RequestResult) -> float | None:
    n = result.num_output_tokens
    if n < 2 or len(result.chunk_times_s) < 2:
        return None
    return (result.e2el_s - result.ttft_s) / (n - 1)


def texts_valid(url: str, requests: list[tuple[bytes, dict | None]]) -> tuple[int, int]:
    """Send the constrained requests once more, whole, and validate what they return."""
    valid = total = 0
    for body, schema in requests:
        if schema is None:
            continue
        payload = json.loads(body)
        payload.pop("stream"), payload.pop("stream_options")
        choice = httpx.post(f"{url}/v1/chat/completions", json=payload,
                            timeout=600).json()["choices"][0]
        total += 1
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            valid += choice["finish_reason"] == "stop"
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return valid, total


def summarize(name: str, wall_s: float, results: list[RequestResult], plain_rows: list[int]):
    failed = [r.error for r in results if not r.success]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} requests failed: {failed[:3]}")
    out_tokens = sum(r.num_output_tokens for r in results)
    tpots = [t for i in plain_rows if (t := tpot_s(results[i])) is not None]
    return {"tok_s": out_tokens / wall_s, "out_tokens": out_tokens,
            "tpot_p50_ms": statistics.median(tpots) * 1e3,
            "ttft_p50_s": statistics.median(r.ttft_s for r in results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--server-args", default="", help="more `batchinfer serve` flags")
    args = parser.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "batchinfer.cli.main", "serve", "--model", args.model,
               "--port", str(args.port), "--log-level", "warning", *args.server_args.split()]
    proc = subprocess.Popen(command)
    try:
        wait_healthy(url, proc)
        print(f"CPU: {cpu_model()}; {args.num_requests} requests, "
              f"max_tokens {args.max_tokens}, greedy")
        asyncio.run(burst(url, bodies(args, -1, True)[:8]))  # warm-up
        plain_rows = list(range(1, args.num_requests, 2))  # unconstrained in both bursts
        rows: dict[str, list[dict]] = {"plain": [], "mixed": [], "matched": []}
        lengths: list[int] | None = None  # each request's output length in `mixed`
        for round_index in range(args.rounds):
            order = ("plain", "mixed", "matched")  # mixed always before the first matched
            for name in order if round_index % 2 == 0 else order[::-1]:
                requests = bodies(args, round_index, name == "mixed",
                                  lengths if name == "matched" else None)
                wall_s, results = asyncio.run(burst(url, requests))
                if name == "mixed":
                    lengths = [r.num_output_tokens for r in results]
                row = summarize(name, wall_s, results, plain_rows)
                rows[name].append(row)
                print(f"round {round_index} {name:7s}: {row['tok_s']:7.1f} out tok/s "
                      f"({row['out_tokens']} tokens), unconstrained TPOT p50 "
                      f"{row['tpot_p50_ms']:.1f} ms, TTFT p50 {row['ttft_p50_s']:.2f} s")
        med = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
               for name, rs in rows.items()}
        print(f"medians: plain {med['plain']['tok_s']:.1f} tok/s, mixed "
              f"{med['mixed']['tok_s']:.1f} tok/s: {med['mixed']['tok_s'] / med['plain']['tok_s']:.3f}x "
              "(target >= 0.9x)")
        print(f"same lengths unconstrained (matched) {med['matched']['tok_s']:.1f} tok/s: mixed "
              f"{med['mixed']['tok_s'] / med['matched']['tok_s']:.3f}x of it")
        print(f"unconstrained TPOT p50: plain {med['plain']['tpot_p50_ms']:.1f} ms, mixed "
              f"{med['mixed']['tpot_p50_ms']:.1f} ms: "
              f"{med['mixed']['tpot_p50_ms'] / med['plain']['tpot_p50_ms'] - 1:+.1%} "
              "(target within 10 %)")
        valid, total = texts_valid(url, bodies(args, args.rounds, True))
        print(f"constrained outputs valid against their schema (finish_reason stop): "
              f"{valid}/{total}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
