"""Priority classes (`--mix`): parsing, class draws, per-class lengths and arrivals, the
`service_tier` sent, and per-class results end to end against the fake server."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import pytest
from fastapi.responses import JSONResponse
from rich.console import Console

from batchinfer.bench.arrival import arrival_times, burst_arrival_times
from batchinfer.bench.client import request_body
from batchinfer.bench.config import BenchConfig
from batchinfer.bench.loadgen import build_workload, run_benchmark
from batchinfer.bench.mix import assign_classes, parse_class_options, parse_mix
from batchinfer.bench.report import print_summary, result_to_json
from batchinfer.bench.serve import run_async
from batchinfer.cli.bench import _bench_config
from batchinfer.cli.main import build_parser
from tests.fake_openai_server import FakeServerConfig, make_app, serve_in_thread
from tests.test_bench_serve import one_line_error

QUIET = dict(show_progress=False, plots=False)
MIX = {"interactive": 0.8, "batch": 0.2}

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def test_parse_mix_and_normalise() -> None:
    assert parse_mix("interactive:0.8,batch:0.2") == MIX
    assert BenchConfig(mix=parse_mix("interactive:4, batch:1")).mix == MIX
    assert BenchConfig(mix={"a-1": 1, "b_2": 1, "c": 2}).mix == {"a-1": 0.25, "b_2": 0.25,
                                                                 "c": 0.5}
    assert BenchConfig().mix == {}


@pytest.mark.parametrize("text, cause", [
    ("interactive", "CLASS:WEIGHT"), ("interactive:x", "not a number"),
    ("a:1,a:2", "twice"), ("Interactive:1", "must match"), ("1a:1", "must match"),
    ("a b:1", "must match"), (":1", "must match"), ("a:0", "positive"), ("a:-1", "positive"),
    ("a:inf", "positive"), ("a:nan", "positive"),
])
def test_bad_mix_names_the_flag(text: str, cause: str) -> None:
    with pytest.raises(ValueError, match=cause) as info:
        BenchConfig(mix=parse_mix(text))
    assert "--mix" in str(info.value)


def test_parse_class_options() -> None:
    assert parse_class_options(["batch=1000:2000", " bg = normal:50,5"], "--class-input-len") \
        == {"batch": "1000:2000", "bg": "normal:50,5"}
    for bad, cause in ((["batch"], "CLASS=VALUE"), (["=5"], "CLASS=VALUE"),
                       (["batch="], "CLASS=VALUE"), (["b=1", "b=2"], "twice")):
        with pytest.raises(ValueError, match=cause) as info:
            parse_class_options(bad, "--class-output-len")
        assert "--class-output-len" in str(info.value)


@pytest.mark.parametrize("fields, flag, cause", [
    (dict(class_input_len={"batch": "5"}), "--class-input-len", "none: pass --mix"),
    (dict(mix=MIX, class_output_len={"other": "5"}), "--class-output-len", "not a class"),
    (dict(mix=MIX, class_input_len={"batch": "512:64"}), "--class-input-len batch",
     "greater than"),
    (dict(mix=MIX, class_output_len={"batch": "0"}), "--class-output-len batch", ">= 1"),
    (dict(mix=MIX, mix_arrival={"batch": "later"}), "--mix-arrival", "burst"),
    (dict(mix_arrival={"batch": "burst"}), "--mix-arrival", "not a class"),
    (dict(mix=MIX, class_input_len={"batch": "5"}, dataset="jsonl", dataset_path="x.jsonl"),
     "--class-input-len", "--dataset random"),
])
def test_bad_class_options_name_the_flag(fields: dict[str, Any], flag: str, cause: str) -> None:
    with pytest.raises(ValueError, match=cause) as info:
        BenchConfig(**fields)
    assert flag in str(info.value)


def test_class_draws_follow_the_mix_and_the_seed() -> None:
    classes = assign_classes(MIX, 20_000, seed=3)
    assert classes.count("batch") / len(classes) == pytest.approx(0.2, abs=0.01)
    assert set(classes) == set(MIX)
    assert classes == assign_classes(MIX, 20_000, seed=3)
    assert classes != assign_classes(MIX, 20_000, seed=4)
    assert assign_classes({}, 10, seed=3) == []


@pytest.mark.parametrize("dataset", ["random", "shared-prefix"])
def test_each_class_has_its_lengths(dataset: str) -> None:
    config = BenchConfig(dataset=dataset, shared_prefix_len=3, num_prefixes=2,
                         mix={"interactive": 0.6, "batch": 0.3, "bg": 0.1},
                         input_len="5:10", output_len="3",
                         class_input_len={"batch": "100:120"}, class_output_len={"batch": "50",
                                                                                 "bg": "7:9"})
    requests = build_workload(config, 600, seed=5)
    assert [r.request_class for r in requests] == assign_classes(config.mix, 600, seed=5)
    assert requests == build_workload(config, 600, seed=5)
    prefix_len = 3 if dataset == "shared-prefix" else 0
    by_class: dict[str, list[tuple[int, int]]] = {}
    for r in requests:  # (own input length, output length)
        lengths = (r.num_prompt_tokens_est - prefix_len, r.max_tokens)
        by_class.setdefault(str(r.request_class), []).append(lengths)
    assert by_class.keys() == {"interactive", "batch", "bg"}
    assert all(100 <= n_in <= 120 and n_out == 50 for n_in, n_out in by_class["batch"])
    assert all(5 <= n_in <= 10 and n_out == 3 for n_in, n_out in by_class["interactive"])
    assert all(5 <= n_in <= 10 for n_in, _ in by_class["bg"])
    assert {n_out for _, n_out in by_class["bg"]} == {7, 8, 9}
    if dataset == "shared-prefix":  # the prefix groups are shared across the classes
        assert len({r.system_prompt for r in requests}) == 2


def test_without_a_mix_nothing_changes() -> None:
    requests = build_workload(BenchConfig(input_len="4:9"), 20, seed=1)
    assert all(r.request_class is None for r in requests)
    mixed = build_workload(BenchConfig(input_len="4:9", mix=MIX), 20, seed=1)
    # Classes without an override keep the same prompts: only the class is added.
    assert [dataclasses.replace(r, request_class=None) for r in mixed] == requests
    body = json.loads(request_body(requests[0], "completions", "m"))
    assert "service_tier" not in body


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_request_body_sends_the_class_as_service_tier(endpoint: str) -> None:
    request = build_workload(BenchConfig(mix={"batch": 1}), 1, seed=0)[0]
    assert json.loads(request_body(request, endpoint, "m"))["service_tier"] == "batch"


def test_burst_arrival_times() -> None:
    scheduled = arrival_times(3, 5.0, 0.5, seed=2)
    flags = [False, True, False, True, True, False]
    assert burst_arrival_times(flags, 5.0, 0.5, seed=2) == [
        scheduled[0], 0.0, scheduled[1], 0.0, 0.0, scheduled[2]]
    assert burst_arrival_times([False] * 4, 5.0, seed=2) == arrival_times(4, 5.0, seed=2)
    assert burst_arrival_times([True] * 2, 5.0) == [0.0, 0.0]


@contextlib.contextmanager
def capturing_server(bodies: list[dict[str, Any]], reject_tier: str | None = None,
                     ) -> Iterator[str]:
    """The fake server, recording every POSTed completion body; a body with `service_tier`
    `reject_tier` is answered 503 `queue_timeout`, as batchinfer answers a queue timeout."""
    app = make_app(FakeServerConfig())

    async def capture(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") \
                or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        messages = [await receive()]
        while messages[-1].get("more_body"):
            messages.append(await receive())
        body = json.loads(b"".join(m.get("body", b"") for m in messages))
        bodies.append(body)
        if reject_tier is not None and body.get("service_tier") == reject_tier:
            error = {"message": "queue timeout", "type": "ServiceUnavailableError",
                     "code": "queue_timeout"}
            await JSONResponse({"error": error}, status_code=503)(scope, receive, send)
            return

        async def replay() -> dict[str, Any]:
            return messages.pop(0) if messages else await receive()

        await app(scope, replay, send)

    with serve_in_thread(capture, lifespan="off") as base_url:
        yield base_url


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_mixed_run_end_to_end(endpoint: str) -> None:
    bodies: list[dict[str, Any]] = []
    rate, seed = 40.0, 2
    with capturing_server(bodies) as base_url:
        config = BenchConfig(base_url=base_url, endpoint=endpoint, num_prompts=16,
                             input_len="4", output_len="3", mix=MIX, seed=seed,
                             class_output_len={"batch": "7"}, mix_arrival={"batch": "burst"},
                             request_rate=rate, **QUIET)
        result = run_async(run_benchmark(config))
    classes = Counter(assign_classes(MIX, 16, seed))
    num_batch = classes["batch"]
    assert 0 < num_batch < 16
    # Every request sent its class as service_tier, and the batch class its own length.
    assert Counter(b["service_tier"] for b in bodies) == classes
    assert {b["max_tokens"] for b in bodies if b["service_tier"] == "batch"} == {7}
    assert {b["max_tokens"] for b in bodies if b["service_tier"] == "interactive"} == {3}
    # The burst is sent at 0 (with the first interactive request), the other interactive
    # requests on the rate's schedule: results are in the order sent.
    sent = [r.request_class for r in result.results]
    second = [i for i, c in enumerate(sent) if c == "interactive"][1]
    assert sent[second:] == ["interactive"] * (classes["interactive"] - 1)
    last_scheduled = arrival_times(classes["interactive"], rate, 1.0, seed)[-1]
    assert result.results[-1].start_s - result.start_s >= last_scheduled - 0.01
    per_class = result.class_metrics
    assert list(per_class) == list(MIX)
    assert (per_class["batch"].completed, per_class["batch"].failed) == (num_batch, 0)
    assert per_class["batch"].total_output_tokens == 7 * num_batch
    assert per_class["interactive"].total_output_tokens == 3 * classes["interactive"]
    assert per_class["batch"].output_throughput == pytest.approx(
        7 * num_batch / result.metrics.duration_s)
    assert per_class["interactive"].ttft is not None and per_class["batch"].e2el is not None

    data = json.loads(json.dumps(result_to_json(result)))
    assert data["config"]["mix"] == MIX
    assert data["config"]["mix_arrival"] == {"batch": "burst"}
    assert set(data["per_class"]) == set(MIX)
    assert data["per_class"]["batch"].keys() == data["metrics"].keys()
    assert data["per_class"]["interactive"]["ttft"].keys() == data["metrics"]["ttft"].keys()
    assert Counter(r["class"] for r in data["requests"]) == classes
    output = io.StringIO()
    print_summary(result, Console(file=output, width=150))
    text = output.getvalue()
    assert "Per class" in text
    assert "Latency (ms), class interactive" in text and "Latency (ms), class batch" in text


def test_failures_are_counted_per_class_with_the_error_code() -> None:
    bodies: list[dict[str, Any]] = []
    with capturing_server(bodies, reject_tier="batch") as base_url:
        config = BenchConfig(base_url=base_url, num_prompts=20, input_len="4", output_len="2",
                             mix={"interactive": 0.5, "batch": 0.5}, seed=1,
                             **QUIET)
        result = run_async(run_benchmark(config))
    num_batch = sum(b["service_tier"] == "batch" for b in bodies)
    interactive, batch = result.class_metrics["interactive"], result.class_metrics["batch"]
    assert 0 < num_batch < 20
    assert (batch.completed, batch.failed) == (0, num_batch)
    assert batch.failed_by_reason == {"HTTP 503 queue_timeout": num_batch}
    assert batch.ttft is None and batch.output_throughput == 0
    assert (interactive.completed, interactive.failed) == (20 - num_batch, 0)
    assert result.metrics.failed_by_reason == {"HTTP 503 queue_timeout": num_batch}


def test_cli_flags_reach_the_config_for_serve_and_sweep() -> None:
    for command in ("serve", "sweep"):
        args = build_parser().parse_args([
            "bench", command, "--mix", "interactive:0.8,batch:0.2",
            "--class-input-len", "batch=1000:2000", "--class-output-len", "batch=256:512",
            "--class-output-len", "interactive=normal:64,8", "--mix-arrival", "batch=burst"])
        config = _bench_config(args)
        assert config.mix == MIX
        assert config.class_input_len == {"batch": "1000:2000"}
        assert config.class_output_len == {"batch": "256:512", "interactive": "normal:64,8"}
        assert config.mix_arrival == {"batch": "burst"}
        assert config.to_json()["class_output_len"] == config.class_output_len


def test_bad_flags_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--mix" in one_line_error(capsys, ["--mix", "interactive"])
    assert "--mix" in one_line_error(capsys, ["--mix", "interactive:0"])
    err = one_line_error(capsys, ["--mix", "a:1", "--class-input-len", "b=5"])
    assert "--class-input-len" in err and "not a class" in err
    err = one_line_error(capsys, ["--mix", "a:1", "--class-output-len", "a"])
    assert "--class-output-len" in err and "CLASS=VALUE" in err
    assert "--mix-arrival" in one_line_error(capsys, ["--mix", "a:1", "--mix-arrival", "a=now"])
