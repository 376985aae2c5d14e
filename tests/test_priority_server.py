"""Scheduling under pressure over real HTTP: `priority` / `service_tier` / `timeout` fields,
503 `queue_timeout` answers (plain, streamed before the first token, and mid-stream after a
preemption), and the per-class metrics. One sequence runs at a time, so others wait."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from batchinfer.core.config import EngineConfig
from batchinfer.server.app import ServerConfig, build_app
from tests.test_server import metric, run_server, slow_steps
from tests.tiny_models import make_tiny_llama

STEP_S = 0.03  # added to every engine step, so waiting is long enough to observe
LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 150, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("priority"))
    app = build_app(EngineConfig.from_kwargs(
        model=str(model_dir), dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=1,
        scheduling_policy="priority", max_queue_time_ms=60_000), ServerConfig())
    with run_server(app) as url:
        slow_steps(app, STEP_S)
        yield url


def post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "default", **body},
                      headers=headers, timeout=60)


def busy(url: str) -> None:
    """Until the long request holds the only seat."""
    deadline = time.monotonic() + 120
    while metric(url, "batchinfer_num_requests_running") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_request_past_its_queue_time_gets_503_queue_timeout(server):
    before = metric(server, "batchinfer_request_queue_timeouts_total")
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(post, server, LONG)
        busy(server)
        started = time.monotonic()
        response = post(server, {"prompt": "hi", "max_tokens": 2, "timeout": 0.3})
        waited = time.monotonic() - started
        answered_while_the_seat_was_held = not long.done()
        streamed = httpx.post(f"{server}/v1/completions", timeout=60, json={
            "model": "default", "prompt": "hi", "max_tokens": 2, "timeout": 0.2, "stream": True})
        assert long.result().status_code == 200
        assert long.result().json()["choices"][0]["finish_reason"] == "length"
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["code"] == "queue_timeout" and "queue" in error["message"]
    # Answered at its deadline, not when the seat freed: the long request still ran.
    assert waited >= 0.3 and answered_while_the_seat_was_held
    # A stream that times out before its first token: the status says so (no 200 + tokens).
    assert streamed.status_code == 503
    assert streamed.json()["error"]["code"] == "queue_timeout"
    assert metric(server, "batchinfer_request_queue_timeouts_total") == before + 2


def test_max_queue_time_is_the_default_and_timeout_overrides_it(tmp_path):
    model_dir = make_tiny_llama(tmp_path)
    app = build_app(EngineConfig.from_kwargs(
        model=str(model_dir), dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=1,
        max_queue_time_ms=200), ServerConfig())
    with run_server(app) as url, ThreadPoolExecutor(3) as pool:
        slow_steps(app, STEP_S)
        long = pool.submit(post, url, LONG)
        busy(url)
        default = pool.submit(post, url, {"prompt": "a", "max_tokens": 2})
        patient = pool.submit(post, url, {"prompt": "b", "max_tokens": 2, "timeout": 30.0})
        assert default.result().status_code == 503
        assert patient.result().status_code == 200  # served once the seat freed
        assert long.result().status_code == 200


def test_interactive_requests_go_before_batch_ones(server):
    done: dict[str, float] = {}

    def timed(name: str, body: dict, headers: dict | None = None) -> httpx.Response:
        response = post(server, body, headers)
        done[name] = time.monotonic()
        return response

    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(post, server, LONG)
        busy(server)
        batch = pool.submit(timed, "batch", {"prompt": "x", "max_tokens": 3,
                                             "service_tier": "batch"})
        time.sleep(0.2)
        header = pool.submit(timed, "header", {"prompt": "y", "max_tokens": 3},
                             {"X-Service-Tier": "flex"})  # OpenAI's name for the batch tier
        time.sleep(0.2)
        chat = pool.submit(timed, "interactive", {"prompt": "z", "max_tokens": 3})
        for future in (long, batch, header, chat):
            assert future.result().status_code == 200
    assert done["interactive"] < done["batch"] < done["header"]


def test_priority_field_orders_within_a_class(server):
    done: list[str] = []

    def run(name: str, priority: int) -> None:
        assert post(server, {"prompt": name, "max_tokens": 2, "priority": priority}
                    ).status_code == 200
        done.append(name)

    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(post, server, LONG)
        busy(server)
        futures = []
        for name, priority in [("low", 5), ("high", -5), ("mid", 0)]:
            futures.append(pool.submit(run, name, priority))
            time.sleep(0.15)
        for future in futures:
            future.result()
        long.result()
    assert done == ["high", "mid", "low"]


@pytest.mark.parametrize("body, param", [
    ({"service_tier": "gold"}, "service_tier"),
    ({"priority": "1"}, "priority"),
    ({"priority": 1.5}, "priority"),
    ({"timeout": -1}, "timeout"),
])
def test_bad_scheduling_fields_get_400_naming_them(server, body, param):
    response = post(server, {"prompt": "a", "max_tokens": 2, **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_an_unknown_tier_header_gets_400(server):
    response = post(server, {"prompt": "a", "max_tokens": 2}, {"X-Service-Tier": "gold"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "service_tier"


def test_latency_histograms_carry_the_priority_class(server):
    def count(priority_class: str) -> float:
        name = "batchinfer_time_to_first_token_seconds_count"
        text = httpx.get(f"{server}/metrics").text
        line = next(line for line in text.splitlines()
                    if line.startswith(name) and f'priority_class="{priority_class}"' in line)
        return float(line.rsplit(" ", 1)[1])

    before = count("batch"), count("interactive")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    client.chat.completions.create(model="default", max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"service_tier": "batch"})
    assert (count("batch"), count("interactive")) == (before[0] + 1, before[1])


def test_a_stream_preempted_past_its_queue_time_ends_with_an_error_event(tmp_path):
    """Two streams that cannot both fit in the KV cache: the later one is preempted, waits
    longer than its timeout and its stream ends with a queue_timeout error event and [DONE];
    the other finishes exactly as asked."""
    model_dir = make_tiny_llama(tmp_path)
    app = build_app(EngineConfig.from_kwargs(
        model=str(model_dir), dtype="float32", kv_cache_memory=512 * 160, max_num_seqs=2,
        kv_admission_watermark=1.0, block_size=16), ServerConfig())
    body = {"model": "default", "prompt": [5, 6, 7, 8], "max_tokens": 120, "ignore_eos": True,
            "stream": True}

    def stream(extra: dict) -> list[str]:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, **extra},
                          timeout=60) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line]

    with run_server(app) as url, ThreadPoolExecutor(2) as pool:
        slow_steps(app, STEP_S)
        block_manager = app.state.server.llm.engine.core.scheduler.block_manager
        assert block_manager.num_blocks == 10  # 160 tokens: two requests of 124 do not fit
        first = pool.submit(stream, {})
        time.sleep(0.3)
        second = pool.submit(stream, {"timeout": 0.5})
        first_lines, second_lines = first.result(), second.result()
    assert first_lines[-1] == "data: [DONE]"
    texts = [json.loads(line[6:]) for line in first_lines[:-1]]
    assert texts[-1]["choices"][0]["finish_reason"] == "length"
    assert second_lines[-1] == "data: [DONE]"
    error = json.loads(second_lines[-2][6:])["error"]
    assert error["code"] == "queue_timeout"
    assert any('"text"' in line for line in second_lines[:-2])  # it had streamed tokens


def test_swap_preemption_over_http_resumes_streams_exactly_and_is_counted(tmp_path):
    """`--preemption-mode swap`: of two greedy streams that cannot both fit, the later one is
    swapped out to host memory and back; both stream the text one request alone gets, and
    /metrics counts the preemption by mode and the blocks moved each way."""
    model_dir = make_tiny_llama(tmp_path)
    app = build_app(EngineConfig.from_kwargs(
        model=str(model_dir), dtype="float32", kv_cache_memory=512 * 160, max_num_seqs=2,
        kv_admission_watermark=1.0, block_size=16, preemption_mode="swap",
        swap_space=512 * 160), ServerConfig())
    body = {"model": "default", "prompt": [5, 6, 7, 8], "max_tokens": 120, "ignore_eos": True,
            "temperature": 0}

    def stream() -> str:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])

    with run_server(app) as url, ThreadPoolExecutor(2) as pool:
        slow_steps(app, STEP_S)
        first = pool.submit(stream)
        time.sleep(0.3)
        second = pool.submit(stream)
        texts = [first.result(), second.result()]
        alone = post(url, body).json()["choices"][0]["text"]
        swapped = metric(url, 'batchinfer_num_preemptions_total{mode="swap",reason="kv_full"}')
        recomputed = metric(url,
                            'batchinfer_num_preemptions_total{mode="recompute",reason="kv_full"}')
        out = metric(url, 'batchinfer_swapped_blocks_total{direction="out"}')
        back = metric(url, 'batchinfer_swapped_blocks_total{direction="in"}')
        usage = metric(url, "batchinfer_swap_space_usage_perc")
    assert texts == [alone, alone] and alone
    assert swapped >= 1 and recomputed == 0
    assert out == back >= 1 and usage == 0
