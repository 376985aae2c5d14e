"""`POST /v1/embeddings` in OpenAI's format, served by an `EmbeddingService`.

`make_embeddings_router(service)` mounts on any FastAPI app (the main server includes it);
`build_embeddings_app(service, registry)` is a standalone app with `/health`, `/v1/models` and
`/metrics` around it. Extensions to OpenAI's request: `truncate` (cut inputs longer than the
model's max length instead of a 400), `lane` (`interactive` | `batch`), `timeout_ms` (queue
deadline; 503 `queue_timeout` when it passes).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ConfigDict, Field

from batchinfer.batching.config import BatcherConfig
from batchinfer.batching.embedding_service import (
    EmbeddingConfig,
    EmbeddingResult,
    EmbeddingService,
)
from batchinfer.server.disconnect import unless_disconnected
from batchinfer.server.errors import APIError, UnicodeChecked, install_error_handlers


class EmbeddingRequest(UnicodeChecked):
    """OpenAI's embeddings request (+ `truncate`, `lane`, `timeout_ms`); unknown fields are
    ignored. `input` is checked by the service so its errors name the offending item."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    input: Any = Field(description="a string, a list of strings, a list of token ids, "
                                   "or a list of token id lists")
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate: bool = False
    lane: str | None = None
    timeout_ms: float | None = Field(default=None, ge=0)


def make_embeddings_router(service: EmbeddingService) -> APIRouter:
    """A router with `POST /v1/embeddings`; errors follow `server.errors`."""
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        if body.model is not None and body.model not in service.model_aliases:
            raise APIError(404, f"the model {body.model!r} does not exist; this server embeds "
                           f"with {service.model_name!r}", param="model",
                           code="model_not_found")
        if body.dimensions is not None and body.dimensions != service.encoder.dim:
            raise APIError(400, f"dimensions must be {service.encoder.dim} for "
                           f"{service.model_name}", param="dimensions", code="invalid_value")
        # A client that leaves cancels the work: its batches not yet started never run.
        result = await unless_disconnected(
            service.embed(body.input, truncate=body.truncate, lane=body.lane,
                          timeout_ms=body.timeout_ms), request)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(render_embeddings(result, body.encoding_format, service.model_name))

    return router


def render_embeddings(result: EmbeddingResult, encoding_format: str,
                      model_name: str) -> dict[str, Any]:
    """The OpenAI response body; base64 is the little-endian float32 bytes of each vector."""
    data = []
    for index, vector in enumerate(result.vectors):
        if encoding_format == "base64":
            embedding: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        else:
            embedding = vector.astype(np.float32).tolist()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {"object": "list", "data": data, "model": model_name,
            "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}}


def model_card(service: EmbeddingService) -> dict[str, Any]:
    """The encoder's `/v1/models` entry; extensions: its weight form and linear kernels."""
    encoder = service.encoder
    return {"id": service.model_name, "object": "model", "created": 0, "owned_by": "batchinfer",
            "max_model_len": encoder.max_length, "quantization": encoder.quantization,
            "linear_kernels": encoder.linear_kernels.as_json()}


def make_embeddings_service(model: str = "default", *,
                            registry: CollectorRegistry | None = None,
                            config: EmbeddingConfig | None = None,
                            batcher_config: BatcherConfig | None = None) -> EmbeddingService:
    """Load the encoder `model` ('default' or a folder) and its batcher; metrics go to
    `registry` when given."""
    import dataclasses

    config = dataclasses.replace(config or EmbeddingConfig(), model=model)
    return EmbeddingService.load(config, batcher_config, registry=registry)


def build_embeddings_app(service: EmbeddingService,
                         registry: CollectorRegistry | None = None) -> FastAPI:
    """A standalone embeddings server: `/v1/embeddings`, `/v1/models`, `/health`, `/metrics`.

    `registry` is the one the service's metrics were registered on (what `/metrics` shows)."""
    registry = registry if registry is not None else CollectorRegistry()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await service.close()

    app = FastAPI(title="batchinfer embeddings", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(make_embeddings_router(service))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(service)]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
