"""`bench serve` end to end against the fake server: timings, failures, files, bad input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from batchinfer.bench.config import BenchConfig
from batchinfer.bench.loadgen import BenchResult, run_benchmark
from batchinfer.bench.serve import bench_serve, run_async
from batchinfer.bench.sweep import free_port
from batchinfer.cli.main import main
from tests.fake_openai_server import FakeServerConfig, run_fake_server

QUIET = dict(show_progress=False, plots=False)


def run(base_url: str, **fields: object) -> BenchResult:
    return run_async(run_benchmark(BenchConfig(base_url=base_url, **{**QUIET, **fields})))


def test_metrics_match_injected_timings() -> None:
    ttft_s, itl_s, num_tokens = 0.1, 0.02, 10
    with run_fake_server(FakeServerConfig(ttft_s=ttft_s, itl_s=itl_s)) as base_url:
        result = run(base_url, num_prompts=12, input_len="16", output_len=str(num_tokens),
                     max_concurrency=4, num_warmups=2, goodput_slos_ms={"ttft": 5000})
    m = result.metrics
    assert (m.completed, m.failed) == (12, 0)
    assert m.total_output_tokens == 12 * num_tokens  # from usage
    assert m.total_input_tokens == 12 * 16  # the fake server counts words
    # Scheduling noise on a loaded 2-core machine only ever adds delay, so the bounds are
    # asymmetric: never below what was injected, at most twice it (TTFT < E2EL still holds).
    e2el_ms = (ttft_s + (num_tokens - 1) * itl_s) * 1000
    for stats, injected_ms in ((m.ttft, ttft_s * 1000), (m.tpot, itl_s * 1000),
                               (m.itl, itl_s * 1000), (m.e2el, e2el_ms)):
        assert 0.9 * injected_ms <= stats.median_ms <= 2.0 * injected_ms
    for stats in (m.ttft, m.tpot, m.itl, m.e2el):
        assert stats.p50_ms <= stats.p90_ms <= stats.p95_ms <= stats.p99_ms
    assert m.goodput == pytest.approx(m.request_throughput)
    assert m.max_concurrent_requests <= 4
    assert result.model == "fake-model"  # discovered from /v1/models
    # The server-side view was scraped: requests ran, sequences per step were reported.
    assert result.server is not None and result.server.max["running"] >= 1
    assert result.server.mean["batch_size"] >= 1


def test_failures_are_counted_not_raised() -> None:
    pattern = ("500", "429", "disconnect", "ok")
    with run_fake_server(FakeServerConfig(failure_pattern=pattern)) as base_url:
        result = run(base_url, num_prompts=8, input_len="4", output_len="6")
    m = result.metrics
    assert (m.completed, m.failed) == (2, 6)
    assert m.failed_by_reason.pop("HTTP 500") == 2
    assert m.failed_by_reason.pop("HTTP 429") == 2
    assert list(m.failed_by_reason.values()) == [2]  # the dropped connections
    failed = [r for r in result.results if not r.success]
    assert any("queue full" in (r.error_detail or "") for r in failed)


def test_warmups_are_sent_and_discarded() -> None:
    # The 3 warm-ups take the three "ok"s, so both measured requests get a 500.
    pattern = ("ok", "ok", "ok", "500", "500")
    with run_fake_server(FakeServerConfig(failure_pattern=pattern)) as base_url:
        result = run(base_url, num_prompts=2, num_warmups=3, input_len="4", output_len="3")
    assert (result.metrics.completed, result.metrics.failed) == (0, 2)
    assert result.num_warmup_failed == 0 and len(result.results) == 2


def test_chat_run_writes_json_and_pngs(tmp_path: Path) -> None:
    output = io.StringIO()
    with run_fake_server(FakeServerConfig(ttft_s=0.02, itl_s=0.005)) as base_url:
        config = BenchConfig(base_url=base_url, endpoint="chat", dataset="shared-prefix",
                             shared_prefix_len=8, num_prompts=6, input_len="4:8",
                             output_len="5", request_rate=50.0, burstiness=0.5,
                             result_dir=str(tmp_path), result_name="run", show_progress=False,
                             calibrate_tokens=True, goodput_slos_ms={"ttft": 1000, "e2el": 2000})
        result = bench_serve(config, Console(file=output, width=120))
    assert result.metrics.completed == 6
    assert result.tokens_per_word == 1.0  # the fake /tokenize counts words
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["config"] == config.to_json()
    # vLLM's flat keys, the same values as the nested ones.
    assert data["completed"] == data["metrics"]["completed"] == 6
    assert data["p99_ttft_ms"] == data["metrics"]["ttft"]["p99_ms"]
    assert data["mean_tpot_ms"] == data["metrics"]["tpot"]["mean_ms"]
    assert data["metrics"]["completed"] == 6 and data["metrics"]["ttft"]["p99_ms"] > 0
    assert data["metrics"]["goodput_slos_ms"] == {"ttft": 1000, "e2el": 2000}
    assert data["server"]["mean"]["running"] >= 0
    assert len(data["requests"]) == 6 and data["requests"][0]["output_tokens"] == 5
    for name in ("run_latency_cdf.png", "run_timeline.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    text = output.getvalue()
    for label in ("TTFT", "TPOT", "ITL", "E2EL", "sequences per step", "request goodput"):
        assert label in text


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(["bench", "serve", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    assert "cannot reach server" in one_line_error(capsys, ["--base-url", unreachable])
    assert "greater than" in one_line_error(capsys, ["--input-len", "512:64"])
    assert ">= 1" in one_line_error(capsys, ["--output-len", "0:10"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{oops\n')
    err = one_line_error(capsys, ["--dataset", "jsonl", "--dataset-path", str(bad)])
    assert f"{bad}:2" in err and "malformed" in err
    with run_fake_server() as base_url:
        err = one_line_error(capsys, ["--base-url", base_url, "--model", "no-such-model"])
    assert "'no-such-model' is not served" in err and "fake-model" in err
    # Without /v1/models, a short test request meets the server's 404.
    with run_fake_server(FakeServerConfig(models_route=False)) as base_url:
        err = one_line_error(capsys, ["--base-url", base_url, "--model", "no-such-model"])
        assert "404" in err and "no-such-model" in err
        err = one_line_error(capsys, ["--base-url", base_url])
        assert "pass --model" in err
