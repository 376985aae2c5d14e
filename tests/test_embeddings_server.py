"""`/v1/embeddings` through the official `openai` client against a live uvicorn server on
127.0.0.1, the OpenAI-style error bodies (never 422), and 429 on overload."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from batchinfer.batching import BatcherConfig, EmbeddingConfig, EmbeddingService
from batchinfer.server.embeddings import build_embeddings_app
from batchinfer.server.errors import APIError, install_error_handlers
from tests.fake_openai_server import serve_in_thread
from tests.waiting import until

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, EmbeddingService]]:
    registry = CollectorRegistry()
    service = EmbeddingService.load(
        EmbeddingConfig(dtype="float32", device="cpu", max_client_batch_size=8),
        BatcherConfig(max_batch_size=16, max_batch_delay_ms=2, max_batch_tokens=8192),
        registry=registry)
    with serve_in_thread(build_embeddings_app(service, registry)) as base_url:
        yield base_url, service


def test_openai_client_float_base64_and_token_ids(live: tuple[str, EmbeddingService]) -> None:
    from openai import OpenAI

    url, service = live
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    texts = ["A man is eating food.", "Hi", "The quick brown fox jumps over the lazy dog."]
    want = service.encoder.encode(texts).numpy()
    as_float = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    as_b64 = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    got = np.array([d.embedding for d in as_float.data], dtype=np.float32)
    assert [d.index for d in as_float.data] == [0, 1, 2] and as_float.model == MODEL
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(np.array([d.embedding for d in as_b64.data]) - want).max() <= 1e-5
    num_tokens = sum(len(ids) for ids in service.encoder.tokenize(texts))
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == num_tokens
    raw = service.encoder.tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    by_ids = client.embeddings.create(model=MODEL, input=[raw, raw], encoding_format="float")
    assert np.abs(np.array(by_ids.data[1].embedding) - want[0]).max() <= 1e-5
    single = client.embeddings.create(model=MODEL, input=texts[1], encoding_format="float")
    assert np.abs(np.array(single.data[0].embedding) - want[1]).max() <= 1e-5
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_concurrent_requests_share_batches(live: tuple[str, EmbeddingService]) -> None:
    from openai import AsyncOpenAI

    url, service = live
    texts = [f"request number {i} " + "padding words " * (i % 5) for i in range(12)]
    want = service.encoder.encode(texts).numpy()

    async def main() -> list[str]:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        responses = await asyncio.gather(*(
            client.embeddings.create(model=MODEL, input=t, encoding_format="base64")
            for t in texts))
        await client.close()
        return [r.data[0].embedding for r in responses]  # asked explicitly: left encoded

    got = np.array([np.frombuffer(base64.b64decode(e), dtype="<f4") for e in asyncio.run(main())])
    assert np.abs(got - want).max() <= 1e-5
    metrics = httpx.get(f"{url}/metrics").text
    assert "batchinfer_encoder_batch_size_bucket" in metrics
    assert "batchinfer_batch_padding_ratio_sum" in metrics
    assert 'batchinfer_encoder_queue_time_seconds_count{batcher="embeddings"' in metrics


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": ["ok", ""]}, 400, "input"),
    ({"input": ["x"] * 9}, 400, "input"),  # > max_client_batch_size=8
    ({"input": "word " * 300}, 400, "input"),  # > 256 tokens, truncate not asked
    ({"input": 5}, 400, "input"),
    ({"input": [1, "a"]}, 400, "input"),
    ({"input": [[1, 2], []]}, 400, "input"),
    ({"input": [[10**9]]}, 400, "input"),
    ({"input": [True]}, 400, "input"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 12}, 400, "dimensions"),
    ({"input": "x", "lane": "vip"}, 400, "lane"),
    ({"input": "x", "timeout_ms": -1}, 400, "timeout_ms"),
    ({}, 400, "input"),
    ({"input": "x", "model": "gpt-17"}, 404, "model"),
])
def test_bad_input_gets_openai_style_errors(live: tuple[str, EmbeddingService], body: dict,
                                            status: int, param: str) -> None:
    url, _ = live
    r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL} | body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_truncate_and_malformed_json(live: tuple[str, EmbeddingService]) -> None:
    url, _ = live
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "word " * 300, "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    r = httpx.post(f"{url}/v1/embeddings", content=b'{"input": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


class GatedEncoder:
    """Stands in for `Encoder`: 4-dim vectors, blocks in `encode_ids` until `gate` is set;
    `inside` is set once a batch is in."""

    name, dim, max_length = "gated", 4, 64

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.inside = threading.Event()

    def tokenize(self, texts: list[str], *, truncate: bool = False) -> list[list[int]]:
        return [[1] * len(t) for t in texts]

    def add_special_tokens(self, ids: list[list[int]], *, truncate: bool = False) -> list:
        return ids

    def encode_ids(self, batch: list[list[int]]):  # noqa: ANN201
        import torch

        self.inside.set()
        self.gate.wait(10)
        return torch.tensor([[float(len(ids)), 0, 0, 0] for ids in batch])


def test_overload_gives_429_with_retry_after() -> None:
    encoder = GatedEncoder()
    service = EmbeddingService(encoder, EmbeddingConfig(),  # type: ignore[arg-type]
                               BatcherConfig(max_batch_size=1, max_batch_delay_ms=0,
                                             max_queue_size=2))
    app = build_embeddings_app(service)

    async def main() -> tuple[list[httpx.Response], httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            too_big = await client.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
            assert too_big.status_code == 400  # can never fit a 2-item queue: not a 429
            first = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "a"}))
            # "a" runs (blocked); the queue is empty again
            assert await asyncio.to_thread(encoder.inside.wait, 10)
            second = asyncio.ensure_future(client.post("/v1/embeddings",
                                                       json={"input": ["bb", "ccc"]}))
            await until(lambda: service.batcher.num_waiting == 2, what="a full queue")
            rejected = await client.post("/v1/embeddings", json={"input": "dddd"})
            encoder.gate.set()
            accepted = await asyncio.gather(first, second)
            await service.close()
            return accepted, rejected

    accepted, rejected = asyncio.run(main())
    assert rejected.status_code == 429 and rejected.headers["retry-after"].isdigit()
    assert rejected.json()["error"]["type"] == "RateLimitError"
    assert [r.status_code for r in accepted] == [200, 200]
    assert [d["embedding"][0] for d in accepted[1].json()["data"]] == [2.0, 3.0]


class CountBody(BaseModel):
    count: int


def test_error_handlers_on_any_app() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/typed")
    async def typed(body: CountBody) -> dict:
        return {"count": body.count}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("kaput")

    @app.get("/value")
    async def value() -> dict:
        raise ValueError("bad value")

    @app.get("/api")
    async def api() -> dict:
        raise APIError(503, "busy", code="busy", headers={"Retry-After": "3"})

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.post("/typed", json={"count": "many"}),
                    await client.get("/boom", headers={"x-request-id": "req-42"}),
                    await client.get("/value"), await client.get("/api")]

    typed_r, boom_r, value_r, api_r = asyncio.run(main())
    assert typed_r.status_code == 400 and typed_r.json()["error"]["param"] == "count"
    assert boom_r.status_code == 500 and "req-42" in boom_r.json()["error"]["message"]
    assert value_r.status_code == 400 and value_r.json()["error"]["message"] == "bad value"
    assert api_r.status_code == 503 and api_r.headers["retry-after"] == "3"


def test_base64_layout_is_little_endian_float32() -> None:
    from batchinfer.batching.embedding_service import EmbeddingResult
    from batchinfer.server.embeddings import render_embeddings

    vector = np.array([1.5, -2.0, 0.25], dtype=np.float32)
    body = render_embeddings(EmbeddingResult([vector], 3), "base64", "m")
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == [1.5, -2.0, 0.25] and body["usage"]["prompt_tokens"] == 3
