"""The server-side view: `/metrics` scraped every 0.5 s while a benchmark runs.

Client concurrency is not batch size: 64 connections may meet a server that runs 4 sequences a
step and queues the rest. This module reads what the server itself reports, under batchinfer's
names or vLLM's: requests running and waiting, KV cache usage, sequences and tokens per step,
queue time, preemptions. Gauges are read as they are; histograms give per-interval means from
the deltas of their `_sum` and `_count` between two scrapes; counters give deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Each series and the metric names that feed it, batchinfer's first, then vLLM's.
GAUGES = {
    "running": ("batchinfer_num_requests_running", "vllm:num_requests_running"),
    "waiting": ("batchinfer_num_requests_waiting", "vllm:num_requests_waiting"),
    "kv_cache_usage": ("batchinfer_kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
                       "vllm:gpu_cache_usage_perc"),
    "preemption_rate": ("batchinfer_preemption_rate",),
}
COUNTERS = {
    "preemptions": ("batchinfer_num_preemptions", "vllm:num_preemptions"),
    "queue_timeouts": ("batchinfer_request_queue_timeouts",),
    "prefix_cache_queries": ("batchinfer_prefix_cache_queries", "vllm:prefix_cache_queries"),
    "prefix_cache_hits": ("batchinfer_prefix_cache_hits", "vllm:prefix_cache_hits"),
    "recomputed_tokens": ("batchinfer_recomputed_tokens",),
    "swapped_blocks": ("batchinfer_swapped_blocks",),  # out + in
    "swap_time_s": ("batchinfer_swap_time_seconds",),
}
HISTOGRAMS = {
    "batch_size": ("batchinfer_batch_size",),
    "iteration_tokens": ("batchinfer_iteration_tokens", "vllm:iteration_tokens_total"),
    "queue_time_s": ("batchinfer_request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    "padding_ratio": ("batchinfer_batch_padding_ratio",),
}
_ALL_NAMES = tuple(n for table in (GAUGES, COUNTERS, HISTOGRAMS) for ns in table.values()
                   for n in ns)
# Ray's metrics export names a replica's `batchinfer_x` as `ray_batchinfer_x`.
RAY_PREFIX = "ray_"
# Percent-named gauges that report a fraction in [0, 1] (vLLM's convention, kept by batchinfer).
FRACTION_GAUGES = ("kv_cache_usage",)


@dataclass(slots=True)
class ServerSample:
    """One scrape: gauge values, counter totals and histogram (sum, count) pairs."""

    time_s: float  # perf_counter when the response arrived
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, tuple[float, float]] = field(default_factory=dict)


def parse_metrics(text: str, time_s: float = 0.0) -> ServerSample:
    """Read the known series out of Prometheus text. Samples of one metric with different
    labels (several replicas) are summed (a fraction gauge is averaged); unknown metrics are
    skipped cheaply. Ray's metrics export (`ray_` + the name, every series a gauge) reads the
    same as a server's own `/metrics`."""
    kept = "\n".join(
        line for line in (_without_ray_prefix(raw) for raw in text.splitlines())
        if line.startswith(_ALL_NAMES) or (line.startswith("#") and _mentions_known(line))
    )
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(kept + "\n"):
        for metric in family.samples:
            values.setdefault(metric.name, []).append(float(metric.value))
    sample = ServerSample(time_s)
    for key, names in GAUGES.items():
        found = _first(values, names)
        if found is not None:
            sample.gauges[key] = sum(found) / len(found) if key in FRACTION_GAUGES else sum(found)
    for key, names in COUNTERS.items():
        found = _first(values, tuple(f"{n}_total" for n in names))
        if found is not None:
            sample.counters[key] = sum(found)
    for key, names in HISTOGRAMS.items():
        for name in names:
            if f"{name}_sum" in values and f"{name}_count" in values:
                sample.histograms[key] = (sum(values[f"{name}_sum"]),
                                          sum(values[f"{name}_count"]))
                break
    return sample


def _without_ray_prefix(line: str) -> str:
    if line.startswith(RAY_PREFIX):
        return line[len(RAY_PREFIX):]
    if line.startswith("#"):
        parts = line.split(maxsplit=3)
        if len(parts) >= 3 and parts[2].startswith(RAY_PREFIX):
            parts[2] = parts[2][len(RAY_PREFIX):]
            return " ".join(parts)
    return line


def _mentions_known(comment: str) -> bool:
    parts = comment.split(maxsplit=3)
    return len(parts) >= 3 and parts[2].startswith(_ALL_NAMES)


def _first(values: dict[str, list[float]], names: tuple[str, ...]) -> list[float] | None:
    for name in names:
        if name in values:
            return values[name]
    return None


class MetricsScraper:
    """Scrapes `{base_url}/metrics` (or `metrics_url`) every `interval_s` until stopped; keeps
    the samples.

    Uses its own small HTTP client, so a scrape never waits for a slot in the benchmark's pool.
    If the first scrape fails (no route, not Prometheus text) the server view is skipped.
    """

    def __init__(self, base_url: str, interval_s: float = 0.5,
                 metrics_url: str | None = None) -> None:
        self.url = metrics_url or f"{base_url}/metrics"
        self.interval_s = interval_s
        self.samples: list[ServerSample] = []
        self.available = True
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    async def scrape_once(self, client: httpx.AsyncClient) -> ServerSample | None:
        try:
            response = await client.get(self.url)
            if response.status_code != 200:
                return None
            return parse_metrics(response.text, time.perf_counter())
        except (httpx.HTTPError, ValueError):
            return None

    async def _loop(self, client: httpx.AsyncClient) -> None:
        while True:
            started = time.perf_counter()
            sample = await self.scrape_once(client)
            if sample is None and not self.samples:
                self.available = False
                return
            if sample is not None:
                self.samples.append(sample)
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - started)))

    def start(self) -> None:
        """Start scraping in the running loop. The client is made here, before the benchmark's
        clock starts: making one loads the TLS certificates, which blocks the loop."""
        self._client = httpx.AsyncClient(timeout=5.0)
        self._task = asyncio.get_running_loop().create_task(self._loop(self._client))

    async def stop(self) -> None:
        """Take one last sample (so counters cover the whole run), then stop."""
        if self._task is None or self._client is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self.available:
            sample = await self.scrape_once(self._client)
            if sample is not None:
                self.samples.append(sample)
        await self._client.aclose()


@dataclass(slots=True)
class ServerSummary:
    """What the server reported over a run. `mean` holds gauge means over the scrapes and
    histogram means over the whole run (e.g. `batch_size`: sequences per step); `timeline`
    holds one value per scrape (histograms: the mean over the interval before it, or None)."""

    num_samples: int
    mean: dict[str, float]
    max: dict[str, float]
    deltas: dict[str, float]  # counters: increase over the run (e.g. preemptions)
    timeline: dict[str, list[float | None]]


def summarize_server(samples: list[ServerSample], start_s: float) -> ServerSummary | None:
    """Means, maxima, counter deltas and timelines of the scrapes (None if there are none)."""
    if not samples:
        return None
    timeline: dict[str, list[float | None]] = {"time_s": [s.time_s - start_s for s in samples]}
    mean: dict[str, float] = {}
    peak: dict[str, float] = {}
    for key in GAUGES:
        series = [s.gauges.get(key) for s in samples]
        present = [v for v in series if v is not None]
        if present:
            timeline[key] = series
            mean[key] = sum(present) / len(present)
            peak[key] = max(present)
    for key in HISTOGRAMS:
        pairs = [s.histograms.get(key) for s in samples]
        if not any(pairs):
            continue
        timeline[key] = [None, *(_interval_mean(a, b) for a, b in zip(pairs, pairs[1:],
                                                                       strict=False))]
        present_pairs = [p for p in pairs if p is not None]
        whole = _interval_mean(present_pairs[0], present_pairs[-1])
        if whole is not None:
            mean[key] = whole
        present = [v for v in timeline[key] if v is not None]
        if present:
            peak[key] = max(present)
    deltas: dict[str, float] = {}
    for key in COUNTERS:
        totals = [s.counters[key] for s in samples if key in s.counters]
        if totals:
            deltas[key] = totals[-1] - totals[0]
    return ServerSummary(len(samples), mean, peak, deltas, timeline)


def _interval_mean(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
