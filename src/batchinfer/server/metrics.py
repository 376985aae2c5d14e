"""Prometheus metrics of the generative server, on a registry owned by one app.

Names follow vLLM's with the `batchinfer_` prefix (the table is in docs/server.md). Gauges and the
per-step histograms are fed by the engine thread's `SchedulerStats` (one hand-off per step);
token counts and request latencies by the per-request `RequestStats` of each processed step
(whatever output kind the request streams), timed on the engine's monotonic clock.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from batchinfer.core.outputs import QUEUE_TIMEOUT, SchedulerStats
from batchinfer.core.request import PRIORITY_CLASSES
from batchinfer.core.scheduling.scheduler import (
    PREEMPTED_KV,
    PREEMPTION_REASONS,
    PREEMPTION_WINDOW_STEPS,
)
from batchinfer.engine.outputs import RequestStats
from batchinfer.server.spec_metrics import SpecDecodeMetrics

# vLLM's buckets, so dashboards built for it read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServerMetrics:
    """The server's metrics; a `StatLogger` for `AsyncLLM` (`record_step`, `record_requests`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.num_requests_running = Gauge(
            "batchinfer_num_requests_running", "Requests in the running batch", registry=r)
        self.num_requests_waiting = Gauge(
            "batchinfer_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_cache_usage = Gauge(
            "batchinfer_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
            registry=r)
        self.num_preemptions = Counter(
            "batchinfer_num_preemptions", "Preemptions of running requests, by reason: kv_full "
            "(a running request needed a block), priority (room for a waiting request of higher "
            "priority); and by mode: what the victim's KV became (recompute: dropped, swap: "
            "copied to host memory)", ["reason", "mode"], registry=r)
        self.swap_space_usage = Gauge(
            "batchinfer_swap_space_usage_perc", "Fraction of the swap space's host blocks in "
            "use (0-1)", registry=r)
        self.swapped_blocks = Counter(
            "batchinfer_swapped_blocks", "KV blocks copied to the swap space (out) and back "
            "(in)", ["direction"], registry=r)
        self.swap_time = Counter(
            "batchinfer_swap_time_seconds", "Time the engine spent copying KV blocks to and "
            "from the swap space", registry=r)
        self.recomputed_tokens = Counter(
            "batchinfer_recomputed_tokens", "Tokens whose KV a preemption dropped, to be "
            "prefilled again", registry=r)
        self.preemption_rate = Gauge(
            "batchinfer_preemption_rate", "Preemptions per 100 engine steps over the last "
            f"{PREEMPTION_WINDOW_STEPS} steps (high: scheduling is too aggressive)", registry=r)
        self.prefix_cache_queries = Counter(
            "batchinfer_prefix_cache_queries", "Tokens looked up in the prefix cache when a "
            "request is admitted", registry=r)
        self.prefix_cache_hits = Counter(
            "batchinfer_prefix_cache_hits", "Tokens found in the prefix cache (not computed)",
            registry=r)
        self.request_queue_timeouts = Counter(
            "batchinfer_request_queue_timeouts", "Requests that left the queue unanswered "
            "after their queue time limit (503 queue_timeout)", registry=r)
        self.elastic_truncations = Counter(
            "batchinfer_elastic_truncations", "Sequences ended by an elastic max_tokens cap "
            "under KV pressure", registry=r)
        self.prompt_tokens = Counter(
            "batchinfer_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter(
            "batchinfer_generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(
            "batchinfer_request_success", "Finished sequences by finish reason",
            ["finished_reason"], registry=r)
        by_class = ["priority_class"]
        self.time_to_first_token = Histogram(
            "batchinfer_time_to_first_token_seconds", "Arrival to first token", by_class,
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "batchinfer_inter_token_latency_seconds", "Time between two tokens of a request",
            buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "batchinfer_e2e_request_latency_seconds", "Arrival to finish", by_class,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_queue_time = Histogram(
            "batchinfer_request_queue_time_seconds", "Arrival to first scheduled", by_class,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram(
            "batchinfer_iteration_tokens", "Tokens computed per engine step",
            buckets=TOKEN_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "batchinfer_batch_size", "Sequences per engine step",
            buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.spec = SpecDecodeMetrics(r)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(reason)
        for priority_class in PRIORITY_CLASSES:
            for histogram in (self.time_to_first_token, self.e2e_request_latency,
                              self.request_queue_time):
                histogram.labels(priority_class)
        for reason in PREEMPTION_REASONS:
            for mode in PREEMPTED_KV:
                self.num_preemptions.labels(reason, mode)
        for direction in ("out", "in"):
            self.swapped_blocks.labels(direction)
        # Cumulative values already counted, by name (counters take the step's increase).
        self._seen: dict[object, float] = {}
        self._last_token_s: dict[str, float] = {}  # request id -> time of its latest tokens

    def record_step(self, stats: SchedulerStats) -> None:
        """Gauges, preemptions and the per-step histograms from one engine step."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        for (reason, mode), total in stats.preemptions.items():
            self._count(self.num_preemptions.labels(reason, mode), ("preempt", reason, mode),
                        total)
        self.preemption_rate.set(stats.preemption_rate)
        self.swap_space_usage.set(stats.swap_usage)
        self._count(self.swapped_blocks.labels("out"), "out", stats.swapped_out_blocks)
        self._count(self.swapped_blocks.labels("in"), "in", stats.swapped_in_blocks)
        self._count(self.swap_time, "swap_time", stats.swap_time_s)
        self._count(self.recomputed_tokens, "recomputed", stats.recomputed_tokens)
        self._count(self.prefix_cache_queries, "queries", stats.prefix_cache_queries)
        self._count(self.prefix_cache_hits, "hits", stats.prefix_cache_hits)
        if stats.num_scheduled_seqs:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
            self.batch_size.observe(stats.num_scheduled_seqs)
        if stats.spec_decode is not None:
            self.spec.record(stats.spec_decode)

    def _count(self, counter: Counter, key: object, total: float) -> None:
        """Add to `counter` what the cumulative `total` gained since the last step."""
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[key] = total

    def record_requests(self, stats: list[RequestStats], now_s: float) -> None:
        """Token counts and request latencies from one processed step (or an abort)."""
        for request in stats:
            if request.num_new_tokens:
                self._record_tokens(request, now_s)
            if request.finish_reasons is not None:
                self._record_finished(request, now_s)

    def _record_tokens(self, request: RequestStats, now_s: float) -> None:
        self.generation_tokens.inc(request.num_new_tokens)
        last_s = self._last_token_s.get(request.request_id)
        self._last_token_s[request.request_id] = now_s
        if last_s is not None:
            self.inter_token_latency.observe(now_s - last_s)
            return
        metrics = request.metrics
        self.prompt_tokens.inc(request.num_prompt_tokens)
        first_token_s = metrics.first_token_s if metrics.first_token_s is not None else now_s
        label = request.priority_class
        self.time_to_first_token.labels(label).observe(max(0.0, first_token_s - metrics.arrival_s))
        if metrics.queue_time_s is not None:
            self.request_queue_time.labels(label).observe(max(0.0, metrics.queue_time_s))

    def _record_finished(self, request: RequestStats, now_s: float) -> None:
        self._last_token_s.pop(request.request_id, None)
        for reason in request.finish_reasons or ():
            self.request_success.labels(reason).inc()
        if request.error_code == QUEUE_TIMEOUT:
            self.request_queue_timeouts.inc()
        if request.num_elastic_truncations:
            self.elastic_truncations.inc(request.num_elastic_truncations)
        metrics = request.metrics
        finished_s = metrics.finished_s if metrics.finished_s is not None else now_s
        self.e2e_request_latency.labels(request.priority_class).observe(
            max(0.0, finished_s - metrics.arrival_s))

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
