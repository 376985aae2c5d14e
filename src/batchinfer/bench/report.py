"""Results out: the terminal tables (rich) and the JSON file with every number and the config."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from batchinfer.bench.client import RequestResult
from batchinfer.bench.config import BenchConfig
from batchinfer.bench.loadgen import BenchResult
from batchinfer.bench.metrics import (
    BenchMetrics,
    concurrency_at,
    latency_values_s,
    output_token_timeline,
    percentile_key,
    vllm_flat_metrics,
)

LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
# Server series: (key, label, scale, unit).
SERVER_ROWS = (
    ("running", "requests running", 1.0, ""),
    ("waiting", "requests waiting (queue)", 1.0, ""),
    ("batch_size", "sequences per step (real batch)", 1.0, ""),
    ("iteration_tokens", "tokens per step", 1.0, ""),
    ("kv_cache_usage", "KV cache usage", 100.0, "%"),
    ("preemption_rate", "preemptions per 100 steps", 1.0, ""),
    ("queue_time_s", "queue time", 1000.0, " ms"),
    ("padding_ratio", "padding ratio", 100.0, "%"),
)


def default_stem(config: BenchConfig) -> str:
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    return f"bench-{config.endpoint}-rate{rate}-{time.strftime('%Y%m%d-%H%M%S')}"


def result_to_json(result: BenchResult) -> dict[str, Any]:
    """All numbers of a run, the full config and the per-request records, JSON-safe.
    `per_class` maps each `--mix` class to metrics shaped as `metrics` (empty without a mix).
    The top level also holds `vllm bench serve`'s flat keys (`completed`, `mean_ttft_ms`,
    `p99_itl_ms`, ...: `--percentile-metrics` x `--metric-percentiles`)."""
    tokens_per_s = output_token_timeline(result.results, result.start_s)
    times = [float(t) for t in range(len(tokens_per_s))]
    config = result.config
    return {
        **vllm_flat_metrics(result.results, result.metrics, config.percentile_metrics,
                            config.metric_percentiles),
        "config": result.config.to_json(),
        "model": result.model,
        "tokens_per_word": result.tokens_per_word,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "num_warmup_failed": result.num_warmup_failed,
        "metrics": asdict(result.metrics),
        "per_class": {name: asdict(m) for name, m in result.class_metrics.items()},
        "server": asdict(result.server) if result.server is not None else None,
        "client_timeline": {
            "time_s": times,
            "output_tokens_per_s": tokens_per_s,
            "in_flight": concurrency_at(result.results, [result.start_s + t for t in times]),
        },
        "requests": [_request_record(r, result.start_s) for r in result.results],
    }


def _request_record(r: RequestResult, start_s: float) -> dict[str, Any]:
    record: dict[str, Any] = {
        "start_s": r.start_s - start_s,
        "end_s": r.end_s - start_s,
        "class": r.request_class,
        "error": r.error,
        "error_detail": r.error_detail,
    }
    if r.success:
        record.update(ttft_s=r.ttft_s, e2el_s=r.e2el_s, input_tokens=r.num_input_tokens,
                      output_tokens=r.num_output_tokens, num_chunks=len(r.chunk_times_s))
    return record


def write_json(data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    raise TypeError(f"not JSON-serializable: {type(value).__name__}")


def print_summary(result: BenchResult, console: Console) -> None:
    """The run in three tables: totals and throughput, latencies, and the server's own view;
    with `--mix`, then the totals of each class and a latency table per class."""
    m = result.metrics
    summary = Table(title=f"Serving benchmark: {result.model} @ {result.config.base_url}",
                    show_header=False)
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    failed = _failed_reasons(m)
    rows: list[tuple[str, str]] = [
        ("successful requests", f"{m.completed}"),
        ("failed requests", f"{m.failed}" + (f" ({failed})" if failed else "")),
        ("benchmark duration (s)", f"{m.duration_s:.2f}"),
        ("total input tokens", f"{m.total_input_tokens}"),
        ("total generated tokens", f"{m.total_output_tokens}"),
        ("request throughput (req/s)", f"{m.request_throughput:.2f}"),
        ("output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("peak output token throughput (tok/s)", f"{m.peak_output_throughput:.2f}"),
        ("total token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
        ("client in flight: mean / max", f"{m.mean_concurrent_requests:.1f} / "
                                         f"{m.max_concurrent_requests}"),
    ]
    if m.goodput is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in m.goodput_slos_ms.items())
        rows.insert(6, (f"request goodput (req/s) [{slos}]", f"{m.goodput:.2f}"))
    for label, value in rows:
        summary.add_row(label, value)
    console.print(summary)
    console.print(_latency_table(result.results, result.config, "Latency (ms)"))
    console.print(_server_table(result))
    if result.class_metrics:
        console.print(_class_table(result))
        for name in result.class_metrics:
            console.print(_latency_table([r for r in result.results if r.request_class == name],
                                         result.config, f"Latency (ms), class {name}"))


def _failed_reasons(m: BenchMetrics) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(m.failed_by_reason.items()))


def _class_table(result: BenchResult) -> Table:
    table = Table(title="Per class (--mix, sent as service_tier; tok/s: output tokens)")
    columns = ["class", "requests", "ok", "failed", "req/s", "tok/s"]
    if result.metrics.goodput is not None:
        columns.append("goodput")
    for column in columns:
        table.add_column(column, justify="left" if column == "class" else "right")
    for name, m in result.class_metrics.items():
        failed = _failed_reasons(m)
        row = [name, f"{m.completed + m.failed}", f"{m.completed}",
               f"{m.failed}" + (f" ({failed})" if failed else ""),
               f"{m.request_throughput:.2f}", f"{m.output_throughput:.2f}"]
        if m.goodput is not None:
            row.append(f"{m.goodput:.2f}")
        table.add_row(*row)
    return table


def _latency_table(results: list[RequestResult], config: BenchConfig, title: str) -> Table:
    """Rows: `--percentile-metrics`; columns: mean, median, std and `--metric-percentiles`."""
    table = Table(title=title)
    table.add_column("metric")
    columns = ["mean", "median", "std", *(percentile_key(p) for p in config.metric_percentiles)]
    for column in columns:
        table.add_column(column, justify="right")
    values = latency_values_s(results)
    for key in config.percentile_metrics:
        ms = np.asarray(values[key], dtype=float) * 1000.0
        if ms.size == 0:
            table.add_row(LATENCY_LABELS[key], *["n/a"] * len(columns))
            continue
        cells = [ms.mean(), np.median(ms), ms.std(),
                 *np.percentile(ms, list(config.metric_percentiles))]
        table.add_row(LATENCY_LABELS[key], *[f"{v:.2f}" for v in cells])
    return table


def _server_table(result: BenchResult) -> Table | str:
    server = result.server
    if server is None:
        return "[dim]server-side view: no /metrics at this server[/dim]"
    table = Table(title=f"Server side (/metrics, {server.num_samples} scrapes)")
    table.add_column("series")
    table.add_column("mean", justify="right")
    table.add_column("max", justify="right")
    table.add_row("client requests in flight", f"{result.metrics.mean_concurrent_requests:.1f}",
                  f"{result.metrics.max_concurrent_requests}")
    for key, label, scale, unit in SERVER_ROWS:
        if key in server.mean or key in server.max:
            table.add_row(label, _scaled(server.mean.get(key), scale, unit),
                          _scaled(server.max.get(key), scale, unit))
    for key, label in (("preemptions", "preemptions (during run)"),
                       ("queue_timeouts", "queue timeouts (during run)")):
        if key in server.deltas:
            table.add_row(label, f"{server.deltas[key]:g}", "")
    for key, label in (("recomputed_tokens", "tokens recomputed after preemption"),
                       ("swapped_blocks", "KV blocks swapped (out + in)"),
                       ("swap_time_s", "time spent swapping (s)")):
        if server.deltas.get(key):
            table.add_row(label, f"{server.deltas[key]:.4g}", "")
    queries = server.deltas.get("prefix_cache_queries")
    if queries:
        hits = server.deltas.get("prefix_cache_hits", 0.0)
        table.add_row("prefix cache hit rate (tokens)", f"{100 * hits / queries:.1f}%",
                      f"{hits:g} of {queries:g}")
    return table


def _scaled(value: float | None, scale: float, unit: str) -> str:
    return "n/a" if value is None else f"{value * scale:.1f}{unit}"
