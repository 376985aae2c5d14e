"""The FastAPI app: OpenAI-compatible routes, `/health`, `/metrics`, the server's state.

`build_app(engine_config, server_config)` returns an app whose lifespan starts loading the model
in a background thread, so the port answers at once: `/health` is 503 until the engine is ready
(and again while shutting down). Every request passes `guard.RequestGuard` first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from batchinfer import __version__
from batchinfer.batching.config import BatcherConfig
from batchinfer.batching.embedding_service import ENCODER_BATCHER_CONFIG, EmbeddingConfig
from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import SchedulerStats
from batchinfer.core.paths import default_cache_dir
from batchinfer.core.validation import check_int, check_non_negative
from batchinfer.engine.async_llm import AsyncLLM
from batchinfer.engine.outputs import RequestStats
from batchinfer.server.dashboard import DASHBOARD_COOKIE, DashboardRecorder
from batchinfer.server.errors import APIError, install_error_handlers
from batchinfer.server.guard import RequestGuard
from batchinfer.server.metrics import ServerMetrics
from batchinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from batchinfer.server.serving import RETRY_AFTER_S, OpenAIServing

if TYPE_CHECKING:
    from batchinfer.server.batches import BatchAPI

logger = logging.getLogger(__name__)
DEFAULT_MODEL_ALIAS = "default"
# Unfinished requests are cut this long (at most a quarter of the timeout) before
# --shutdown-timeout ends, so their last chunks are written before connections close.
CUT_MARGIN_S = 0.5


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Server knobs (the engine's are `EngineConfig`); `ValueError` names a bad field."""

    served_model_name: str | None = None  # default: the loaded model's name
    api_key: str | None = None  # one key, or several separated by commas (each owns its batches)
    max_num_queued_requests: int = 1024
    max_request_bytes: int = 1 << 20
    embedding_model: str | None = None
    embedding_quantization: str = "none"  # the encoder's weights: none | int8 | q8
    max_client_batch_size: int = 2048  # most inputs in one /v1/embeddings request
    embedding_batcher: BatcherConfig = ENCODER_BATCHER_CONFIG  # the encoder's dynamic batcher
    # After a drain signal, requests still running this long before the server stops waiting
    # for them are cut (each ends cleanly: finish_reason "abort"); None: never cut.
    shutdown_timeout_s: float | None = None
    # The Batch API (/v1/files, /v1/batches): on in `batchinfer serve`, off by default here so
    # that an app built in process (run-batch, tests) never opens a server's job store.
    batch_api: bool = False
    # The Batch API's SQLite database and file bodies; None: $BATCHINFER_CACHE/batches.
    batch_dir: str | None = None
    batch_max_file_bytes: int = 200 << 20  # largest upload to /v1/files
    batch_max_in_flight: int = 256  # batch lines running at once, all jobs together
    # Load the models before the app starts serving (its lifespan start-up waits, and fails if
    # loading fails) instead of in the background behind a 503 /health: what a replica behind
    # a router wants, since the router only sends traffic to replicas that finished starting.
    load_before_serving: bool = False
    # Why the Batch API is off, when it is (shown in its 503 answers).
    batch_off_reason: str = "the Batch API is off on this server (batchinfer serve turns it on)"

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())

    def __post_init__(self) -> None:
        if self.shutdown_timeout_s is not None:
            check_non_negative("shutdown_timeout_s", self.shutdown_timeout_s)
        check_int("max_num_queued_requests", self.max_num_queued_requests)
        check_int("max_client_batch_size", self.max_client_batch_size)
        check_int("max_request_bytes", self.max_request_bytes)
        check_int("batch_max_file_bytes", self.batch_max_file_bytes)
        check_int("batch_max_in_flight", self.batch_max_in_flight)
        if self.api_key is not None and not self.api_keys:
            raise ValueError("api_key must hold at least one non-empty key")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")


class ServerState:
    """What the routes share: the engine once loaded, the metrics, the lifecycle flags."""

    def __init__(self, engine_config: EngineConfig | None, config: ServerConfig) -> None:
        self.engine_config = engine_config
        self.config = config
        self.metrics = ServerMetrics()
        self.dashboard = DashboardRecorder()
        self.llm: AsyncLLM | None = None
        self.serving: OpenAIServing | None = None
        self.model_names: set[str] = set()
        self.load_error: str | None = None
        self.embeddings = DeferredService("the embedding model")
        self.ready = False
        self.draining = False
        self.on_fatal: Callable[[], None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.batch_api: BatchAPI | None = None
        self.engine_load = EngineLoad()
        self.batch_error = config.batch_off_reason

    def open_batch_api(self, app: FastAPI) -> None:
        """Open the Batch API's store and resume the jobs left unfinished; a store held by
        another server leaves the API off (503 with the reason), the rest of the server on."""
        from batchinfer.server.batches import BatchAPI

        root = Path(self.config.batch_dir) if self.config.batch_dir else \
            default_cache_dir() / "batches"
        # Batch lines in the engine at once: at most its seats, so none waits in its queue.
        in_flight = self.config.batch_max_in_flight
        if self.engine_config is not None:
            in_flight = min(in_flight, self.engine_config.max_num_seqs)
        try:
            self.batch_api = BatchAPI(root, app, in_flight, self.wait_ready,
                                      self.engine_load.room)
        except (ValueError, OSError) as exc:
            self.batch_error = f"the Batch API is off: {exc}"
            logger.warning("%s", self.batch_error)
            return
        self.batch_api.manager.start()
        if self.engine_config is not None and self.engine_config.scheduling_policy == "fcfs":
            logger.info("Batch API: batch lines fill only the seats interactive requests leave; "
                        "with --scheduling-policy priority (or --preset interactive) an "
                        "interactive request may also preempt a running batch line")

    def get_batch_api(self) -> BatchAPI:
        if self.batch_api is None:
            raise APIError(503, self.batch_error, code="batch_api_unavailable")
        return self.batch_api

    async def wait_ready(self) -> bool:
        """True once the model is loaded; False if loading failed (no batch line can run)."""
        while not self.ready:
            if self.load_error is not None:
                return False
            await asyncio.sleep(0.2)
        return True

    def begin_drain(self) -> None:
        """Stop admitting requests (503); running ones go on, until just before the shutdown
        timeout, when the rest are cut so that each still gets a final answer (a last chunk
        with finish_reason "abort" and [DONE]) before the server closes its connections.
        Safe to call from a signal handler."""
        self.draining = True
        if self.batch_api is not None and self.loop is not None:
            # Batch jobs stop first (their unfinished lines rerun at the next start).
            self.loop.call_soon_threadsafe(asyncio.ensure_future, self.batch_api.manager.close())
        timeout_s = self.config.shutdown_timeout_s
        if timeout_s is not None and self.loop is not None:
            delay_s = max(0.0, timeout_s - min(CUT_MARGIN_S, timeout_s / 4))
            self.loop.call_soon_threadsafe(self.loop.call_later, delay_s, self._cut_remaining)

    def _cut_remaining(self) -> None:
        if self.llm is None:
            return
        num_cut = self.llm.abort_all()
        if num_cut:
            logger.warning("shutdown: cut %d unfinished request(s) at --shutdown-timeout",
                           num_cut)

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """Build the engine and the embedding service (in a background thread); hand them to
        the loop."""
        try:
            llm = embedder = None
            if self.engine_config is not None:
                llm = AsyncLLM.from_config(
                    self.engine_config, max_num_queued_requests=self.config.max_num_queued_requests
                )
            if self.config.embedding_model is not None:
                from batchinfer.server.embeddings import make_embeddings_service

                embedder = make_embeddings_service(
                    self.config.embedding_model, registry=self.metrics.registry,
                    config=EmbeddingConfig(max_client_batch_size=self.config.max_client_batch_size,
                                           quantization=self.config.embedding_quantization),
                    batcher_config=self.config.embedding_batcher)
        except Exception as exc:
            logger.exception("loading the model failed")
            _hand_over(loop, self._failed, f"{type(exc).__name__}: {exc}")
            return
        _hand_over(loop, self._ready, llm, embedder)

    def _ready(self, llm: AsyncLLM | None, embedder: Any) -> None:
        try:
            self._start(llm, embedder)
        except Exception as exc:  # e.g. the engine thread would not start: a failed load
            logger.exception("starting the engine failed")
            self._failed(f"{type(exc).__name__}: {exc}")

    def _start(self, llm: AsyncLLM | None, embedder: Any) -> None:
        if embedder is not None:
            self.embeddings.target = embedder
        if llm is not None:
            llm.stat_loggers.append(self.metrics)
            llm.stat_loggers.append(self.engine_load)
            llm.stat_loggers.append(self.dashboard)
            self.engine_load.llm = llm
            llm.start()
            self.llm = llm
            name = self.config.served_model_name or llm.engine.model_name
            self.serving = OpenAIServing(llm, name)
            self.model_names = {name, DEFAULT_MODEL_ALIAS, llm.engine.config.model}
            logger.info("model %s is ready (max_model_len %d)", name, llm.max_model_len)
        self.ready = True

    def _failed(self, message: str) -> None:
        self.load_error = message
        if self.on_fatal is not None:
            self.on_fatal()

    async def close(self) -> None:
        self.draining = True
        if self.batch_api is not None:
            await self.batch_api.close()
        if self.llm is not None:
            self.llm.shutdown()
        if self.embeddings.target is not None:
            await self.embeddings.target.close()

    def health(self) -> tuple[int, str]:
        if self.draining:
            return 503, "shutting_down"
        if self.load_error is not None:
            return 503, "failed"
        if not self.ready:
            return 503, "loading"
        if self.llm is not None and not self.llm.is_running:
            return 503, "engine_stopped"
        return 200, "ok"

    def serving_for(self, model: str | None) -> OpenAIServing:
        """The serving of `model` (None: the default); 503 while loading, 404 if unknown."""
        if self.serving is None:
            _, state = self.health()
            if self.engine_config is None:
                raise APIError(404, "no generative model is served here", param="model",
                               code="model_not_found")
            raise APIError(503, f"the model is not ready ({state})", code=state,
                           headers={"retry-after": str(RETRY_AFTER_S)})
        if model is not None and model not in self.model_names:
            raise APIError(404, f"the model {model!r} does not exist; this server has "
                           f"{self.serving.model_name!r}", param="model",
                           code="model_not_found")
        return self.serving


def build_app(
    engine_config: EngineConfig | None, config: ServerConfig | None = None
) -> FastAPI:
    """The server app; `engine_config=None` serves no generative model (embeddings only)."""
    config = config or ServerConfig()
    if engine_config is None and config.embedding_model is None:
        raise ValueError("nothing to serve: give a model or an embedding_model")
    state = ServerState(engine_config, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = state.loop = asyncio.get_running_loop()
        loader = threading.Thread(target=state.load, args=(loop,), name="batchinfer-load",
                                  daemon=True)
        loader.start()
        if config.load_before_serving:
            await asyncio.to_thread(loader.join)
            if not await state.wait_ready():
                raise RuntimeError(f"loading the model failed: {state.load_error}")
        if config.batch_api:
            state.open_batch_api(app)
        yield
        await state.close()

    app = FastAPI(title="batchinfer", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    if config.embedding_model is not None:
        from batchinfer.server.embeddings import make_embeddings_router

        app.include_router(make_embeddings_router(state.embeddings))  # type: ignore[arg-type]
    _add_routes(app, state)
    from batchinfer.server.batches import make_batch_router

    app.include_router(make_batch_router(state.get_batch_api, config.batch_max_file_bytes))
    app.add_middleware(RequestGuard, state=state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        status, text = state.health()
        body: dict[str, Any] = {"status": text}
        if state.load_error is not None:
            body["error"] = state.load_error
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        content, media_type = state.metrics.render()
        return Response(content, media_type=media_type)

    @app.get("/dashboard")
    async def dashboard(request: Request) -> Response:
        from fastapi.responses import HTMLResponse, RedirectResponse

        from batchinfer.server.dashboard import page

        key = request.query_params.get("api_key")
        if key is not None:  # the guard checked it: keep it as a cookie, not in the address
            response: Response = RedirectResponse(request.url.remove_query_params("api_key"),
                                                  status_code=303)
            response.set_cookie(DASHBOARD_COOKIE, key, httponly=True, samesite="strict",
                                path="/dashboard")
            return response
        return HTMLResponse(page(), headers={"cache-control": "no-store"})

    @app.get("/dashboard/data")
    async def dashboard_data() -> Response:
        llm = state.llm
        data: dict[str, Any] = {"status": state.health()[1], "series": {}, "latency": {},
                                "limits": {}}
        if llm is not None:
            data.update(state.dashboard.snapshot(llm.engine.clock(), llm.engine.config))
            data["model"] = state.serving.model_name if state.serving is not None else None
        return JSONResponse(data, headers={"cache-control": "no-store"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = []
        if state.serving is not None:
            serving = state.serving
            entry = {"id": serving.model_name, "object": "model", "created": 0,
                     "owned_by": "batchinfer", "max_model_len": serving.llm.max_model_len}
            # Extension: the weight form, the linear kernels chosen at start-up, the row
            # buckets whose decode steps run as one native call, the prefill inputs' width
            # (int8 only where some native kernel took it) and the native kernels' ISA level.
            worker = serving.llm.engine.worker
            plan = getattr(worker, "linear_kernels", None)
            if plan is not None:
                entry["quantization"] = getattr(worker, "quantization", None)
                entry["linear_kernels"] = plan.as_json()
                decoder = getattr(getattr(worker, "runner", None), "native_decode", None)
                entry["native_decode"] = [] if decoder is None else decoder.bucket_names()
                entry["prefill_activations"] = \
                    "int8" if getattr(worker, "int8_input_linears", 0) else "int16"
                entry["cpu_isa"] = getattr(worker, "cpu_isa", None)
            data.append(entry)
        embedder = state.embeddings.target
        if embedder is not None:
            from batchinfer.server.embeddings import model_card

            data.append(model_card(embedder))
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await state.serving_for(body.model).completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await state.serving_for(body.model).chat(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return state.serving_for(body.model).tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return state.serving_for(body.model).detokenize(body)


def _hand_over(loop: asyncio.AbstractEventLoop, callback: Callable[..., None],
               *args: Any) -> None:
    """Run `callback` on the server's loop; a server stopped while loading (its loop closed)
    drops the result (the engine was not started yet: nothing runs)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        logger.info("the server stopped before the model finished loading")


class EngineLoad:
    """The engine's queue as of its last step (a stat logger): what lets batch lines fill
    only the room interactive requests leave."""

    def __init__(self) -> None:
        self.num_waiting = self.num_running = 0
        self.llm: AsyncLLM | None = None

    def record_step(self, stats: SchedulerStats) -> None:
        self.num_waiting, self.num_running = stats.num_waiting, stats.num_running

    def record_requests(self, stats: list[RequestStats], now_s: float) -> None:
        pass

    def room(self) -> bool:
        """Nothing waits behind a running request (a queue on an idle engine, as static
        batching keeps while a batch fills, waits for no one); a dead engine answers at once
        with its own error."""
        dead = self.llm is not None and not self.llm.is_running
        return self.num_waiting == 0 or self.num_running == 0 or dead


class DeferredService:
    """Stands for a service that loads in the background: attribute access answers 503 until
    `target` is set (the embeddings router holds this and never sees the difference)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.target: Any = None

    def __getattr__(self, name: str) -> Any:
        if self.target is None:
            raise APIError(503, f"{self.what} is loading", code="loading",
                           headers={"retry-after": str(RETRY_AFTER_S)})
        return getattr(self.target, name)
