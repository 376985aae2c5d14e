"""OpenAI's Files and Batches routes: `/v1/files` (upload, get, content, delete) and
`/v1/batches` (create, get, list, cancel). Objects belong to the API key that created them
(`request.state.owner`); another key's ids answer 404 as if absent."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import secrets
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import UploadFile

from batchinfer.batch.jobs import BatchManager, parse_window
from batchinfer.batch.lines import BATCH_URLS
from batchinfer.batch.store import ACTIVE_STATUSES, BatchStore, new_id
from batchinfer.server.client import AppClient
from batchinfer.server.errors import APIError

logger = logging.getLogger(__name__)
FILE_PURPOSES = ("batch",)
MAX_METADATA_PAIRS = 16


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def owner_of(request: Request) -> str:
    return str(getattr(request.state, "owner", ""))


def owner_digest(api_key: str) -> str:
    """What a batch or file records of the key that made it (never the key itself)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


class BatchAPI:
    """One server's Batch API: the store under `root` (locked, so that a second server on
    the same directory cannot run the same jobs twice) and the job manager, whose requests
    enter the app through its own guard with a token made for this process."""

    def __init__(self, root: Path, app: Any, max_in_flight: int,
                 ready: Callable[[], Awaitable[bool]], room: Callable[[], bool]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self._lock = open(root / "server.lock", "w")  # noqa: SIM115 (held while serving)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(f"batch directory {root} is in use by another server; give this "
                             "one its own --batch-dir") from None
        self.store = BatchStore(root)
        self.token = secrets.token_hex(16)
        self.client = AppClient(app, {"authorization": f"Bearer {self.token}"})
        self.manager = BatchManager(self.store, self.client, max_in_flight, ready, room)

    async def close(self) -> None:
        await self.manager.close()
        await self.client.aclose()
        self.store.close()
        self._lock.close()


def found(kind: str, object_id: str, obj: dict[str, Any] | None) -> dict[str, Any]:
    """`obj`, or the 404 of a `kind` id that is absent (or another key's)."""
    if obj is None:
        raise APIError(404, f"no {kind} with id {object_id!r}", param=f"{kind}_id",
                       code=f"{kind}_not_found")
    return obj


def check_limit(limit: int, most: int) -> None:
    if not 1 <= limit <= most:
        raise APIError(400, f"limit must be in [1, {most}], got {limit}", param="limit")


def listing(page: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of a list, as OpenAI's list endpoints give one."""
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


def make_batch_router(get_api: Callable[[], BatchAPI], max_file_bytes: int) -> APIRouter:
    """The routes; `get_api()` raises the `APIError` to answer when the API is unavailable."""
    router = APIRouter()

    def store_() -> BatchStore:
        return get_api().store

    @router.post("/v1/files")
    async def upload(request: Request) -> dict[str, Any]:
        form = await request.form(max_files=1, max_fields=8)
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose not in FILE_PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(FILE_PURPOSES)}, got "
                           f"{purpose!r}", param="purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "a multipart 'file' field is required", param="file")
        file_id = new_id("file-")
        path = store_().upload_path(file_id)
        with open(path, "wb") as sink:
            await asyncio.to_thread(shutil.copyfileobj, upload.file, sink, 1 << 20)
        if path.stat().st_size > max_file_bytes:
            path.unlink()
            raise APIError(413, f"the file exceeds {max_file_bytes} bytes "
                           "(--batch-max-file-bytes)", param="file", code="file_too_large")
        return store_().add_file(file_id, owner_of(request), str(purpose),
                                 upload.filename or file_id, path)

    def file_or_404(file_id: str, request: Request) -> dict[str, Any]:
        return found("file", file_id, store_().get_file(file_id, owner_of(request)))

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request) -> dict[str, Any]:
        return file_or_404(file_id, request)

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> FileResponse:
        file = file_or_404(file_id, request)
        path = store_().file_path(file_id, owner_of(request))
        assert path is not None
        return FileResponse(path, media_type="application/jsonl", filename=file["filename"])

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
        file_or_404(file_id, request)
        if store_().file_in_use(file_id):
            raise APIError(409, f"file {file_id!r} is the input of a batch still running",
                           param="file_id", code="file_in_use")
        store_().delete_file(file_id, owner_of(request))
        return {"id": file_id, "object": "file", "deleted": True}

    @router.post("/v1/batches")
    async def create_batch(body: CreateBatchRequest, request: Request) -> dict[str, Any]:
        owner = owner_of(request)
        file = store_().get_file(body.input_file_id, owner)
        if file is None or file["purpose"] != "batch":
            raise APIError(400, f"input_file_id {body.input_file_id!r} is not a file of "
                           "purpose 'batch' uploaded with this key", param="input_file_id")
        if body.endpoint not in BATCH_URLS:
            raise APIError(400, f"endpoint must be one of {', '.join(BATCH_URLS)}, got "
                           f"{body.endpoint!r}", param="endpoint")
        try:
            parse_window(body.completion_window)
        except ValueError as exc:
            raise APIError(400, str(exc), param="completion_window") from None
        if body.metadata is not None and len(body.metadata) > MAX_METADATA_PAIRS:
            raise APIError(400, f"metadata holds at most {MAX_METADATA_PAIRS} pairs",
                           param="metadata")
        return get_api().manager.create(owner, body.input_file_id, body.endpoint,
                                        body.completion_window, body.metadata)

    def batch_or_404(batch_id: str, request: Request) -> dict[str, Any]:
        return found("batch", batch_id, store_().get_batch(batch_id, owner_of(request)))

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
        return batch_or_404(batch_id, request)

    @router.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: int = 20
                           ) -> dict[str, Any]:
        check_limit(limit, 100)
        return listing(*store_().list_batches(owner_of(request), after, limit))

    @router.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                         limit: int = 10000) -> dict[str, Any]:
        check_limit(limit, 10000)
        return listing(*store_().list_files(owner_of(request), purpose, after, limit))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
        batch = batch_or_404(batch_id, request)
        if batch["status"] == "cancelling":
            return batch
        if batch["status"] not in ACTIVE_STATUSES or batch["status"] == "finalizing":
            raise APIError(409, f"batch {batch_id!r} is {batch['status']}; only a validating "
                           "or in-progress batch can be cancelled", param="batch_id",
                           code="batch_not_cancellable")
        return get_api().manager.cancel(batch)

    return router
