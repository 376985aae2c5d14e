"""The OpenAI-compatible server, live on a free 127.0.0.1 port, driven by the official `openai`
client and raw HTTP, on a tiny random model (float32)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from batchinfer import LLM, SamplingParams, native
from batchinfer.core.config import EngineConfig
from batchinfer.server import rendering
from batchinfer.server.app import ServerConfig, build_app
from tests.tiny_models import make_tiny_llama

ENGINE = {"dtype": "float32", "kv_cache_memory": 16 << 20}
API_KEY = "secret-key"
POISON = 297  # a prompt holding this token id makes the patched runner raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_server(app, timeout_s: float = 120.0) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread until the block ends."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health").status_code == 200:
                break
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not become healthy")
        time.sleep(0.05)
    try:
        yield base_url
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("server")))


@pytest.fixture(scope="session")
def served(model_dir):
    app = build_app(
        EngineConfig.from_kwargs(model=model_dir, **ENGINE),
        ServerConfig(served_model_name="tiny", max_request_bytes=64 << 10),
    )
    with run_server(app) as base_url:
        yield base_url, app


@pytest.fixture(scope="session")
def base_url(served) -> str:
    return served[0]


@pytest.fixture(scope="session")
def small_server(model_dir):
    """One sequence at a time, one waiting request at most, an API key, and the embedded
    encoder mounted at /v1/embeddings."""
    app = build_app(
        EngineConfig.from_kwargs(model=model_dir, max_num_seqs=1, **ENGINE),
        ServerConfig(api_key=API_KEY, max_num_queued_requests=1, embedding_model="default"),
    )
    with run_server(app) as url:
        yield url


@pytest.fixture(scope="session")
def offline(model_dir) -> LLM:
    return LLM(model_dir, **ENGINE)


@pytest.fixture
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def slow_steps(app, step_s: float) -> None:
    """Make every engine step of a served app take `step_s` longer (so waiting is visible)."""
    runner = app.state.server.llm.engine.core.runner
    execute = runner.execute

    def slowed(scheduler_output):
        time.sleep(step_s)
        return execute(scheduler_output)

    runner.execute = slowed


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


# --------------------------------------------------------------------------- the openai client
def test_models_health_version(base_url, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base_url}/version").json()["version"]


def test_completion_equals_offline(client, offline):
    response = client.completions.create(
        model="tiny", prompt="the quick brown", max_tokens=8, temperature=0
    )
    want = offline.generate(
        "the quick brown", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )[0]
    choice = response.choices[0]
    assert choice.text == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)
    assert response.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert (
        response.usage.total_tokens
        == response.usage.prompt_tokens + response.usage.completion_tokens
    )


def test_chat_and_streaming_chat_with_usage(client, offline):
    messages = [{"role": "user", "content": "Hello world! How are you"}]
    response = client.chat.completions.create(
        model="default", messages=messages, max_tokens=10, temperature=0
    )
    want = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == want.outputs[0].text
    assert response.usage.completion_tokens == len(want.outputs[0].token_ids)

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == want.outputs[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        want.outputs[0].token_ids
    )
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_stop_string(client, offline):
    text = (
        offline.generate(
            "the quick",
            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    start = next(i for i in range(len(text) // 2, len(text)) if text[i].strip())
    stop = text[start : start + 2]
    for stream in (False, True):
        response = client.completions.create(
            model="tiny",
            prompt="the quick",
            max_tokens=16,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        choices = [c.choices[0] for c in response] if stream else response.choices
        assert "".join(c.text for c in choices) == text[: text.find(stop)]
        assert choices[-1].finish_reason == "stop"


def test_long_stream_hands_each_token_text_to_the_writer_once(tmp_path, monkeypatch):
    """2,000 streamed tokens: the SSE writer gets each token's text once (linear work on the
    event loop; cumulative outputs would hand it ~2,000 x the text)."""
    model = str(make_tiny_llama(tmp_path, max_position_embeddings=2048))
    handed = {"chars": 0, "tokens": 0}
    chunks = rendering.Renderer.chunks

    def counting(self, event):
        for completion in event[1].outputs:
            handed["chars"] += len(completion.text)
            handed["tokens"] += len(completion.token_ids)
        return chunks(self, event)

    monkeypatch.setattr(rendering.Renderer, "chunks", counting)
    with run_server(build_app(EngineConfig.from_kwargs(model=model, **ENGINE))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model="default", prompt="hello", max_tokens=2000,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks_read = list(stream)
        whole = client.completions.create(model="default", prompt="hello", max_tokens=2000,
                                          temperature=0, extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in chunks_read if chunk.choices)
    assert chunks_read[-1].usage.completion_tokens == 2000
    assert text == whole.choices[0].text and len(text) > 2000 // 4
    assert handed == {"chars": len(text), "tokens": 2000}


def test_seed_reproducible_and_n2(client):
    def sample(seed: int, n: int = 1):
        return client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            n=n,
            extra_body={"ignore_eos": True},
        )

    first, again = sample(7), sample(7)
    assert first.choices[0].text == again.choices[0].text
    both = sample(7, n=2)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == first.choices[0].text  # sequence 0 keeps the request's seed
    assert both.usage.completion_tokens == 24


def test_logprobs(client):
    response = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    # keyed by token text: ids that decode alike (partial UTF-8) share a key, as with OpenAI
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert lp <= 0 and max(top.values()) <= lp + 1e-4  # greedy: the best token

    chat = client.chat.completions.create(
        model="tiny",
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-4)


def test_tokenize_detokenize_and_request_id(base_url):
    r = httpx.post(
        f"{base_url}/tokenize",
        json={"model": "tiny", "prompt": "the quick brown"},
        headers={"X-Request-Id": "my-id-1"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1"
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    r = httpx.post(f"{base_url}/detokenize", json={"model": "tiny", "tokens": body["tokens"]})
    assert r.json() == {"prompt": "the quick brown"}
    assert httpx.get(f"{base_url}/health").headers["x-request-id"]


# --------------------------------------------------------------------------- concurrency
def test_32_concurrent_streams_equal_offline_and_batch(base_url, offline):
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "Hello",
             "world", "batching", "attention"]
    prompts = [" ".join(words[i % 7 : i % 7 + 3 + i % 9]) for i in range(32)]
    params = [
        SamplingParams(
            max_tokens=8 + i % 13,
            temperature=0 if i % 2 else 0.9,
            ignore_eos=True,
            seed=None if i % 2 else 100 + i,
        )
        for i in range(32)
    ]
    want = offline.generate(prompts, params, use_tqdm=False)
    batches_before = _batch_size_hist(base_url)

    async def stream_one(client: openai.AsyncOpenAI, prompt: str, sp: SamplingParams) -> str:
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            seed=sp.seed,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(
                *(stream_one(client, p, sp) for p, sp in zip(prompts, params, strict=True))
            )

    texts = asyncio.run(main())
    assert texts == [w.outputs[0].text for w in want]
    le1, count = _batch_size_hist(base_url)
    assert count - batches_before[1] > le1 - batches_before[0]  # some steps ran > 1 sequence


def _batch_size_hist(base_url: str) -> tuple[float, float]:
    return (
        metric(base_url, 'batchinfer_batch_size_bucket{le="1.0"}'),
        metric(base_url, "batchinfer_batch_size_count"),
    )


def test_disconnects_free_kv_blocks(base_url):
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
    }
    url = f"{base_url}/v1/completions"
    with httpx.stream("POST", url, json=body | {"stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        wait_for(lambda: metric(base_url, "batchinfer_kv_cache_usage_perc") > 0)
    # leaving the block closed the connection mid-stream
    wait_for(lambda: metric(base_url, "batchinfer_kv_cache_usage_perc") == 0.0)
    assert metric(base_url, "batchinfer_num_requests_running") == 0
    # a non-streamed request whose client gives up (400 tokens of the tiny model take ~0.2 s
    # in native decode steps, several times the read timeout)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.05))
    wait_for(lambda: metric(base_url, "batchinfer_kv_cache_usage_perc") == 0.0)
    assert metric(base_url, 'batchinfer_request_success_total{finished_reason="abort"}') >= 2


def test_failing_request_fails_alone_with_500(served):
    base_url, app = served
    runner = app.state.server.llm.engine.core.runner
    execute = runner.execute

    def poisoned(scheduler_output):
        if any(s.is_prefill and POISON in s.token_ids for s in scheduler_output.sequences):
            raise RuntimeError("poisoned prompt")
        return execute(scheduler_output)

    async def main():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            body = {"model": "tiny", "max_tokens": 6, "temperature": 0}
            return await asyncio.gather(
                http.post("/v1/completions", json=body | {"prompt": [5, 6, 7, 8]}),
                http.post(
                    "/v1/completions",
                    json=body | {"prompt": [5, POISON, 7]},
                    headers={"X-Request-Id": "culprit"},
                ),
            )

    runner.execute = poisoned
    try:
        good, bad = asyncio.run(main())
    finally:
        runner.execute = execute
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
    assert bad.status_code == 500
    message = bad.json()["error"]["message"]
    assert "culprit" in message and "cmpl-" in message and "poisoned prompt" in message
    assert httpx.get(f"{base_url}/health").status_code == 200


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "hi", "echo": True}, 400, "echo"),
        ({}, 400, "prompt"),
        ({"prompt": [1, 2, 100000]}, 400, None),
        ({"prompt": list(range(3, 200)) * 3}, 400, None),  # longer than max_model_len
        ({"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ],
)
def test_bad_input_status_and_body(base_url, body, status, param):
    r = httpx.post(f"{base_url}/v1/completions", json={"model": "tiny"} | body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


def test_chat_bad_input(base_url):
    url = f"{base_url}/v1/chat/completions"
    r = httpx.post(url, json={"model": "tiny", "messages": []})
    assert r.status_code == 400
    r = httpx.post(
        url,
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_malformed_json_and_too_large(base_url):
    url = f"{base_url}/v1/completions"
    r = httpx.post(
        url, content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(url, content=b"[1, 2", headers={"content-type": "application/json"})
    assert r.status_code == 400
    # `curl -d` labels JSON as a form; it is read as JSON all the same
    r = httpx.post(url, content=b'{"prompt": "hi", "max_tokens": 2}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    big = json.dumps({"model": "tiny", "prompt": "x " * 40_000})
    r = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"]

    def chunked():  # no Content-Length: the size is counted as it arrives
        for _ in range(20):
            yield b" " * 8192
        yield b'{"model": "tiny", "prompt": "x"}'

    r = httpx.post(url, content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_api_key(small_server):
    url = f"{small_server}/v1/completions"
    body = {"model": "default", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["message"]
    assert httpx.get(f"{small_server}/v1/models").status_code == 401
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
    assert httpx.get(f"{small_server}/health").status_code == 200
    assert httpx.get(f"{small_server}/metrics").status_code == 200
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{small_server}/v1/embeddings", json={"input": ["a", "b"]})
    assert r.status_code == 401
    r = httpx.post(f"{small_server}/v1/embeddings", json={"input": ["a", "b"]}, headers=auth)
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    models = httpx.get(f"{small_server}/v1/models", headers=auth).json()["data"]
    assert len(models) == 2
    (generator,) = [m for m in models if "native_decode" in m]  # the encoder has none
    assert set(generator["native_decode"]) <= {"1", "2-8", "9-32", "33+"}
    assert generator["prefill_activations"] == "int16"  # the default
    assert generator["cpu_isa"] in (None, *native.ISA_LEVELS)


def test_embeddings_only():
    from fastapi.testclient import TestClient

    app = build_app(None, ServerConfig(embedding_model="default",
                                       embedding_quantization="int8"))
    with TestClient(app) as http:
        wait_for(lambda: http.get("/health").status_code == 200, timeout_s=120)
        r = http.post("/v1/embeddings", json={"input": "hello", "model": "default"})
        assert r.status_code == 200 and r.json()["data"][0]["embedding"]
        (card,) = http.get("/v1/models").json()["data"]
        # int8 unless the probe check refused it on this machine; the kernels say the same
        assert card["quantization"] in ("int8", "none")
        kernels = [k for bucket in card["linear_kernels"].values() for k in bucket]
        assert set(card["linear_kernels"]) == {"384x384", "1536x384", "384x1536"}
        assert all(k.startswith("int8") == (card["quantization"] == "int8") for k in kernels)
        r = http.post("/v1/completions", json={"model": "default", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(ValueError, match="nothing to serve"):
        build_app(None, ServerConfig())


def test_queue_overflow_429_keeps_accepted(small_server):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str, dict]:
        body = {
            "model": "default",
            "prompt": f"request {i}",
            "max_tokens": 24,
            "ignore_eos": True,
            "temperature": 0,
        }
        r = await http.post("/v1/completions", json=body)
        return r.status_code, r.headers.get("retry-after", ""), r.json()

    async def main():
        async with httpx.AsyncClient(
            base_url=small_server, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as http:
            return await asyncio.gather(*(one(http, i) for i in range(8)))

    results = asyncio.run(main())
    rejected = [r for r in results if r[0] == 429]
    accepted = [r for r in results if r[0] == 200]
    assert rejected and accepted and len(rejected) + len(accepted) == 8
    assert all(retry_after.isdigit() for _, retry_after, _ in rejected)
    assert all(body["error"]["message"] for _, _, body in rejected)
    for _, _, body in accepted:
        assert body["usage"]["completion_tokens"] == 24
        assert body["choices"][0]["finish_reason"] == "length"


def test_health_503_while_loading(model_dir):
    from fastapi.testclient import TestClient

    app = build_app(EngineConfig.from_kwargs(model=model_dir, **ENGINE))
    gate = threading.Event()
    state = app.state.server
    load = state.load
    state.load = lambda loop: (gate.wait(60), load(loop))
    with TestClient(app) as http:
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = http.post("/v1/completions", json={"model": "default", "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["message"]
        gate.set()
        wait_for(lambda: http.get("/health").status_code == 200, timeout_s=120)
