"""Metrics on hand-made request results: vLLM's definitions, exact values."""

from __future__ import annotations

import numpy as np
import pytest

from batchinfer.bench.client import RequestResult
from batchinfer.bench.metrics import (
    compute_class_metrics,
    compute_metrics,
    concurrency_at,
    latency_stats,
    max_concurrency,
    output_token_timeline,
    parse_goodput,
)


def make_result(start: float, ttft: float, itl: float, num_tokens: int,
                prompt_tokens: int | None = 10, usage_tokens: int | None = None) -> RequestResult:
    times = [start + ttft + i * itl for i in range(num_tokens)]
    return RequestResult(start_s=start, end_s=times[-1] + 0.001, chunk_times_s=times,
                         num_prompt_tokens=prompt_tokens, num_prompt_tokens_est=7,
                         num_usage_output_tokens=usage_tokens if usage_tokens else num_tokens)


def test_per_request_definitions() -> None:
    results = [make_result(0.0, 0.1, 0.02, 11), make_result(0.5, 0.3, 0.04, 6),
               RequestResult(start_s=0.2, end_s=0.3, error="HTTP 500")]
    m = compute_metrics(results, duration_s=2.0, start_s=0.0,
                        goodput_slos_ms={"ttft": 200, "tpot": 50})
    assert (m.completed, m.failed, m.failed_by_reason) == (2, 1, {"HTTP 500": 1})
    assert m.ttft.mean_ms == pytest.approx(200.0)
    assert m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.p99_ms == pytest.approx(np.percentile([100, 300], 99))
    assert m.ttft.std_ms == pytest.approx(100.0)
    # TPOT = (E2EL - TTFT) / (tokens - 1): exactly the injected ITL.
    assert m.tpot.p50_ms == pytest.approx(30.0)
    assert m.e2el.mean_ms == pytest.approx(((0.1 + 0.2) + (0.3 + 0.2)) / 2 * 1000)
    itls = [20.0] * 10 + [40.0] * 5
    assert m.itl.mean_ms == pytest.approx(np.mean(itls))
    assert m.itl.p90_ms == pytest.approx(np.percentile(itls, 90))
    assert m.total_output_tokens == 17 and m.total_input_tokens == 20
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(8.5)
    assert m.total_token_throughput == pytest.approx(18.5)
    assert m.goodput == pytest.approx(0.5)  # only the first meets TTFT <= 200 ms
    assert m.max_concurrent_requests == 2


def test_per_class_metrics() -> None:
    results = [make_result(0.0, 0.1, 0.02, 11), make_result(0.5, 0.3, 0.04, 6),
               make_result(0.2, 0.5, 0.1, 3), RequestResult(0.2, end_s=0.3, error="HTTP 500"),
               RequestResult(0.4, end_s=0.6, error="HTTP 503 queue_timeout")]
    for r, name in zip(results, ("interactive", "interactive", "batch", "interactive", "batch"),
                       strict=True):
        r.request_class = name
    per_class = compute_class_metrics(results, ["interactive", "batch", "idle"], 2.0, 0.0,
                                      {"ttft": 200})
    interactive, batch, idle = per_class["interactive"], per_class["batch"], per_class["idle"]
    assert list(per_class) == ["interactive", "batch", "idle"]
    assert (interactive.completed, interactive.failed) == (2, 1)
    assert interactive.failed_by_reason == {"HTTP 500": 1}
    assert interactive.ttft.mean_ms == pytest.approx(200.0)
    assert interactive.tpot.p99_ms == pytest.approx(np.percentile([20, 40], 99))
    assert interactive.itl.p90_ms == pytest.approx(np.percentile([20.0] * 10 + [40.0] * 5, 90))
    assert interactive.output_throughput == pytest.approx(17 / 2.0)
    assert interactive.goodput == pytest.approx(0.5)
    assert (batch.completed, batch.failed) == (1, 1)
    assert batch.failed_by_reason == {"HTTP 503 queue_timeout": 1}
    assert batch.ttft.p50_ms == pytest.approx(500.0)
    assert batch.e2el.p99_ms == pytest.approx(700.0)  # TTFT + 2 gaps of 100 ms
    assert batch.output_throughput == pytest.approx(3 / 2.0) and batch.goodput == 0.0
    assert (idle.completed, idle.failed, idle.ttft, idle.output_throughput) == (0, 0, None, 0)
    overall = compute_metrics(results, 2.0, 0.0, {"ttft": 200})
    assert overall.completed == interactive.completed + batch.completed
    assert overall.output_throughput == pytest.approx(interactive.output_throughput
                                                      + batch.output_throughput)


def test_usage_beats_chunk_count_and_fallbacks() -> None:
    # 5 chunks but the server says 10 tokens (2 a chunk): TPOT uses 10.
    r = make_result(0.0, 0.1, 0.02, 5, prompt_tokens=None, usage_tokens=10)
    m = compute_metrics([r], 1.0, 0.0)
    assert m.tpot.mean_ms == pytest.approx(80 / 9)
    assert m.total_output_tokens == 10
    assert m.total_input_tokens == 7  # no usage.prompt_tokens: the workload's estimate
    assert m.goodput is None
    r.num_usage_output_tokens = None
    assert compute_metrics([r], 1.0, 0.0).total_output_tokens == 5


def test_one_token_requests_have_no_tpot_but_count_for_goodput() -> None:
    m = compute_metrics([make_result(0.0, 0.05, 0.0, 1)], 1.0, 0.0, {"tpot": 1})
    assert m.tpot is None
    assert m.goodput == pytest.approx(1.0)


def test_all_failed_gives_empty_stats() -> None:
    m = compute_metrics([RequestResult(0.0, end_s=0.1, error="ConnectError")], 1.0, 0.0)
    assert m.completed == 0 and m.ttft is None and m.output_throughput == 0
    assert latency_stats([]) is None


def test_timelines() -> None:
    results = [make_result(0.0, 0.1, 0.5, 4), make_result(1.0, 0.2, 0.1, 3, usage_tokens=6)]
    # tokens at 0.1 0.6 1.1 1.6 | 1.2 1.3 1.4 (weight 2 each)
    assert output_token_timeline(results, 0.0) == [2.0, 8.0]
    assert max_concurrency(results) == 2
    assert concurrency_at(results, [0.05, 1.1, 3.0]) == [1, 2, 0]


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "TPOT:100", "e2el:2000"]) == {
        "ttft": 500.0, "tpot": 100.0, "e2el": 2000.0}
    for bad in (["ttft"], ["speed:5"], ["ttft:x"], ["ttft:-1"], ["ttft:inf"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_vllm_flat_keys_carry_the_nested_values() -> None:
    from batchinfer.bench.metrics import vllm_flat_metrics

    results = [make_result(0.0, 0.1, 0.02, 11), make_result(0.5, 0.3, 0.04, 6),
               make_result(0.7, 0.2, 0.03, 1)]
    m = compute_metrics(results, duration_s=2.0, start_s=0.0, goodput_slos_ms={"ttft": 250})
    flat = vllm_flat_metrics(results, m, ("ttft", "tpot", "itl", "e2el"), (50.0, 99.0, 99.9))
    assert flat["completed"] == 3 and flat["request_throughput"] == m.request_throughput
    assert flat["output_throughput"] == m.output_throughput
    assert flat["request_goodput"] == m.goodput
    for name in ("ttft", "tpot", "itl", "e2el"):
        stats = getattr(m, name)
        assert flat[f"mean_{name}_ms"] == pytest.approx(stats.mean_ms)
        assert flat[f"median_{name}_ms"] == pytest.approx(stats.median_ms)
        assert flat[f"std_{name}_ms"] == pytest.approx(stats.std_ms)
        assert flat[f"p99_{name}_ms"] == pytest.approx(stats.p99_ms)
        assert flat[f"p50_{name}_ms"] == pytest.approx(stats.p50_ms)
    assert flat["p99.9_ttft_ms"] == pytest.approx(np.percentile([100, 300, 200], 99.9))
    only = vllm_flat_metrics(results, m, ("ttft",), (99.0,))
    assert "p99_ttft_ms" in only and "mean_tpot_ms" not in only and "p50_ttft_ms" not in only
