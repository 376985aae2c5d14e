"""Benchmark metrics with the definitions of `vllm bench serve`, so figures are comparable.

Per successful request (one that streamed at least one content chunk):
- TTFT: from sending the request to its first content chunk;
- E2EL: from sending the request to its last content chunk;
- TPOT: `(E2EL - TTFT) / (output_tokens - 1)`, only for requests with more than one token;
- ITL: every gap between two successive content chunks (all requests pooled);
- output tokens: the server's `usage.completion_tokens` (the chunk count if it sent none).
Goodput is the number of requests meeting every given SLO, per second of the run (a one-token
request counts as TPOT 0 there, as in vLLM). With `--mix`, every metric is also computed over
each class's requests alone. Percentiles are numpy's (linear), std is the population standard
deviation; latencies are reported in milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from batchinfer.bench.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class LatencyStats:
    """One latency metric over all requests, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float


@dataclass(slots=True)
class BenchMetrics:
    """The summary of one run; throughputs are per second of `duration_s`."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_output_throughput: float  # the busiest 1 s bucket of output tokens
    max_concurrent_requests: int  # client side: most requests in flight at once
    mean_concurrent_requests: float  # client side: sum of request durations / run duration
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None
    e2el: LatencyStats | None
    goodput: float | None = None  # requests/s meeting all SLOs; None without SLOs
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    failed_by_reason: dict[str, int] = field(default_factory=dict)


def latency_stats(values_s: Sequence[float]) -> LatencyStats | None:
    """Mean, median, std and p50/p90/p95/p99 of latencies given in seconds (None if empty)."""
    if len(values_s) == 0:
        return None
    ms = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p95, p99 = np.percentile(ms, [50, 90, 95, 99])
    return LatencyStats(
        mean_ms=float(ms.mean()), median_ms=float(np.median(ms)), std_ms=float(ms.std()),
        p50_ms=float(p50), p90_ms=float(p90), p95_ms=float(p95), p99_ms=float(p99),
    )


def request_tpot_s(result: RequestResult) -> float:
    """TPOT of one successful request; 0 when it produced one token or fewer."""
    num_tokens = result.num_output_tokens
    if num_tokens <= 1:
        return 0.0
    return (result.e2el_s - result.ttft_s) / (num_tokens - 1)


def request_itls_s(result: RequestResult) -> list[float]:
    times = result.chunk_times_s
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def latency_values_s(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Per metric, the values the percentiles are taken over (seconds): TTFT, TPOT (requests
    with more than one token), ITL (every gap, pooled) and E2EL of the successful requests."""
    ok = [r for r in results if r.success]
    return {"ttft": [r.ttft_s for r in ok],
            "tpot": [request_tpot_s(r) for r in ok if r.num_output_tokens > 1],
            "itl": [gap for r in ok for gap in request_itls_s(r)],
            "e2el": [r.e2el_s for r in ok]}


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def vllm_flat_metrics(results: Sequence[RequestResult], metrics: BenchMetrics,
                      percentile_metrics: Sequence[str], metric_percentiles: Sequence[float]
                      ) -> dict[str, float | int | None]:
    """The flat result keys of `vllm bench serve` saves (`completed`,
    `request_throughput`, `mean_ttft_ms`, `p99_tpot_ms`, ...), with the same values as the
    nested metrics, so scripts written for vLLM's files read these."""
    out: dict[str, float | int | None] = {
        "duration": metrics.duration_s, "completed": metrics.completed,
        "failed": metrics.failed, "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.peak_output_throughput,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    values = latency_values_s(results)
    for name in percentile_metrics:  # the same numbers as the latency table's
        ms = np.asarray(values[name], dtype=float) * 1000.0
        empty = ms.size == 0
        out[f"mean_{name}_ms"] = None if empty else float(ms.mean())
        out[f"median_{name}_ms"] = None if empty else float(np.median(ms))
        out[f"std_{name}_ms"] = None if empty else float(ms.std())
        for p in metric_percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = None if empty else \
                float(np.percentile(ms, p))
    return out


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    start_s: float,
    goodput_slos_ms: dict[str, float] | None = None,
) -> BenchMetrics:
    """Summarize the measured requests of a run that began at `start_s` (perf_counter)."""
    if duration_s <= 0:
        raise RuntimeError(f"benchmark duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    failed = Counter(r.error for r in results if r.error is not None)  # = not r.success
    values = latency_values_s(ok)
    ttfts, e2els = values["ttft"], values["e2el"]
    all_tpots = [request_tpot_s(r) for r in ok]
    total_in = sum(r.num_input_tokens for r in ok)
    total_out = sum(r.num_output_tokens for r in ok)
    slos = dict(goodput_slos_ms or {})
    tokens_per_s = output_token_timeline(results, start_s)
    return BenchMetrics(
        completed=len(ok),
        failed=sum(failed.values()),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        peak_output_throughput=max(tokens_per_s, default=0.0),
        max_concurrent_requests=max_concurrency(results),
        mean_concurrent_requests=sum(r.end_s - r.start_s for r in results) / duration_s,
        ttft=latency_stats(ttfts),
        tpot=latency_stats(values["tpot"]),
        itl=latency_stats(values["itl"]),
        e2el=latency_stats(e2els),
        goodput=_goodput(slos, ttfts, all_tpots, e2els, duration_s) if slos else None,
        goodput_slos_ms=slos,
        failed_by_reason=dict(failed),
    )


def compute_class_metrics(
    results: Sequence[RequestResult],
    classes: Sequence[str],
    duration_s: float,
    start_s: float,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, BenchMetrics]:
    """`compute_metrics` over the requests of each class (of `--mix`), with the run's duration:
    a class's throughputs are its share of the run's."""
    return {
        name: compute_metrics([r for r in results if r.request_class == name], duration_s,
                              start_s, goodput_slos_ms)
        for name in classes
    }


def _goodput(
    slos_ms: dict[str, float],
    ttfts: list[float],
    tpots: list[float],
    e2els: list[float],
    duration_s: float,
) -> float:
    per_metric = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    columns = [(per_metric[key], limit / 1000.0) for key, limit in slos_ms.items()]
    num_good = sum(
        all(values[i] <= limit for values, limit in columns) for i in range(len(ttfts))
    )
    return num_good / duration_s


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:100"]` (milliseconds) -> `{"ttft": 500.0, "tpot": 100.0}`."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: expected KEY:MS with KEY in {SLO_KEYS}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if not (limit > 0 and math.isfinite(limit)):
            raise ValueError(f"--goodput {item!r}: the limit must be a positive number of ms")
        slos[key] = limit
    return slos


def output_token_timeline(
    results: Sequence[RequestResult], start_s: float, bucket_s: float = 1.0
) -> list[float]:
    """Output tokens per second in `bucket_s` buckets from `start_s`. Each content chunk weighs
    the request's tokens / chunks, so a server that sends several tokens a chunk counts right."""
    ok = [r for r in results if r.success]
    if not ok:
        return []
    times = np.concatenate([r.chunk_times_s for r in ok])
    weights = np.concatenate([np.full(len(r.chunk_times_s), r.num_output_tokens
                                      / len(r.chunk_times_s)) for r in ok])
    index = np.maximum(0, ((times - start_s) / bucket_s).astype(np.int64))
    return (np.bincount(index, weights=weights) / bucket_s).tolist()


def max_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once, from their start and end times."""
    events = sorted(
        [(r.start_s, 1) for r in results] + [(r.end_s, -1) for r in results],
        key=lambda e: (e[0], e[1]),  # at a tie, an end before a start
    )
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def concurrency_at(results: Sequence[RequestResult],
                   times_s: Sequence[float] | np.ndarray) -> list[int]:
    """Client-side requests in flight at each of `times_s` (perf_counter seconds)."""
    starts = np.sort([r.start_s for r in results])
    ends = np.sort([r.end_s for r in results])
    at = np.asarray(times_s, dtype=float)
    in_flight = np.searchsorted(starts, at, side="right") - np.searchsorted(ends, at, "right")
    return [int(x) for x in in_flight]
