"""`batchinfer run-batch` through the server app built in this process.

`batch.offline.answer_file` reads and writes the files; this module hands it the server's
handlers: an app with only the models the file's lines need (the generator for completions,
the encoder for embeddings), started, waited for until `/health` answers 200, and reached
through `AppClient`. So an offline line gets what the same request to `batchinfer serve`
would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

from batchinfer.batch.executor import Handler
from batchinfer.batch.offline import BatchRunResult, InputSurvey, OpenHandler, answer_file
from batchinfer.core.config import EngineConfig
from batchinfer.server.app import ServerConfig, build_app
from batchinfer.server.client import AppClient

LOAD_TIMEOUT_S = 600.0


async def run_batch_file(input_path: Path, output_path: Path, engine_config: EngineConfig,
                         embedding_model: str | None = None, max_in_flight: int = 256,
                         progress: bool = True, served_model_name: str | None = None
                         ) -> BatchRunResult:
    """Answer every line of `input_path` into `output_path` (resuming it if it exists) with
    the generator `engine_config` and, for /v1/embeddings lines, the encoder
    `embedding_model` ('default' when None)."""
    return await answer_file(input_path, output_path,
                             app_handler(engine_config, embedding_model, served_model_name,
                                         max_in_flight),
                             max_in_flight, progress)


def app_handler(engine_config: EngineConfig, embedding_model: str | None = None,
                served_model_name: str | None = None, max_in_flight: int = 256
                ) -> OpenHandler:
    """What `answer_file` opens: the server app with the models a file's survey needs.
    `ValueError` here, before any line is read, for a bad server field."""
    base = ServerConfig(served_model_name=served_model_name,
                        max_num_queued_requests=max(1024, 2 * max_in_flight),
                        max_request_bytes=1 << 30)

    @contextlib.asynccontextmanager
    async def open_app(found: InputSurvey) -> AsyncIterator[Handler]:
        config = dataclasses.replace(base, embedding_model=(
            (embedding_model or "default") if found.needs_encoder else None))
        app = build_app(engine_config if found.needs_generator else None, config)
        async with app.router.lifespan_context(app):
            client = AppClient(app)
            try:
                await wait_ready(client)
                yield client
            finally:
                await client.aclose()

    return open_app


async def wait_ready(client: AppClient, timeout_s: float = LOAD_TIMEOUT_S) -> None:
    """Return once the app's `/health` answers 200; `ValueError` when loading failed,
    `TimeoutError` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get("/health")
        if response.status_code == 200:
            return
        body = response.json()
        if body.get("status") == "failed":
            raise ValueError(f"loading the model failed: {body.get('error', 'see the log')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the model did not load within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)
