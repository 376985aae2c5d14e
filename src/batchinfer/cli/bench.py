"""`batchinfer bench serve | sweep`: measure an OpenAI-compatible server over HTTP.

Bad input (a flag value, an unreachable server, an unknown model, a malformed dataset line)
raises `ValueError`; `cli/main.py` prints it as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import time
from typing import Any

from batchinfer.bench.arrival import parse_rate
from batchinfer.bench.config import DATASETS, ENDPOINTS, BenchConfig
from batchinfer.bench.metrics import parse_goodput
from batchinfer.bench.mix import parse_class_options, parse_mix


def register(subparsers: Any) -> None:
    """Add `bench` with its `serve` and `sweep` subcommands."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server",
                                  description=__doc__.splitlines()[0])
    commands = bench.add_subparsers(dest="bench_command", required=True)

    serve = commands.add_parser("serve", help="load-test one running server",
                                description="Load-test a running server: latency percentiles, "
                                "throughput, goodput and the server's own batch view.")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", default=None,
                       help="model name in requests (default: the first of GET /v1/models)")
    serve.add_argument("--request-rate", default="inf",
                       help="requests per second, or inf to send all at once (default inf)")
    _add_workload_args(serve)
    serve.add_argument("--result-name", default=None,
                       help="file stem of the JSON and PNGs "
                       "(default bench-<endpoint>-rate<r>-<time>)")
    serve.set_defaults(func=_run_serve)

    sweep = commands.add_parser("sweep", help="start `batchinfer serve` per batching configuration "
                                "and compare them at several request rates")
    sweep.add_argument("--batching", default="static,dynamic,continuous",
                       help="comma-separated batching forms (default static,dynamic,continuous)")
    sweep.add_argument("--request-rate", default="1,2,4,8,inf",
                       help="comma-separated request rates (default 1,2,4,8,inf)")
    sweep.add_argument("--model", default=None, help="passed to the server as --model")
    sweep.add_argument("--max-num-seqs", default=None, help="comma-separated values to sweep")
    sweep.add_argument("--max-batch-size", default=None,
                       help="comma-separated values to sweep (static and dynamic forms)")
    sweep.add_argument("--max-batch-delay-ms", default=None,
                       help="comma-separated values to sweep (dynamic form)")
    sweep.add_argument("--server-args", default="",
                       help="more flags for every server, as one quoted string")
    sweep.add_argument("--server-cmd", default=None,
                       help="command that replaces `python -m batchinfer.cli.main serve`; "
                       "it is given --host --port --batching and the engine flags")
    sweep.add_argument("--server-start-timeout-s", type=float, default=600.0)
    sweep.add_argument("--server-stop-timeout-s", type=float, default=30.0)
    _add_workload_args(sweep)
    sweep.set_defaults(func=_run_sweep)


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--endpoint", choices=ENDPOINTS, default=d.endpoint)
    parser.add_argument("--dataset", choices=DATASETS, default=d.dataset)
    parser.add_argument("--dataset-path", default=None,
                        help='JSONL file: {"prompt"|"messages", "max_tokens"} a line')
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts)
    parser.add_argument("--input-len", default=d.input_len,
                        help="tokens: N, LOW:HIGH (uniform), normal:MEAN,STD or hist:FILE")
    parser.add_argument("--output-len", default=d.output_len, help="same forms as --input-len")
    parser.add_argument("--mix", default=None, metavar="CLASS:WEIGHT,...",
                        help="priority classes, e.g. interactive:0.8,batch:0.2: each request "
                        "gets a class drawn with these weights (normalised) and sends it as "
                        "service_tier")
    parser.add_argument("--class-input-len", action="append", default=[],
                        metavar="CLASS=LEN", help="a --mix class's own --input-len, e.g. "
                        "batch=1000:2000 (repeatable)")
    parser.add_argument("--class-output-len", action="append", default=[],
                        metavar="CLASS=LEN", help="a --mix class's own --output-len (repeatable)")
    parser.add_argument("--mix-arrival", action="append", default=[], metavar="CLASS=MODE",
                        help="burst: that class's requests all arrive at time 0; rate "
                        "(default): on the --request-rate schedule (repeatable)")
    parser.add_argument("--shared-prefix-len", type=int, default=d.shared_prefix_len)
    parser.add_argument("--num-prefixes", type=int, default=d.num_prefixes)
    parser.add_argument("--burstiness", type=float, default=d.burstiness,
                        help="gamma shape of arrival intervals: 1 = Poisson, <1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight (closed loop); default unlimited")
    parser.add_argument("--num-warmups", type=int, default=d.num_warmups,
                        help="requests sent and discarded before measuring")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:100 (keys ttft, tpot, e2el)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send ignore_eos so outputs have exactly max_tokens (default on)")
    parser.add_argument("--calibrate-tokens", action="store_true",
                        help="measure tokens per word with the server's POST /tokenize")
    parser.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    parser.add_argument("--scrape-interval-s", type=float, default=d.scrape_interval_s)
    parser.add_argument("--percentile-metrics", default=",".join(d.percentile_metrics),
                        help="latencies to report, comma-separated: ttft, tpot, itl, e2el "
                        f"(default: {','.join(d.percentile_metrics)})")
    parser.add_argument("--metric-percentiles", default=",".join(
                            f"{p:g}" for p in d.metric_percentiles),
                        help="percentiles to report, comma-separated (default: "
                        f"{','.join(f'{p:g}' for p in d.metric_percentiles)}); both flags as "
                        "vllm bench serve's, and the JSON has its flat keys (p99_ttft_ms)")
    parser.add_argument("--metrics-url", default=None,
                        help="scrape server metrics here (default: BASE_URL/metrics); behind "
                        "Ray Serve, Ray's metrics export: series summed over replicas")
    parser.add_argument("--result-dir", default=None, help="where to write JSON and PNGs")
    parser.add_argument("--no-plots", dest="plots", action="store_false")
    parser.add_argument("--no-progress", dest="show_progress", action="store_false")


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: expected numbers such as "
                         "50,90,99") from None


def _bench_config(args: argparse.Namespace, **overrides: Any) -> BenchConfig:
    fields: dict[str, Any] = {
        name: getattr(args, name) for name in (
            "endpoint", "dataset", "dataset_path", "num_prompts", "input_len", "output_len",
            "shared_prefix_len", "num_prefixes", "burstiness", "max_concurrency", "num_warmups",
            "seed", "ignore_eos", "calibrate_tokens", "request_timeout_s", "scrape_interval_s",
            "metrics_url", "result_dir", "plots", "show_progress")
    }
    fields["goodput_slos_ms"] = parse_goodput(args.goodput)
    fields["percentile_metrics"] = tuple(
        name.strip() for name in args.percentile_metrics.split(",") if name.strip())
    fields["metric_percentiles"] = parse_percentiles(args.metric_percentiles)
    fields["mix"] = parse_mix(args.mix) if args.mix is not None else {}
    for name in ("class_input_len", "class_output_len", "mix_arrival"):
        fields[name] = parse_class_options(getattr(args, name), "--" + name.replace("_", "-"))
    fields.update(overrides)
    return BenchConfig(**fields)


def _run_serve(args: argparse.Namespace) -> int:
    from batchinfer.bench.serve import bench_serve

    config = _bench_config(args, base_url=args.base_url, model=args.model,
                           request_rate=parse_rate(args.request_rate),
                           result_name=args.result_name)
    result = bench_serve(config)
    return 0 if result.metrics.completed > 0 else 1


def _run_sweep(args: argparse.Namespace) -> int:
    from batchinfer.bench.sweep import SERVE_COMMAND, SweepConfig, run_sweep

    result_dir = args.result_dir or f"results/sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep = SweepConfig(
        bench=_bench_config(args),
        result_dir=result_dir,
        batching=tuple(_split(args.batching, str, "--batching")),
        request_rates=tuple(parse_rate(r) for r in _split(args.request_rate, str,
                                                          "--request-rate")),
        model=args.model,
        max_num_seqs=tuple(_split(args.max_num_seqs, int, "--max-num-seqs")),
        max_batch_size=tuple(_split(args.max_batch_size, int, "--max-batch-size")),
        max_batch_delay_ms=tuple(_split(args.max_batch_delay_ms, float, "--max-batch-delay-ms")),
        server_args=tuple(shlex.split(args.server_args)),
        server_cmd=tuple(shlex.split(args.server_cmd)) if args.server_cmd else SERVE_COMMAND,
        server_start_timeout_s=args.server_start_timeout_s,
        server_stop_timeout_s=args.server_stop_timeout_s,
    )
    # SIGTERM (from `timeout`, a job runner) unwinds like Ctrl-C, so the server is stopped too.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        points = run_sweep(sweep)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if any(p["completed"] > 0 for p in points) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _split(text: str | None, kind: type, flag: str) -> list[Any]:
    if not text:
        return []
    try:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated {kind.__name__} values") \
            from None
