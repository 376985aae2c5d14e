"""The load generator: warm-up, then the measured requests on their arrival schedule.

Order of a run: find and check the model at `/v1/models` (a bad URL or model fails here with a
one-line cause; a server without that route gets one short test request instead), optionally
calibrate prompt lengths with `/tokenize`, send the warm-up requests and discard them, then
start scraping `/metrics` and send the measured requests.
All requests share one `httpx.AsyncClient` with a connection for every request in flight (see
`transport.py`), so no request waits for a connection inside the client and TTFT is the server's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from batchinfer.bench.arrival import burst_arrival_times
from batchinfer.bench.client import (
    ENDPOINT_PATHS,
    RequestResult,
    build_request,
    calibrate_tokens_per_word,
    check_server,
    request_body,
    resolve_model,
    send_request,
    served_models,
)
from batchinfer.bench.config import BenchConfig
from batchinfer.bench.metrics import BenchMetrics, compute_class_metrics, compute_metrics
from batchinfer.bench.mix import assign_classes
from batchinfer.bench.scrape import MetricsScraper, ServerSample, ServerSummary, summarize_server
from batchinfer.bench.transport import make_client
from batchinfer.bench.workload import (
    BenchRequest,
    ClassLengths,
    Lengths,
    LengthSpec,
    jsonl_workload,
    parse_length_spec,
    shared_prefix_workload,
    synthetic_workload,
)


@dataclass(slots=True)
class BenchResult:
    """Everything one run measured; `start_s` is the perf_counter origin of the timelines.
    `class_metrics` has the metrics of each `--mix` class (empty without a mix)."""

    config: BenchConfig
    model: str
    tokens_per_word: float
    start_s: float
    metrics: BenchMetrics
    results: list[RequestResult]
    server_samples: list[ServerSample]
    server: ServerSummary | None
    num_warmup_failed: int
    class_metrics: dict[str, BenchMetrics] = dataclasses.field(default_factory=dict)


def build_workload(
    config: BenchConfig, num_requests: int, seed: int, tokens_per_word: float = 1.0
) -> list[BenchRequest]:
    """The prompts of `config.dataset`, reproducible from `seed`; with `config.mix`, each of a
    class drawn from the mix, with that class's lengths."""
    classes = assign_classes(config.mix, num_requests, seed)
    requests = _dataset(config, num_requests, seed, tokens_per_word, classes)
    return [dataclasses.replace(r, request_class=c)
            for r, c in zip(requests, classes, strict=True)] if classes else requests


def _dataset(
    config: BenchConfig, num_requests: int, seed: int, tokens_per_word: float, classes: list[str]
) -> list[BenchRequest]:
    output_spec = parse_length_spec(config.output_len, "--output-len")
    if config.dataset == "jsonl":
        return jsonl_workload(Path(str(config.dataset_path)), num_requests, output_spec, seed)
    input_len = _lengths(parse_length_spec(config.input_len, "--input-len"),
                         config.class_input_len, classes, "--class-input-len")
    output_len = _lengths(output_spec, config.class_output_len, classes, "--class-output-len")
    if config.dataset == "shared-prefix":
        return shared_prefix_workload(num_requests, config.shared_prefix_len,
                                      config.num_prefixes, input_len, output_len, seed,
                                      tokens_per_word)
    return synthetic_workload(num_requests, input_len, output_len, seed, tokens_per_word)


def _lengths(
    default: LengthSpec, overrides: dict[str, str], classes: list[str], flag: str
) -> Lengths:
    if not overrides:
        return default
    specs = {name: parse_length_spec(text, f"{flag} {name}") for name, text in overrides.items()}
    return ClassLengths(tuple(classes), default, specs)


async def run_benchmark(
    config: BenchConfig,
    on_request_done: Callable[[RequestResult], None] | None = None,
    on_measure_start: Callable[[], None] | None = None,
) -> BenchResult:
    """Run one benchmark against `config.base_url`. `on_measure_start` is called once the
    warm-ups are done, `on_request_done` with each measured result as it finishes (the progress
    bar). Raises `ValueError` if the server cannot be used."""
    max_in_flight = max(config.max_concurrency or config.num_prompts, config.num_warmups, 1)
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0, pool=None)
    # Built first, so a bad dataset is reported before the server is contacted.
    measured = build_workload(config, config.num_prompts, config.seed)
    async with make_client(max_in_flight, timeout) as client:
        served = await served_models(client, config.base_url)
        model = resolve_model(config.model, served, config.base_url)
        tokens_per_word = 1.0
        if config.calibrate_tokens:
            tokens_per_word = await calibrate_tokens_per_word(client, config.base_url, model) or 1.0
            measured = build_workload(config, config.num_prompts, config.seed, tokens_per_word)
        url = config.base_url + ENDPOINT_PATHS[config.endpoint]
        num_warmup_failed = await _check_and_warm_up(client, config, url, model,
                                                     tokens_per_word, probe=served is None)
        measured, arrivals = _schedule(config, measured)
        http_requests = _http_requests(client, url, measured, config, model)
        scraper = MetricsScraper(config.base_url, config.scrape_interval_s,
                                 config.metrics_url)
        if on_measure_start is not None:
            on_measure_start()
        scraper.start()
        start_s = time.perf_counter()
        results = await _send_all(client, http_requests, measured, arrivals,
                                  config.max_concurrency, on_request_done)
        duration_s = time.perf_counter() - start_s
        await scraper.stop()
    metrics = compute_metrics(results, duration_s, start_s, config.goodput_slos_ms)
    class_metrics = compute_class_metrics(results, list(config.mix), duration_s, start_s,
                                          config.goodput_slos_ms)
    return BenchResult(
        config=config,
        model=model,
        tokens_per_word=tokens_per_word,
        start_s=start_s,
        metrics=metrics,
        results=results,
        server_samples=scraper.samples,
        server=summarize_server(scraper.samples, start_s),
        num_warmup_failed=num_warmup_failed,
        class_metrics=class_metrics,
    )


def _schedule(
    config: BenchConfig, requests: list[BenchRequest]
) -> tuple[list[BenchRequest], list[float]]:
    """The requests in the order they are sent, with their send times: the classes of
    `--mix-arrival CLASS=burst` at 0, the others on the `--request-rate` schedule."""
    bursts = {name for name, mode in config.mix_arrival.items() if mode == "burst"}
    arrivals = burst_arrival_times([r.request_class in bursts for r in requests],
                                   config.request_rate, config.burstiness, config.seed)
    order = sorted(range(len(requests)), key=arrivals.__getitem__)  # stable: ties keep order
    return [requests[i] for i in order], [arrivals[i] for i in order]


async def _check_and_warm_up(
    client: httpx.AsyncClient, config: BenchConfig, url: str, model: str,
    tokens_per_word: float, probe: bool,
) -> int:
    """Send the test request (if `probe`) and the warm-ups; return how many warm-ups failed."""
    # Warm-ups come from another seed, so they do not fill a prefix cache for measured ones.
    warmups = build_workload(config, max(1, config.num_warmups), config.seed + 1, tokens_per_word)
    if probe:
        # No model list to check against: one short request finds a bad model or route. Not
        # sent otherwise: a static-batching server would hold a lone request for a batch.
        short = dataclasses.replace(warmups[0], max_tokens=1)
        await check_server(client, url, request_body(short, config.endpoint, model), model)
    warmups = warmups[: config.num_warmups]
    results = await _send_all(client, _http_requests(client, url, warmups, config, model),
                              warmups, [0.0] * len(warmups), config.max_concurrency, None)
    return sum(not r.success for r in results)


def _http_requests(
    client: httpx.AsyncClient, url: str, requests: Sequence[BenchRequest], config: BenchConfig,
    model: str,
) -> list[httpx.Request]:
    # Built before the clock starts, so dispatch costs one task a request and nothing more.
    return [build_request(client, url, request_body(r, config.endpoint, model, config.ignore_eos))
            for r in requests]


async def _send_all(
    client: httpx.AsyncClient,
    http_requests: Sequence[httpx.Request],
    requests: Sequence[BenchRequest],
    arrivals_s: Sequence[float],
    max_concurrency: int | None,
    on_done: Callable[[RequestResult], None] | None,
) -> list[RequestResult]:
    """Send each request at its arrival time (from now); at most `max_concurrency` in flight, the
    rest wait for a slot after arriving (a closed loop, as in vLLM)."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(http_request: httpx.Request, request: BenchRequest) -> RequestResult:
        if semaphore is None:
            result = await send_request(client, http_request)
        else:
            async with semaphore:
                result = await send_request(client, http_request)
        result.num_prompt_tokens_est = request.num_prompt_tokens_est
        result.request_class = request.request_class
        if on_done is not None:
            on_done(result)
        return result

    origin = time.perf_counter()
    tasks = []
    for http_request, request, at_s in zip(http_requests, requests, arrivals_s, strict=True):
        delay = origin + at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(http_request, request)))
    return list(await asyncio.gather(*tasks))
