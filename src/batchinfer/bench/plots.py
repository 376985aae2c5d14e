"""PNG plots of a run and of a sweep, drawn with matplotlib's Agg canvas (no pyplot state).

matplotlib is imported inside the functions, so `batchinfer bench --help` stays fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchinfer.bench.loadgen import BenchResult
from batchinfer.bench.metrics import concurrency_at, output_token_timeline, request_tpot_s


def _figure(num_rows: int, num_cols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    axes = figure.subplots(num_rows, num_cols, squeeze=False)
    return figure, axes


def plot_latency_cdfs(result: BenchResult, path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and E2EL (ms), with p50 and p99 marked."""
    ok = [r for r in result.results if r.success]
    series = {
        "TTFT": [r.ttft_s for r in ok],
        "TPOT": [request_tpot_s(r) for r in ok if r.num_output_tokens > 1],
        "E2EL": [r.e2el_s for r in ok],
    }
    figure, axes = _figure(1, 3, (13, 3.8))
    for ax, (name, values_s) in zip(axes[0], series.items(), strict=True):
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if not values_s:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
            continue
        ms = np.sort(np.asarray(values_s) * 1000.0)
        ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
        for q, style in ((50, ":"), (99, "--")):
            value = float(np.percentile(ms, q))
            ax.axvline(value, color="gray", linestyle=style, label=f"p{q} {value:.1f} ms")
        ax.legend(loc="lower right", fontsize=8)
    figure.savefig(path, dpi=100)
    return path


def plot_timeline(result: BenchResult, path: Path) -> Path:
    """Over the run: output tokens/s; client in-flight requests next to the server's running,
    waiting and sequences per step; KV cache usage (the last two only if `/metrics` exists)."""
    server = result.server
    num_rows = 3 if server is not None else 2
    figure, axes = _figure(num_rows, 1, (10, 2.8 * num_rows))
    tokens_per_s = output_token_timeline(result.results, result.start_s)
    ax = axes[0][0]
    ax.stairs(tokens_per_s, np.arange(len(tokens_per_s) + 1), fill=True, alpha=0.6)
    ax.set_ylabel("output tokens/s")
    ax.set_title("output throughput (1 s buckets)")

    ax = axes[1][0]
    end_s = max((r.end_s for r in result.results), default=result.start_s) - result.start_s
    grid_s = np.linspace(0.0, max(end_s, 1e-3), 200)
    in_flight = concurrency_at(result.results, result.start_s + grid_s)
    ax.step(grid_s, in_flight, where="post", label="client: requests in flight")
    if server is not None:
        times = server.timeline["time_s"]
        for key, label in (("running", "server: running"), ("waiting", "server: waiting"),
                           ("batch_size", "server: sequences per step")):
            if key in server.timeline:
                ax.plot(times, _nan(server.timeline[key]), marker=".", label=label)
    ax.set_ylabel("requests")
    ax.set_title("client concurrency vs the server's real batch and queue")
    ax.legend(fontsize=8)

    if server is not None:
        ax = axes[2][0]
        usage = server.timeline.get("kv_cache_usage")
        if usage is not None:
            ax.plot(server.timeline["time_s"], 100.0 * _nan(usage), marker=".")
        ax.set_ylabel("KV cache usage (%)")
        ax.set_title("KV cache usage")
    for row in axes:
        row[0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("time since start (s)")
    figure.savefig(path, dpi=100)
    return path


def _nan(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in values], dtype=float)


def plot_sweep(points: Sequence[dict[str, Any]], path: Path) -> Path:
    """Throughput and goodput against p99 TTFT and p99 TPOT, one line per configuration, each
    point one request rate. `points` carry label, rate, output_throughput, goodput, p99s."""
    figure, axes = _figure(2, 2, (12, 8))
    panels = (("output_throughput", "output tokens/s"), ("goodput", "goodput (req/s)"))
    latencies = (("p99_ttft_ms", "p99 TTFT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)"))
    labels = list(dict.fromkeys(p["label"] for p in points))
    for row, (y_key, y_label) in enumerate(latencies):
        for col, (x_key, x_label) in enumerate(panels):
            ax = axes[row][col]
            for label in labels:
                line = [p for p in points if p["label"] == label
                        and p.get(x_key) is not None and p.get(y_key) is not None]
                ax.plot([p[x_key] for p in line], [p[y_key] for p in line], marker="o",
                        label=label)
                for p in line:
                    ax.annotate(str(p["rate"]), (p[x_key], p[y_key]), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle("batching forms: throughput vs tail latency (labels: request rate)")
    figure.savefig(path, dpi=100)
    return path
