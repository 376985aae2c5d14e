"""batchinfer replicas behind Ray Serve: `batchinfer serve --ray`.

Each replica (`BatchinferReplica`) is a whole batchinfer server app (`server.app.build_app`:
one `AsyncLLM`, the encoder if asked, the same routes, request models and error bodies) inside
a Ray Serve actor. Ray Serve's HTTP proxy is the front door, so clients change nothing but the
address. Behind the proxy, a light ingress deployment (`BatchinferIngress`, no CPU reserved)
reads each request and hands it to a replica through a Ray Serve handle; the replica runs it
through its app (`forward`) and streams the answer back. That hop is what lets a replica's
death end the requests it held cleanly (a 503 OpenAI-style body, or an error event and
`[DONE]` in a stream: Ray's proxy alone would answer a bare "Internal Server Error" or cut the
stream) and what lets the router see the prompt.

Two routings:
- `default`: Ray Serve's own router (power of two choices on the replicas' ongoing requests).
- `prefix`: the ingress hashes the start of each generation request's prompt (its first
  `prefix_chars` characters, or those of the chat messages' roles and texts: about the first
  few KV blocks); `PrefixAffinityRouter` (`ray_routing`) prefers the replica that hash maps to
  (rendezvous hashing over the live replicas), so requests sharing a prefix meet the replica
  whose prefix cache already holds it, unless that replica is busier than the least busy one
  by more than `max_num_seqs` requests, when load wins.

A replica's Prometheus metrics are copied every `metrics_interval_s` into Ray's metrics
(`ray.util.metrics`) with a `replica` label; Ray exports them from each node's metrics port with
its `ray_` prefix (`ray_batchinfer_num_requests_running{replica=...}`), which `batchinfer bench
serve --metrics-url` reads, summing over replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from batchinfer.core.api_errors import error_body
from batchinfer.core.config import EngineConfig
from batchinfer.integrations.ray_cluster import (
    actor_cpus,
    actor_engine_config,
    connect,
    metrics_export_urls,
    require_ray,
)
from batchinfer.integrations.ray_routing import PrefixAffinityRouter, prefix_key
from batchinfer.server.app import ServerConfig

require_ray()
from ray import serve  # noqa: E402
from ray.serve.exceptions import BackPressureError  # noqa: E402

logger = logging.getLogger(__name__)
ROUTINGS = ("default", "prefix")
REPLICA_DEPLOYMENT = "BatchinferReplica"
INGRESS_DEPLOYMENT = "BatchinferIngress"
BATCH_OFF_ON_RAY = ("the Batch API is off on Ray Serve (each replica would keep its own jobs); "
                    "run batch files with `batchinfer run-batch --ray`")


@dataclass(frozen=True, slots=True)
class RayServeConfig:
    """How the replicas are laid out; `ValueError` names a bad field."""

    num_replicas: int = 1
    autoscale: tuple[int, int] | None = None  # (min_replicas, max_replicas): autoscaling on
    target_ongoing_requests: float | None = None  # per replica, for autoscaling; default: seats
    cpus_per_replica: float | None = None  # default: the engine's num_threads, else 1
    routing: str = "default"  # default | prefix
    prefix_chars: int = 256  # the prompt's start that prefix routing hashes
    app_name: str = "batchinfer"
    metrics_interval_s: float = 2.0  # how often a replica copies its metrics into Ray's
    log_level: str = "info"  # of the replicas' batchinfer loggers
    # How long Ray Serve waits for a replica's health check (every 5 s; three misses in a row
    # and the replica is replaced).
    health_check_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.autoscale is not None:
            low, high = self.autoscale
            if not 0 <= low <= high or high < 1:
                raise ValueError(f"autoscale must be MIN:MAX with 0 <= MIN <= MAX and MAX >= 1, "
                                 f"got {low}:{high}")
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise ValueError("target_ongoing_requests must be positive")
        if self.cpus_per_replica is not None and not self.cpus_per_replica > 0:
            raise ValueError("cpus_per_replica must be positive")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, "
                             f"got {self.routing!r}")
        if self.prefix_chars < 1:
            raise ValueError("prefix_chars must be at least 1")
        if not self.metrics_interval_s > 0:
            raise ValueError("metrics_interval_s must be positive")
        if not self.health_check_timeout_s > 0:
            raise ValueError("health_check_timeout_s must be positive")


def parse_autoscale(text: str) -> tuple[int, int]:
    """'MIN:MAX' -> (MIN, MAX)."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise ValueError(f"autoscale must be MIN:MAX (e.g. 1:4), got {text!r}") from None


def replica_cpus(engine_config: EngineConfig | None, ray_config: RayServeConfig) -> float:
    return actor_cpus(engine_config, ray_config.cpus_per_replica)


def uses_gpu(engine_config: EngineConfig | None) -> bool:
    if engine_config is None or engine_config.device == "cpu":
        return False
    if engine_config.device == "cuda":
        return True
    import torch

    return bool(torch.cuda.is_available())


def max_ongoing_requests(engine_config: EngineConfig | None,
                         server_config: ServerConfig) -> int:
    """What one replica takes at once: its seats plus its queue (beyond, it would answer 429)."""
    seats = engine_config.max_num_seqs if engine_config is not None else 0
    return max(1, seats + server_config.max_num_queued_requests)


def replica_options(engine_config: EngineConfig | None, server_config: ServerConfig,
                    ray_config: RayServeConfig) -> dict[str, Any]:
    """Ray Serve deployment options of the replicas, derived from the engine's knobs."""
    seats = engine_config.max_num_seqs if engine_config is not None else 64
    options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "max_ongoing_requests": max_ongoing_requests(engine_config, server_config),
        # Requests waiting in the router for a replica with room: beyond, 429 queue_full.
        "max_queued_requests": server_config.max_num_queued_requests,
        "ray_actor_options": {"num_cpus": replica_cpus(engine_config, ray_config),
                              "num_gpus": 1 if uses_gpu(engine_config) else 0},
        "health_check_period_s": 5,
        "health_check_timeout_s": ray_config.health_check_timeout_s,
        "graceful_shutdown_timeout_s": server_config.shutdown_timeout_s or 20.0,
    }
    if ray_config.autoscale is not None:
        low, high = ray_config.autoscale
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high,
            "target_ongoing_requests": ray_config.target_ongoing_requests or seats}
    else:
        options["num_replicas"] = ray_config.num_replicas
    if ray_config.routing == "prefix":
        from ray.serve.config import RequestRouterConfig

        router: dict[str, Any] = {
            "request_router_class": f"{PrefixAffinityRouter.__module__}.PrefixAffinityRouter",
            "request_router_kwargs": {"imbalance": seats}}
        options["request_router_config"] = RequestRouterConfig(**router)
    return options


class RayMetricsBridge:
    """Copies one Prometheus registry into Ray's metrics every `interval_s`, each sample a Ray
    gauge of the same name with the sample's labels and `replica`. Counters and histogram
    series (`_bucket`, `_sum`, `_count`) keep their meaning as gauges: PromQL's `rate()` and
    `histogram_quantile()` read them the same way."""

    def __init__(self, registry: Any, replica: str, interval_s: float) -> None:
        self.registry = registry
        self.replica = replica
        self.interval_s = interval_s
        self._gauges: dict[str, tuple[Any, tuple[str, ...]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchinfer-ray-metrics",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.copy()
            except Exception:  # a metrics hiccup must never take the replica down
                logger.exception("copying metrics into Ray failed")

    def copy(self) -> int:
        """Copy every sample once; returns how many were copied."""
        from ray.util.metrics import Gauge

        copied = 0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                keys = tuple(sorted(sample.labels))
                found = self._gauges.get(sample.name)
                if found is None:
                    gauge = Gauge(sample.name, description=family.documentation or sample.name,
                                  tag_keys=(*keys, "replica"))
                    found = self._gauges[sample.name] = (gauge, keys)
                gauge, known = found
                if known != keys:
                    continue  # a label set the gauge was not made with
                gauge.set(float(sample.value), tags={**sample.labels, "replica": self.replica})
                copied += 1
        return copied


class BatchinferReplica:
    """One replica: a batchinfer server app whose lifespan (the model load) runs in the
    constructor, so Ray Serve routes to it only once it is ready. The ingress deployment hands
    it requests through `forward`."""

    async def __init__(self, engine_config: EngineConfig | None,  # type: ignore[misc]
                       server_config: ServerConfig, metrics_interval_s: float = 2.0,
                       log_level: str = "info") -> None:
        from batchinfer.server.app import build_app

        logging.getLogger("batchinfer").setLevel(log_level.upper())
        self.replica = serve.get_replica_context().replica_id.unique_id
        config = dataclasses.replace(server_config, load_before_serving=True, batch_api=False,
                                     batch_off_reason=BATCH_OFF_ON_RAY)
        self.server_app = build_app(engine_config, config)
        self.bridge = RayMetricsBridge(self.server_app.state.server.metrics.registry,
                                       self.replica, metrics_interval_s)
        self.lifespan = self.server_app.router.lifespan_context(self.server_app)
        await self.lifespan.__aenter__()
        self.bridge.start()

    async def __del__(self) -> None:
        self.bridge.stop()
        await self.lifespan.__aexit__(None, None, None)

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine stopped or failed to load."""
        _, state = self.server_app.state.server.health()
        if state in ("failed", "engine_stopped"):
            raise RuntimeError(f"batchinfer replica {self.replica}: {state}")

    async def forward(self, request: dict[str, Any], body: bytes,
                      prefix_key: str | None = None) -> AsyncIterator[Any]:
        """Run one HTTP request through this replica's app: yields ("start", status, headers,
        first body chunk), then the other chunks as the app sends them. `prefix_key` is read
        by the router only. Closing the generator (the client left) is a disconnect for the
        app."""
        del prefix_key
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            await messages.put(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "scheme": "http", "method": request["method"],
            "path": request["path"], "raw_path": request["path"].encode(), "root_path": "",
            "query_string": request.get("query_string", b""),
            "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                        for k, v in request.get("headers", [])],
            "client": tuple(request["client"]) if request.get("client") else None,
            "server": None,
        }
        task = asyncio.ensure_future(self.server_app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        start: tuple[Any, ...] | None = None
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1"))
                               for k, v in message.get("headers", [])]
                    start = ("start", message["status"], headers)
                elif message["type"] == "http.response.body":
                    chunk = bytes(message.get("body", b""))
                    more = message.get("more_body", False)
                    if start is not None:
                        # The head goes with the first body bytes: one hop fewer, and a
                        # replica that dies in between leaves the ingress free to answer 503.
                        yield (*start, chunk)
                        start = None
                    elif chunk:
                        yield chunk
                    if not more:
                        return
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
            raise RuntimeError("the app returned without a whole response")
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
                except (TimeoutError, Exception):
                    task.cancel()
            elif not task.cancelled() and task.exception() is not None:
                logger.error("request %s %s failed in the app", request["method"],
                             request["path"], exc_info=task.exception())


class BatchinferIngress:
    """The front deployment of prefix routing: reads a request, keys it, hands it to a replica
    through Ray Serve's router and streams the replica's answer back. A replica that fails
    before answering gets a 503 OpenAI-style body; one that fails mid-stream ends an event
    stream with an error event and `[DONE]`."""

    def __init__(self, replicas: Any, prefix_chars: int | None, max_request_bytes: int) -> None:
        self.replicas = replicas.options(stream=True)
        self.prefix_chars = prefix_chars
        self.max_request_bytes = max_request_bytes

    async def __serve_build_asgi_app__(self) -> Any:
        return _AsgiApp(self.asgi)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                await _send_error(send, 413, f"request body larger than "
                                  f"{self.max_request_bytes} bytes", "request_too_large")
                return
            if not message.get("more_body", False):
                break
        request = {
            "method": scope["method"], "path": scope["path"],
            "query_string": scope.get("query_string", b""),
            "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                        for k, v in scope.get("headers", [])],
            "client": list(scope["client"]) if scope.get("client") else None,
        }
        key = None  # default routing: the router needs no key
        if self.prefix_chars is not None:
            key = prefix_key(scope["path"], bytes(body), self.prefix_chars)
        answer = self.replicas.forward.remote(request, bytes(body), prefix_key=key)
        finished = False
        try:
            try:
                _, status, headers, first = await answer.__anext__()
            except BackPressureError:
                await _send_error(send, 429, "every replica's queue is full; retry later",
                                  "queue_full", {"retry-after": "1"})
                finished = True
                return
            except Exception as exc:
                logger.warning("a replica failed before answering: %r", exc)
                await _send_error(send, 503, f"the replica serving this request failed: "
                                  f"{type(exc).__name__}", "replica_unavailable")
                finished = True
                return
            # Ray's proxy adds its own X-Request-Id (the same id): keep one.
            headers = [(k, v) for k, v in headers if k.lower() != "x-request-id"]
            await send({"type": "http.response.start", "status": status,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                    for k, v in headers]})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            event_stream = any(k.lower() == "content-type" and "text/event-stream" in v
                               for k, v in headers)
            try:
                async for chunk in answer:
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("a replica failed mid-answer: %r", exc)
                if event_stream:
                    error = {"error": {"message": f"the replica serving this request failed: "
                                       f"{type(exc).__name__}",
                                       "type": "ServiceUnavailableError", "param": None,
                                       "code": "replica_unavailable"}}
                    tail = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            finished = True
        finally:
            if not finished:  # the client left, or sending to it failed: stop the replica
                answer.cancel()


class _AsgiApp:
    """An ASGI 3 app around a bound method (servers tell ASGI 2 from 3 by `__call__`)."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.handler(scope, receive, send)


async def _send_error(send: Any, status: int, message: str, code: str,
                      headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


ReplicaDeployment: Any = serve.deployment(BatchinferReplica)
IngressDeployment: Any = serve.deployment(serve.ingress()(BatchinferIngress))


def build_application(engine_config: EngineConfig | None, server_config: ServerConfig,
                      ray_config: RayServeConfig) -> Any:
    """The Ray Serve application (bound deployments) for `serve.run`."""
    if engine_config is not None:
        engine_config = actor_engine_config(engine_config,
                                            replica_cpus(engine_config, ray_config))
    replicas = ReplicaDeployment.options(
        **replica_options(engine_config, server_config, ray_config)
    ).bind(engine_config, server_config, ray_config.metrics_interval_s, ray_config.log_level)
    most = ray_config.autoscale[1] if ray_config.autoscale else ray_config.num_replicas
    return IngressDeployment.options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
        # Room for what the replicas hold plus the router's queue and one more: the request
        # past a full queue reaches the router and gets its 429, instead of waiting unseen
        # in front of the ingress.
        max_ongoing_requests=most * max_ongoing_requests(engine_config, server_config)
        + server_config.max_num_queued_requests + 1,
    ).bind(replicas, ray_config.prefix_chars if ray_config.routing == "prefix" else None,
           server_config.max_request_bytes)


def serve_on_ray(engine_config: EngineConfig | None, server_config: ServerConfig,
                 ray_config: RayServeConfig, host: str, port: int,
                 address: str | None, metrics_export_port: int | None = None) -> int:
    """`batchinfer serve --ray`: deploy, print the address, serve until SIGINT/SIGTERM, then
    take the application down (and the cluster, when this call started it).
    `metrics_export_port`: the metrics port of a local cluster this call starts."""
    init: dict[str, Any] = {}
    if metrics_export_port is not None:
        init["_metrics_export_port"] = metrics_export_port
    how = connect(address, **init)
    import ray

    # Ray's own handler would abort the process on SIGTERM: ours stop it cleanly, whether the
    # signal comes while deploying (the wait is interrupted) or while serving.
    stop = threading.Event()
    deployed = False

    def on_signal(signum: int, frame: Any) -> None:
        if deployed:
            stop.set()
        else:
            raise _Stopped(signum)

    originals = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port})
        app = build_application(engine_config, server_config, ray_config)
        try:
            serve.run(app, name=ray_config.app_name, route_prefix="/", blocking=False)
        except _Stopped:
            raise
        except Exception as exc:
            logger.error("deploying on Ray Serve failed: %s", exc)
            return 1
        try:
            _check_proxy(host, port)
        except ValueError:
            serve.delete(ray_config.app_name)
            raise
        deployed = True
        layout = (f"{ray_config.autoscale[0]}-{ray_config.autoscale[1]} replicas (autoscaling)"
                  if ray_config.autoscale else f"{ray_config.num_replicas} replica(s)")
        logger.info("batchinfer on Ray Serve: http://%s:%d (%s, routing %s); each replica's "
                    "metrics (ray_batchinfer_*, label replica) at %s", host, port, layout,
                    ray_config.routing, " ".join(metrics_export_urls()) or "Ray's export")
        while not stop.wait(1.0):
            pass
        logger.info("stopping: taking the application down")
        with contextlib.suppress(Exception):
            serve.delete(ray_config.app_name)
        return 0
    except _Stopped as stopped:
        logger.info("stopped while deploying")
        with contextlib.suppress(Exception):
            serve.delete(ray_config.app_name)
        return 130 if stopped.signum == signal.SIGINT else 0
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
        if how == "started":  # a local cluster of our own: Serve and Ray go with it
            with contextlib.suppress(Exception):
                serve.shutdown()
        if how is not None:
            ray.shutdown()


class _Stopped(BaseException):
    """A stop signal that came while deploying."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _check_proxy(host: str, port: int) -> None:
    """`ValueError` when Ray Serve's proxy does not answer on host:port: on a cluster where
    Serve already runs, its HTTP address was fixed when it first started."""
    import httpx

    probe = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    try:
        httpx.get(f"http://{probe}:{port}/-/healthz", timeout=10)
    except httpx.HTTPError:
        raise ValueError(f"Ray Serve on this cluster does not listen on {host}:{port}: its HTTP "
                         "address is set when Serve first starts on a cluster; use that one, "
                         "or `serve shutdown` first") from None
