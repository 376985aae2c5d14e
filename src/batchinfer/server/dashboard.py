"""The live dashboard: `GET /dashboard` (one page, no external resources) refreshing every
second from `GET /dashboard/data` (JSON of recent samples).

`DashboardRecorder` is a stat logger of the engine (`record_step`, `record_requests`, both
called on the server's loop, as the route that reads it): per-second buckets of the last
`HISTORY_S` seconds (steps, sequences and tokens per step: the real batch size, requests
running and waiting, KV usage, preemption rate, output tokens; with speculative decoding the
depth the steps chose and the share of proposed tokens accepted), and the last
`LATENCY_WINDOW_S` seconds of TTFT and ITL samples, by priority class. Both routes are behind
`--api-key` like the rest; a browser, which cannot send the header, opens
`/dashboard?api_key=KEY` once: the page is answered with a redirect to `/dashboard` that sets
the key as an HttpOnly, same-site cookie for these two paths, so the key is not repeated in
every refresh's address (nor in access logs).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import numpy as np

from batchinfer.core.outputs import SchedulerStats
from batchinfer.engine.outputs import RequestStats

if TYPE_CHECKING:
    from batchinfer.core.config import EngineConfig

HISTORY_S = 300  # seconds of per-second history
LATENCY_WINDOW_S = 60.0  # TTFT / ITL percentiles over this window
DASHBOARD_PATHS = ("/dashboard", "/dashboard/data")
DASHBOARD_COOKIE = "batchinfer_dashboard_key"


@dataclass(slots=True)
class Second:
    """One second of engine activity."""

    second: int
    steps: int = 0
    seqs: int = 0
    tokens: int = 0
    output_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    preemption_rate: float = 0.0
    # Speculative decoding: the depths the steps chose (summed), tokens proposed and accepted.
    spec_depth: float = 0.0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class DashboardRecorder:
    """Recent engine activity for the dashboard (a stat logger, see the module docstring)."""

    def __init__(self) -> None:
        self.seconds: deque[Second] = deque(maxlen=HISTORY_S)
        self.ttfts: deque[tuple[float, float, str]] = deque()  # (time, seconds, class)
        self.itls: deque[tuple[float, float, str]] = deque()
        self._last_token_s: dict[str, float] = {}
        self._spec_totals = (0, 0)  # cumulative (proposed, accepted) tokens already counted

    def _at(self, time_s: float) -> Second:
        second = int(time_s)
        if not self.seconds or self.seconds[-1].second < second:
            last = self.seconds[-1] if self.seconds else None
            bucket = Second(second)
            if last is not None:  # gauges hold their value until a step says otherwise
                bucket.running, bucket.waiting = last.running, last.waiting
                bucket.kv_usage, bucket.preemption_rate = last.kv_usage, last.preemption_rate
            self.seconds.append(bucket)
        return self.seconds[-1]

    def record_step(self, stats: SchedulerStats) -> None:
        bucket = self._at(stats.time_s)
        if stats.num_scheduled_seqs:
            bucket.steps += 1
            bucket.seqs += stats.num_scheduled_seqs
            bucket.tokens += stats.num_scheduled_tokens
        bucket.running, bucket.waiting = stats.num_running, stats.num_waiting
        bucket.kv_usage, bucket.preemption_rate = stats.kv_cache_usage, stats.preemption_rate
        spec = stats.spec_decode
        if spec is not None and stats.num_scheduled_seqs:
            bucket.spec_depth += spec.depth
            drafted, accepted = self._spec_totals
            bucket.spec_draft_tokens += spec.num_draft_tokens - drafted
            bucket.spec_accepted_tokens += spec.num_accepted_tokens - accepted
            self._spec_totals = (spec.num_draft_tokens, spec.num_accepted_tokens)

    def record_requests(self, stats: list[RequestStats], now_s: float) -> None:
        for request in stats:
            if request.num_new_tokens:
                self._at(now_s).output_tokens += request.num_new_tokens
                last_s = self._last_token_s.get(request.request_id)
                self._last_token_s[request.request_id] = now_s
                if last_s is not None:
                    self.itls.append((now_s, now_s - last_s, request.priority_class))
                else:
                    metrics = request.metrics
                    first_s = metrics.first_token_s if metrics.first_token_s is not None \
                        else now_s
                    self.ttfts.append((now_s, max(0.0, first_s - metrics.arrival_s),
                                       request.priority_class))
            if request.finish_reasons is not None:
                self._last_token_s.pop(request.request_id, None)
        self._trim(now_s)

    def _trim(self, now_s: float) -> None:
        for samples in (self.ttfts, self.itls):
            while samples and samples[0][0] < now_s - LATENCY_WINDOW_S:
                samples.popleft()

    def _filled(self, now_s: float) -> list[Second]:
        """The buckets of the window, a quiet second (no step: an idle engine) as zero work
        with the gauges of the second before."""
        rows: list[Second] = []

        def quiet_until(second: int) -> None:
            while rows and rows[-1].second + 1 < second:
                last = rows[-1]
                rows.append(Second(last.second + 1, running=last.running, waiting=last.waiting,
                                   kv_usage=last.kv_usage, preemption_rate=last.preemption_rate))

        for bucket in self.seconds:
            if bucket.second > now_s - HISTORY_S:
                quiet_until(bucket.second)
                rows.append(bucket)
        quiet_until(int(now_s))
        return rows

    def snapshot(self, now_s: float, config: EngineConfig | None) -> dict[str, Any]:
        """The JSON of `/dashboard/data`: series over the last seconds (time relative to now),
        latency percentiles over the last minute, overall and per class, and the limits the
        charts draw (seats, watermarks)."""
        self._trim(now_s)
        rows = self._filled(now_s)
        series: dict[str, list[float | None]] = {
            "t": [b.second - now_s for b in rows],
            "batch_size": [b.seqs / b.steps if b.steps else None for b in rows],
            "tokens_per_step": [b.tokens / b.steps if b.steps else None for b in rows],
            "steps_per_s": [float(b.steps) for b in rows],
            "running": [float(b.running) for b in rows],
            "waiting": [float(b.waiting) for b in rows],
            "kv_usage": [b.kv_usage for b in rows],
            "preemption_rate": [b.preemption_rate for b in rows],
            "output_tok_s": [float(b.output_tokens) for b in rows],
            "spec_depth": [b.spec_depth / b.steps if b.steps else None for b in rows],
            "spec_acceptance": [b.spec_accepted_tokens / b.spec_draft_tokens
                                if b.spec_draft_tokens else None for b in rows],
        }
        classes = sorted({c for _, _, c in self.ttfts} | {c for _, _, c in self.itls})
        latency = {"all": _percentiles(self.ttfts, self.itls, None)}
        for name in classes:
            latency[name] = _percentiles(self.ttfts, self.itls, name)
        limits: dict[str, Any] = {}
        if config is not None:
            limits = {"max_num_seqs": config.max_num_seqs,
                      "max_num_batched_tokens": config.max_num_batched_tokens,
                      "kv_admission_watermark": config.kv_admission_watermark,
                      "kv_soft_watermark": config.kv_soft_watermark,
                      "batching": config.batching,
                      "scheduling_policy": config.scheduling_policy,
                      "speculative_method": config.speculative_method,
                      "max_speculative_tokens": config.max_speculative_tokens}
        return {"window_s": HISTORY_S, "latency_window_s": LATENCY_WINDOW_S, "series": series,
                "latency": latency, "limits": limits}


def _percentiles(ttfts: deque[tuple[float, float, str]], itls: deque[tuple[float, float, str]],
                 name: str | None) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {}
    for key, samples in (("ttft", ttfts), ("itl", itls)):
        values = [v for _, v, c in samples if name is None or c == name]
        out[f"{key}_count"] = len(values)
        for p in (50, 99):
            out[f"{key}_p{p}_ms"] = float(np.percentile(values, p)) * 1000 if values else None
    return out


def page() -> str:
    """The dashboard's HTML (with its script and styles inline)."""
    return resources.files("batchinfer.server").joinpath("dashboard.html").read_text("utf-8")
