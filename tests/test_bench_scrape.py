"""The server-side view: Prometheus text parsed under batchinfer's and vLLM's names."""

from __future__ import annotations

import asyncio
import time

import pytest

from batchinfer.bench.scrape import MetricsScraper, ServerSample, parse_metrics, summarize_server
from tests.fake_openai_server import FakeServerConfig, run_fake_server
from tests.waiting import until

BATCHINFER_TEXT = """\
# HELP batchinfer_num_requests_running Requests in the running batch.
# TYPE batchinfer_num_requests_running gauge
batchinfer_num_requests_running{model_name="m"} 6.0
# TYPE batchinfer_num_requests_waiting gauge
batchinfer_num_requests_waiting{model_name="m"} 3.0
# TYPE batchinfer_kv_cache_usage_perc gauge
batchinfer_kv_cache_usage_perc{model_name="m"} 0.25
# TYPE batchinfer_num_preemptions_total counter
batchinfer_num_preemptions_total{model_name="m"} 2.0
# TYPE batchinfer_batch_size histogram
batchinfer_batch_size_bucket{le="8.0"} 10.0
batchinfer_batch_size_bucket{le="+Inf"} 10.0
batchinfer_batch_size_count 10.0
batchinfer_batch_size_sum 60.0
# TYPE batchinfer_time_to_first_token_seconds histogram
batchinfer_time_to_first_token_seconds_count 4.0
batchinfer_time_to_first_token_seconds_sum 1.0
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.0
"""

VLLM_TEXT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 5.0
"""


def test_parse_batchinfer_names() -> None:
    sample = parse_metrics(BATCHINFER_TEXT, time_s=1.0)
    assert sample.gauges == {"running": 6.0, "waiting": 3.0, "kv_cache_usage": 0.25}
    assert sample.counters == {"preemptions": 2.0}
    assert sample.histograms == {"batch_size": (60.0, 10.0)}


def test_parse_vllm_names_sums_engines_and_averages_fractions() -> None:
    sample = parse_metrics(VLLM_TEXT)
    assert sample.gauges["running"] == 5.0 and sample.gauges["waiting"] == 1.0
    assert sample.gauges["kv_cache_usage"] == pytest.approx(0.3)
    assert sample.counters == {"preemptions": 5.0}
    assert sample.histograms == {"queue_time_s": (0.5, 5.0)}


def test_summary_uses_deltas_for_histograms_and_counters() -> None:
    samples = [
        ServerSample(10.0, {"running": 2.0}, {"preemptions": 1.0}, {"batch_size": (10.0, 5.0)}),
        ServerSample(10.5, {"running": 6.0}, {"preemptions": 1.0}, {"batch_size": (10.0, 5.0)}),
        ServerSample(11.0, {"running": 4.0}, {"preemptions": 4.0}, {"batch_size": (50.0, 10.0)}),
    ]
    summary = summarize_server(samples, start_s=10.0)
    assert summary.timeline["time_s"] == [0.0, 0.5, 1.0]
    assert summary.mean["running"] == pytest.approx(4.0) and summary.max["running"] == 6.0
    # Steps during the run: 5 steps of 40 sequences in all -> 8 a step; none in interval 1.
    assert summary.mean["batch_size"] == pytest.approx(8.0)
    assert summary.timeline["batch_size"] == [None, None, 8.0]
    assert summary.deltas == {"preemptions": 3.0}
    assert summarize_server([], 0.0) is None


@pytest.mark.parametrize("vllm_names", [False, True])
def test_scraper_reads_fake_server(vllm_names: bool) -> None:
    async def scrape(base_url: str) -> list[ServerSample]:
        scraper = MetricsScraper(base_url, interval_s=0.05)
        scraper.start()
        await until(lambda: len(scraper.samples) >= 2, what="two scrapes")
        await scraper.stop()
        return scraper.samples

    with run_fake_server(FakeServerConfig(vllm_names=vllm_names)) as base_url:
        samples = asyncio.run(scrape(base_url))
    assert len(samples) >= 2
    assert samples[-1].gauges["running"] == 0.0
    assert "preemptions" in samples[-1].counters
    assert samples[0].time_s <= samples[-1].time_s <= time.perf_counter()


def test_scraper_without_metrics_route_gives_up() -> None:
    async def scrape(base_url: str) -> MetricsScraper:
        scraper = MetricsScraper(base_url, interval_s=0.05)
        scraper.start()
        await until(lambda: not scraper.available, what="the scraper giving up")
        await scraper.stop()
        return scraper

    with run_fake_server(FakeServerConfig(metrics=False)) as base_url:
        scraper = asyncio.run(scrape(base_url))
    assert not scraper.available and scraper.samples == []
