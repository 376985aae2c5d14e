"""A fake OpenAI-compatible server with injected timings and failures, for the bench's tests.

It streams `max_tokens` chunks per request (one word each): the first after `ttft_s`, the rest
`itl_s` apart, then a usage chunk and `[DONE]`, as vLLM does with `include_usage`. With both
delays 0 it writes the whole stream at once (the client-ceiling benchmark). Failures follow
`failure_pattern`, cycled over requests: "ok", "500", "429", "disconnect" (the connection drops
after a few chunks). `/metrics` reports in-flight requests under batchinfer's names (or vLLM's).

In-process: `with run_fake_server(FakeServerConfig(ttft_s=0.1)) as base_url: ...`
As a process: `python tests/fake_openai_server.py --host 127.0.0.1 --port 8000 [--ttft-ms 50]`
(unknown flags such as `--batching static` are accepted and logged, so `bench sweep` can start
it in place of `batchinfer serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


@dataclass(frozen=True)
class FakeServerConfig:
    model: str = "fake-model"
    ttft_s: float = 0.0
    itl_s: float = 0.0
    failure_pattern: tuple[str, ...] = ("ok",)
    metrics: bool = True
    models_route: bool = True
    vllm_names: bool = False
    max_num_seqs: int = 1000  # for the fake KV usage: running / max_num_seqs


class _Metrics:
    def __init__(self, vllm_names: bool) -> None:
        self.registry = CollectorRegistry()
        p = "vllm:" if vllm_names else "batchinfer_"
        self.running = Gauge(f"{p}num_requests_running", "running", registry=self.registry)
        self.waiting = Gauge(f"{p}num_requests_waiting", "waiting", registry=self.registry)
        self.kv_usage = Gauge(f"{p}kv_cache_usage_perc", "kv usage", registry=self.registry)
        self.preemptions = Counter(f"{p}num_preemptions", "preemptions", registry=self.registry)
        name = "vllm:iteration_tokens_total" if vllm_names else "batchinfer_batch_size"
        self.batch_size = Histogram(
            name,
            "sequences per step",
            registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )


def make_app(config: FakeServerConfig) -> FastAPI:
    """The fake server's FastAPI app."""
    app = FastAPI()
    failures = itertools.cycle(config.failure_pattern)
    metrics = _Metrics(config.vllm_names)
    state = {"running": 0}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    if config.models_route:
        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": config.model, "object": "model"}]}

    if config.metrics:

        @app.get("/metrics")
        async def prometheus() -> Response:
            return PlainTextResponse(generate_latest(metrics.registry).decode())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await request.json()
        return {"count": len(str(body.get("prompt", "")).split())}

    async def handle(request: Request, chat: bool) -> Response:
        body = await request.json()
        if body.get("model") != config.model:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        mode = next(failures)
        if mode == "500":
            return _error(500, "injected failure")
        if mode == "429":
            return _error(429, "queue full", headers={"Retry-After": "1"})
        text = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        usage = {"prompt_tokens": len(text.split()), "completion_tokens": body["max_tokens"]}
        stream = _stream(config, metrics, state, chat, body["max_tokens"], usage, mode)
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    return app


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "error", "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


@functools.lru_cache(maxsize=64)
def _chunk(chat: bool, text: str, finish: str | None = None) -> bytes:
    choice = (
        {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        if chat
        else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    )
    data = {"id": "x", "object": "chunk", "model": "m", "choices": [choice], "usage": None}
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def _stream(
    config: FakeServerConfig,
    metrics: _Metrics,
    state: dict,
    chat: bool,
    num_tokens: int,
    usage: dict,
    mode: str,
) -> AsyncIterator[bytes]:
    state["running"] += 1
    metrics.running.set(state["running"])
    metrics.kv_usage.set(state["running"] / config.max_num_seqs)
    try:
        chunks = [
            _chunk(chat, " word", "length" if i == num_tokens - 1 else None)
            for i in range(num_tokens)
        ]
        if chat:
            chunks.insert(0, _chunk(chat, ""))  # the role chunk: no content
        tail = [
            b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n",
            b"data: [DONE]\n\n",
        ]
        if mode == "disconnect":
            yield b"".join(chunks[:2])
            raise ConnectionResetError("injected disconnect")
        if config.ttft_s == 0 and config.itl_s == 0:
            metrics.batch_size.observe(state["running"])
            yield b"".join(chunks + tail)
            return
        await asyncio.sleep(config.ttft_s)
        for i, chunk in enumerate(chunks):
            if i > 0 and not (chat and i == 1):
                await asyncio.sleep(config.itl_s)
            metrics.batch_size.observe(state["running"])
            yield chunk
        yield b"".join(tail)
    finally:
        state["running"] -= 1
        metrics.running.set(state["running"])
        metrics.kv_usage.set(state["running"] / config.max_num_seqs)


@contextlib.contextmanager
def run_fake_server(config: FakeServerConfig | None = None) -> Iterator[str]:
    """Serve the fake app on 127.0.0.1 and a free port in a thread; yield its base URL."""
    with serve_in_thread(make_app(config or FakeServerConfig()), lifespan="off") as base_url:
        yield base_url


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, **uvicorn_options: Any) -> Iterator[str]:
    """Serve `app` with uvicorn on 127.0.0.1 and a free port in a thread; yield its base URL
    once it accepts connections, stop it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, **uvicorn_options)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:  # polled: a thread's progress has no event to await
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    args, unknown = parser.parse_known_args(argv)
    print(f"fake server args: {sys.argv[1:] if argv is None else argv}", flush=True)
    config = FakeServerConfig(
        model=args.model, ttft_s=args.ttft_ms / 1000, itl_s=args.itl_ms / 1000
    )
    uvicorn.run(
        make_app(config),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )


if __name__ == "__main__":
    main()
