"""`batchinfer serve`: the OpenAI-compatible HTTP server (uvicorn) on the generative engine.

Binds 127.0.0.1 unless `--host` says otherwise. The port listens at once and the model loads in
the background (`/health` answers 503 until it is ready). SIGTERM stops admission, lets running
requests finish (at most `--shutdown-timeout` seconds), then exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from batchinfer.batching.embedding_service import ENCODER_BATCHER_CONFIG
from batchinfer.cli.options import (
    add_engine_flags,
    add_ray_flags,
    collect_flags,
    end_ray_flags,
    refuse_without_ray,
)
from batchinfer.core.config import ENCODER_QUANTIZATIONS, EngineConfig, parse_bytes
from batchinfer.core.validation import check_int, check_non_negative

API_KEY_ENV = "BATCHINFER_API_KEY"
# Flags of the uvicorn front and the Batch API, which Ray Serve replaces, and their defaults.
PROXY_SIDE_FLAGS: dict[str, object] = {
    "limit_concurrency": 2048, "timeout_keep_alive": 5.0, "header_timeout": 10.0,
    "max_header_bytes": 64 << 10, "batch_dir": None, "batch_max_file_bytes": 200 << 20,
    "batch_max_in_flight": 256}


def _bytes(text: str) -> int:
    return parse_bytes("max_request_bytes", text)


def _file_bytes(text: str) -> int:
    return parse_bytes("batch_max_file_bytes", text)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible API",
        description="Serve /v1/completions, /v1/chat/completions (streaming), /v1/models, "
        "/tokenize, /detokenize, /health, /metrics and /version.",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1, this machine only)")
    server.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every route but /health "
                        "and /metrics; several keys separated by commas each own their batches "
                        f"and files (default: ${API_KEY_ENV} if set)")
    server.add_argument("--served-model-name", default=None,
                        help="model id in the API (default: the model's name); 'default' is "
                        "always accepted too")
    server.add_argument("--max-num-queued-requests", type=int, default=1024,
                        help="most requests waiting for the engine; beyond: HTTP 429 "
                        "(default: 1024)")
    server.add_argument("--max-request-bytes", type=_bytes, default=1 << 20,
                        help="largest request body; beyond: HTTP 413 (accepts 512K, 1M; "
                        "default: 1M)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for running requests (default: 30)")
    server.add_argument("--embedding-model", default=None,
                        help="also serve /v1/embeddings with this encoder: 'default', a folder "
                        "or a hub id (with --model none: embeddings only)")
    server.add_argument("--embedding-quantization", default="none",
                        choices=ENCODER_QUANTIZATIONS,
                        help="the encoder's weights: int8 (per output channel) or q8 (8-bit in "
                        "groups of 32, native CPU kernels) where the probe sentences' vectors "
                        "stay within cosine 0.999 of float32's, else float32 (default: none)")
    server.add_argument("--limit-concurrency", type=int, default=2048,
                        help="most open connections (and in-flight requests); beyond: HTTP 503 "
                        "(default: 2048)")
    server.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="seconds an idle keep-alive connection stays open (default: 5)")
    server.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection has to send a whole request head; then it "
                        "is closed (default: 10)")
    server.add_argument("--max-header-bytes", type=_bytes, default=64 << 10,
                        help="largest request head; beyond: HTTP 431 (default: 64K)")
    encoder = ENCODER_BATCHER_CONFIG
    server.add_argument("--max-client-batch-size", type=int, default=2048,
                        help="most inputs in one /v1/embeddings request; beyond: HTTP 400 "
                        "(default: 2048)")
    server.add_argument("--embedding-max-batch-size", type=int, default=encoder.max_batch_size,
                        help="encoder batcher: most items in one batch "
                        f"(default: {encoder.max_batch_size})")
    server.add_argument("--embedding-max-batch-delay-ms", type=float,
                        default=encoder.max_batch_delay_ms,
                        help="encoder batcher: dispatch once the oldest item waited this long "
                        f"(default: {encoder.max_batch_delay_ms:g})")
    server.add_argument("--embedding-max-batch-tokens", type=int,
                        default=encoder.max_batch_tokens,
                        help="encoder batcher: token budget of one padded batch "
                        f"(default: {encoder.max_batch_tokens})")
    server.add_argument("--embedding-max-queue-size", type=int, default=encoder.max_queue_size,
                        help="encoder batcher: most items waiting; beyond: HTTP 429 "
                        f"(default: {encoder.max_queue_size})")
    batch = parser.add_argument_group("Batch API (/v1/files, /v1/batches)")
    batch.add_argument("--batch-api", action=argparse.BooleanOptionalAction, default=True,
                       help="serve /v1/files and /v1/batches (default: on)")
    batch.add_argument("--batch-dir", default=None,
                       help="SQLite database and file bodies of the Batch API (default: "
                       "$BATCHINFER_CACHE/batches); one server per directory")
    batch.add_argument("--batch-max-file-bytes", type=_file_bytes, default=200 << 20,
                       help="largest upload to /v1/files (accepts 512K, 1G; default: 200M)")
    batch.add_argument("--batch-max-in-flight", type=int, default=256,
                       help="batch lines running at once, all jobs together (default: 256)")
    ray = add_ray_flags(parser, "Ray Serve", "serve through Ray Serve: replicas of this server "
                        "behind Ray's HTTP proxy on --host/--port",
                        "replicas behind Ray Serve's HTTP proxy")
    ray.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                     help="autoscale between MIN and MAX replicas instead of --num-replicas")
    ray.add_argument("--target-ongoing-requests", type=float, default=None,
                     help="autoscaling target of requests per replica (default: --max-num-seqs)")
    ray.add_argument("--ray-routing", default=None, choices=("default", "prefix"),
                     help="default: Ray Serve's power of two choices; prefix: prefer the "
                     "replica that served the same prompt start (prefix cache hits) unless it "
                     "is busier by more than --max-num-seqs (default: default)")
    ray.add_argument("--ray-metrics-export-port", type=int, default=None,
                     help="a local cluster's Prometheus export port, where every replica's "
                     "metrics are (default: one Ray picks; the log prints the URL)")
    ray.add_argument("--ray-prefix-chars", type=int, default=None,
                     help="prompt characters that --ray-routing prefix hashes (default: 256)")
    end_ray_flags(parser, ray)
    server.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))
    server.add_argument("--config", metavar="FILE",
                        help="YAML or JSON of flag names (dashes or underscores) to values, as "
                        "vLLM's --config; flags on the command line win")
    server.add_argument("--print-config", action="store_true",
                        help="print the resolved engine knobs (preset + flags) as JSON and exit")
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batchinfer.server.app import ServerConfig  # fastapi, not torch

    server_config = ServerConfig(
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_num_queued_requests=args.max_num_queued_requests,
        max_request_bytes=args.max_request_bytes,
        embedding_model=args.embedding_model,
        embedding_quantization=args.embedding_quantization,
        batch_api=args.batch_api,
        batch_dir=args.batch_dir,
        batch_max_file_bytes=args.batch_max_file_bytes,
        batch_max_in_flight=args.batch_max_in_flight,
        shutdown_timeout_s=args.shutdown_timeout,
        max_client_batch_size=args.max_client_batch_size,
        embedding_batcher=dataclasses.replace(
            ENCODER_BATCHER_CONFIG, max_batch_size=args.embedding_max_batch_size,
            max_batch_delay_ms=args.embedding_max_batch_delay_ms,
            max_batch_tokens=args.embedding_max_batch_tokens,
            max_queue_size=args.embedding_max_queue_size),
    )
    engine_kwargs = collect_flags(args, EngineConfig)
    engine_config = None
    if engine_kwargs.get("model") != "none":
        engine_config = EngineConfig.from_kwargs(**engine_kwargs)
    elif not args.embedding_model:
        raise ValueError("--model none serves nothing; add --embedding-model NAME")
    if args.print_config:
        resolved = dataclasses.asdict(engine_config) if engine_config is not None else {}
        print(json.dumps(resolved, indent=2))
        return 0

    if args.ray:
        return _serve_on_ray(args, engine_config, server_config)
    refuse_without_ray(args)

    from batchinfer.server.app import build_app
    from batchinfer.server.connections import guarded_protocol

    for name in ("limit_concurrency", "max_header_bytes"):
        check_int(name, getattr(args, name))
    for name in ("timeout_keep_alive", "header_timeout"):
        check_non_negative(name, getattr(args, name))

    # The engine's own log lines (model ready, KV cache size, failed steps) at the same level
    # as uvicorn's, in the same stream.
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("batchinfer").setLevel(args.log_level.upper())
    app = build_app(engine_config, server_config)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        http=guarded_protocol(args.header_timeout, args.max_header_bytes),
        h11_max_incomplete_event_size=args.max_header_bytes + 1024,
        limit_concurrency=args.limit_concurrency,
        timeout_keep_alive=args.timeout_keep_alive,
    )
    server = GracefulServer(config, on_exit_signal=app.state.server.begin_drain)
    app.state.server.on_fatal = server.request_exit
    server.run()
    return 1 if app.state.server.load_error else 0


def _serve_on_ray(args: argparse.Namespace, engine_config: EngineConfig | None,
                  server_config: Any) -> int:
    from batchinfer.integrations.ray_cluster import require_ray

    require_ray()
    from batchinfer.integrations.ray_serve import RayServeConfig, parse_autoscale, serve_on_ray

    if args.autoscale and args.num_replicas is not None:
        raise ValueError("give --num-replicas or --autoscale, not both")
    given = {"num_replicas": args.num_replicas,
             "autoscale": parse_autoscale(args.autoscale) if args.autoscale else None,
             "target_ongoing_requests": args.target_ongoing_requests,
             "cpus_per_replica": args.ray_cpus_per_replica, "routing": args.ray_routing,
             "prefix_chars": args.ray_prefix_chars}
    ray_config = RayServeConfig(log_level=args.log_level,
                                **{k: v for k, v in given.items() if v is not None})
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("batchinfer").setLevel(args.log_level.upper())
    for flag, default in PROXY_SIDE_FLAGS.items():
        if getattr(args, flag) != default:
            logging.getLogger(__name__).warning(
                "--%s has no effect with --ray: Ray Serve's proxy holds the connections and "
                "the Batch API is off there", flag.replace("_", "-"))
    return serve_on_ray(engine_config, server_config, ray_config, args.host, args.port,
                        args.ray_address, args.ray_metrics_export_port)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, but a signal drains and exits 0: uvicorn re-raises the signal after its
    graceful shutdown, which would make the exit status 143 instead of 0."""

    def __init__(self, config: Any, on_exit_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit_signal = on_exit_signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_exit_signal()
        super().handle_exit(sig, frame)

    def request_exit(self) -> None:
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
