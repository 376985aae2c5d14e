"""The configuration of one benchmark run: every knob a named, validated field (= CLI flag)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from batchinfer.bench.arrival import check_arrivals
from batchinfer.bench.mix import check_class_options, check_mix
from batchinfer.bench.workload import parse_length_spec
from batchinfer.core.validation import check_choice, check_int

ENDPOINTS = ("completions", "chat")
DATASETS = ("random", "shared-prefix", "jsonl")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class BenchConfig:
    """One `batchinfer bench serve` run. Invalid values raise `ValueError` naming the flag."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: str = "completions"
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 200
    input_len: str = "256"
    output_len: str = "128"
    shared_prefix_len: int = 256
    num_prefixes: int = 1
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    ignore_eos: bool = True
    calibrate_tokens: bool = False
    request_timeout_s: float = 600.0
    scrape_interval_s: float = 0.5
    # Where the server-side metrics come from; None: {base_url}/metrics. Behind Ray Serve:
    # Ray's metrics export (http://HEAD:METRICS_PORT/metrics), every replica's series summed.
    metrics_url: str | None = None
    # As `vllm bench serve`: the latencies (ttft, tpot, itl, e2el) and percentiles reported in
    # the latency table and written as flat keys (`p99_ttft_ms`) in the JSON result.
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    metric_percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)
    result_dir: str | None = None
    result_name: str | None = None  # file stem; default bench-<endpoint>-rate<r>-<time>
    plots: bool = True
    show_progress: bool = True
    # Priority classes (see `mix.py`): class -> probability (weights are normalised), and per
    # class: a length spec (else --input-len / --output-len), an arrival mode (else "rate").
    mix: dict[str, float] = field(default_factory=dict)
    class_input_len: dict[str, str] = field(default_factory=dict)
    class_output_len: dict[str, str] = field(default_factory=dict)
    mix_arrival: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url {self.base_url!r}: expected http://HOST:PORT")
        check_choice("--endpoint", self.endpoint, ENDPOINTS)
        check_choice("--dataset", self.dataset, DATASETS)
        if self.dataset == "jsonl" and not self.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path")
        check_int("--num-prompts", self.num_prompts)
        check_int("--num-warmups", self.num_warmups, low=0)
        check_int("--seed", self.seed, low=0)
        check_int("--shared-prefix-len", self.shared_prefix_len)
        check_int("--num-prefixes", self.num_prefixes)
        if self.max_concurrency is not None:
            check_int("--max-concurrency", self.max_concurrency)
        check_arrivals(self.request_rate, self.burstiness)
        if not self.request_timeout_s > 0:
            raise ValueError("--request-timeout-s must be > 0")
        if not self.scrape_interval_s > 0:
            raise ValueError("--scrape-interval-s must be > 0")
        for name in self.percentile_metrics:
            check_choice("--percentile-metrics", name, PERCENTILE_METRICS)
        if not self.percentile_metrics:
            raise ValueError("--percentile-metrics must name at least one metric")
        for p in self.metric_percentiles:
            if not 0 < p <= 100:
                raise ValueError(f"--metric-percentiles: {p:g} is not in (0, 100]")
        if self.metrics_url is not None and not self.metrics_url.startswith(
                ("http://", "https://")):
            raise ValueError(f"--metrics-url {self.metrics_url!r}: expected "
                             "http://HOST:PORT/PATH")
        parse_length_spec(self.input_len, "--input-len")
        parse_length_spec(self.output_len, "--output-len")
        object.__setattr__(self, "mix", check_mix(self.mix))
        check_class_options(self.mix, self.class_input_len, self.class_output_len,
                            self.mix_arrival)
        if self.dataset == "jsonl" and (self.class_input_len or self.class_output_len):
            raise ValueError("--class-input-len and --class-output-len need --dataset random "
                             "or shared-prefix (a JSONL file has its own prompts)")

    def to_json(self) -> dict[str, Any]:
        """All fields, JSON-safe (an infinite rate is written as the string "inf")."""
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        if math.isinf(self.request_rate):
            data["request_rate"] = "inf"
        return data
