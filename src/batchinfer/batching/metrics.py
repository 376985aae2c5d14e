"""Prometheus metrics of the dynamic batcher, registered on a `CollectorRegistry` passed in.

One `BatcherMetrics` per registry; several batchers share it through the `batcher` label.
`batchinfer_batch_size` belongs to the generator (sequences per step), hence `encoder_` here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0)


class BatcherMetrics:
    """Batch sizes, padding, queue time, per-lane latency, timeouts, overloads, failures."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batch_size = Histogram(
            "batchinfer_encoder_batch_size", "Items per dispatched batch",
            ["batcher"], buckets=_SIZE_BUCKETS, registry=registry)
        self.padding_ratio = Histogram(
            "batchinfer_batch_padding_ratio",
            "Padding tokens / all tokens of a batch (each item padded to the batch's longest)",
            ["batcher"], buckets=_RATIO_BUCKETS, registry=registry)
        self.batch_duration = Histogram(
            "batchinfer_encoder_batch_duration_seconds", "Time to run one batch",
            ["batcher"], buckets=_TIME_BUCKETS, registry=registry)
        self.queue_time = Histogram(
            "batchinfer_encoder_queue_time_seconds", "Time an item waited before its batch ran",
            ["batcher", "lane"], buckets=_TIME_BUCKETS, registry=registry)
        self.latency = Histogram(
            "batchinfer_encoder_request_latency_seconds",
            "Item latency from submission to result, per lane",
            ["batcher", "lane"], buckets=_TIME_BUCKETS, registry=registry)
        self.dispatches = Counter(
            "batchinfer_encoder_dispatches", "Batches dispatched, by the rule that fired",
            ["batcher", "reason"], registry=registry)
        self.timeouts = Counter(
            "batchinfer_encoder_timeouts", "Items that expired in the queue (never run)",
            ["batcher", "lane"], registry=registry)
        self.overloads = Counter(
            "batchinfer_encoder_overloads", "Submissions refused because the queue was full",
            ["batcher"], registry=registry)
        self.failures = Counter(
            "batchinfer_encoder_item_failures", "Items whose model call raised (after bisection)",
            ["batcher"], registry=registry)
        self.queue_size = Gauge(
            "batchinfer_encoder_num_items_waiting", "Items waiting in the batcher's queue",
            ["batcher"], registry=registry)
