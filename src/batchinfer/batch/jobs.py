"""Batch jobs inside `batchinfer serve`: validate, run in the background class, finalize.

A job's life (OpenAI's statuses): `validating` (the input file is read once: line count,
duplicate custom_ids fail the batch) -> `in_progress` (lines run through the server's own
routes, the `send` handler `server.batches` hands in, with `service_tier: batch` / `lane:
batch`, so the scheduler serves interactive traffic first; answers are appended to
`output.jsonl` (2xx) or `errors.jsonl` in input order) -> `finalizing` (the two files become
`batch_output` files) -> `completed`. `cancelling` -> `cancelled` keeps what finished; a
passed `completion_window` -> `expired`, the lines not run answered with `batch_expired`. A
server stopped or killed mid-job resumes it at start-up: the lines already in its files are
skipped, so no finished answer is lost or repeated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from batchinfer.batch.executor import Handler, retrying, run_lines
from batchinfer.batch.lines import BatchLine
from batchinfer.batch.offline import Resume, pending_lines, read_resume, survey
from batchinfer.batch.store import BatchStore, new_id

logger = logging.getLogger(__name__)

WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 30 * 86400
SAVE_EVERY_S = 0.25
ROOM_POLL_S = 0.02
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window "
                            "expired."}


def parse_window(window: str) -> int:
    """'24h' -> seconds; `ValueError` naming `completion_window`."""
    match = re.fullmatch(r"(\d+)([smhd])", window) if isinstance(window, str) else None
    seconds = int(match[1]) * WINDOW_UNITS[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ValueError(f"completion_window must be a duration such as '24h' (units s, m, h, "
                         f"d; at most 30d), got {window!r}")
    return seconds


class BatchManager:
    """Runs the server's batch jobs, each line through `send` (the server's routes); every
    method is called on the event loop."""

    def __init__(self, store: BatchStore, send: Handler, max_in_flight: int,
                 ready: Callable[[], Awaitable[bool]],
                 room: Callable[[], bool] = lambda: True) -> None:
        self.store = store
        self.send = send
        self.max_in_flight = max_in_flight
        self.ready = ready
        self.room = room
        self._slots = asyncio.Semaphore(max_in_flight)  # lines in flight, all jobs together
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stops: dict[str, asyncio.Event] = {}
        self._reasons: dict[str, str] = {}  # why a job was stopped: cancel | expired | shutdown
        # The batch object each running job updates: changes from a route (cancel) go into
        # it, so the job's next save cannot overwrite them with a stale copy.
        self._live: dict[str, dict[str, Any]] = {}

    def start(self) -> None:
        """Resume the jobs a previous run of the server left unfinished."""
        for batch in self.store.active_batches():
            logger.info("batch %s: resuming (%s)", batch["id"], batch["status"])
            self._launch(batch["id"])

    def create(self, owner: str, input_file_id: str, endpoint: str, window: str,
               metadata: dict[str, str] | None) -> dict[str, Any]:
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + parse_window(window),
            "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        self.store.add_batch(batch, owner)
        self._launch(batch["id"])
        return batch

    def cancel(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Ask a validating or running job to stop; it keeps what finished."""
        batch = self._live.get(batch["id"], batch)
        batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
        self.store.save_batch(batch)
        self._stop(batch["id"], "cancel")
        return batch

    async def close(self) -> None:
        """Stop every job (each stays resumable) and wait for them."""
        for batch_id in list(self._tasks):
            self._stop(batch_id, "shutdown")
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _stop(self, batch_id: str, reason: str) -> None:
        if batch_id in self._stops:
            self._reasons.setdefault(batch_id, reason)
            self._stops[batch_id].set()

    def _launch(self, batch_id: str) -> None:
        self._stops[batch_id] = asyncio.Event()
        task = asyncio.ensure_future(self._run(batch_id))
        self._tasks[batch_id] = task

        def forget(_: asyncio.Task[None]) -> None:
            self._tasks.pop(batch_id, None)
            self._stops.pop(batch_id, None)
            self._reasons.pop(batch_id, None)
            self._live.pop(batch_id, None)

        task.add_done_callback(forget)

    async def _run(self, batch_id: str) -> None:
        batch = self.store.get_batch(batch_id, None)
        assert batch is not None
        self._live[batch_id] = batch
        try:
            await self._advance(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a job that cannot go on fails alone, with the reason
            logger.exception("batch %s failed", batch_id)
            self._fail(batch, self.store.owner_of(batch_id), "internal_error",
                       f"{type(exc).__name__}: {exc}")

    async def _advance(self, batch: dict[str, Any]) -> None:
        owner = self.store.owner_of(batch["id"])
        if batch["status"] in ("cancelling", "finalizing"):  # a restart caught it there
            await self._recount(batch)
            self._finish(batch, owner, "cancelled" if batch["status"] == "cancelling"
                         else "completed")
            return
        path = self.store.file_path(batch["input_file_id"], owner)
        if path is None:
            self._fail(batch, owner, "missing_file", "the input file was deleted")
            return
        if batch["status"] == "validating":
            try:
                found = await asyncio.to_thread(survey, path)
            except ValueError as exc:
                self._fail(batch, owner, "invalid_file", str(exc).replace(f"{path}: ", ""))
                return
            if self._reasons.get(batch["id"]) == "cancel":
                self._finish(batch, owner, "cancelled")
                return
            batch["request_counts"]["total"] = found.num_lines
            batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
            self.store.save_batch(batch)
        await self._run_lines(batch, owner, path)

    async def _recount(self, batch: dict[str, Any]) -> Resume:
        """Set `request_counts` from the job's files (a kill may have lost the last save);
        returns what they hold. Off the event loop: a long job's files are large."""
        job = self.store.job_dir(batch["id"])
        done_ok, done_failed = await asyncio.to_thread(
            lambda: (read_resume(job / "output.jsonl"), read_resume(job / "errors.jsonl")))
        counts = batch["request_counts"]
        counts["completed"], counts["failed"] = done_ok.num_done, done_failed.num_done
        return done_ok.merge(done_failed)

    async def _run_lines(self, batch: dict[str, Any], owner: str, path: Path) -> None:
        batch_id = batch["id"]
        stop = self._stops[batch_id]
        job = self.store.job_dir(batch_id)
        answered = await self._recount(batch)
        counts = batch["request_counts"]
        loop = asyncio.get_running_loop()
        expire = loop.call_later(max(0.0, batch["expires_at"] - time.time()), self._stop,
                                 batch_id, "expired")
        ready, stopped = asyncio.ensure_future(self.ready()), asyncio.ensure_future(stop.wait())
        await asyncio.wait((ready, stopped), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not ready.done() or not ready.result():
            ready.cancel()
            expire.cancel()
            # Stopped before the model was ready, or the model failed to load.
            await self._settle(batch, owner, self._reasons.get(batch_id, "shutdown"), path)
            return
        last_save = time.monotonic()
        with open(job / "output.jsonl", "a", encoding="utf-8") as output, \
                open(job / "errors.jsonl", "a", encoding="utf-8") as errors:

            def write(line: BatchLine, result: dict[str, Any]) -> None:
                nonlocal last_save
                ok = 200 <= result["response"]["status_code"] < 300
                sink = output if ok else errors
                sink.write(json.dumps(result, ensure_ascii=False) + "\n")
                sink.flush()
                counts["completed" if ok else "failed"] += 1
                if time.monotonic() - last_save >= SAVE_EVERY_S:
                    self.store.save_batch(batch)
                    last_save = time.monotonic()

            try:
                await run_lines(pending_lines(path, answered, batch["endpoint"]),
                                self._handler(stop), write, self.max_in_flight, stop)
            finally:
                expire.cancel()
                self.store.save_batch(batch)
        reason = self._reasons.get(batch_id)
        if reason is None and time.time() >= batch["expires_at"]:
            reason = "expired"  # the window passed while the last lines ran
        await self._settle(batch, owner, reason, path)

    async def _settle(self, batch: dict[str, Any], owner: str, reason: str | None,
                      path: Path) -> None:
        """Give a job that stopped running its status for `reason` (None: all lines ran)."""
        if reason == "shutdown":
            return  # stays as it is: the next start resumes it
        if reason == "cancel":
            self._finish(batch, owner, "cancelled")
            return
        if reason == "expired":
            await asyncio.to_thread(self._answer_expired, batch, path)
            self._finish(batch, owner, "expired")
            return
        batch["status"], batch["finalizing_at"] = "finalizing", int(time.time())
        self.store.save_batch(batch)
        self._finish(batch, owner, "completed")

    def _answer_expired(self, batch: dict[str, Any], path: Path) -> None:
        """Answer every line not run with `batch_expired` (in a thread: reads the files)."""
        job = self.store.job_dir(batch["id"])
        answered = read_resume(job / "output.jsonl").merge(read_resume(job / "errors.jsonl"))
        with open(job / "errors.jsonl", "a", encoding="utf-8") as errors:
            for line in pending_lines(path, answered):
                errors.write(json.dumps({"id": new_id("batch_req_"),
                                         "custom_id": line.custom_id, "response": None,
                                         "error": EXPIRED_ERROR}) + "\n")
                batch["request_counts"]["failed"] += 1

    def _handler(self, stop: asyncio.Event) -> Handler:
        async def send(url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
            body = {**body, "lane" if url == "/v1/embeddings" else "service_tier": "batch"}
            async with self._slots:
                # The background lane: a line enters the engine only while nothing waits
                # there, so batch lines never queue (and age) ahead of interactive requests;
                # those find at most the lines running, which `priority` may preempt.
                # (Embeddings have their own batcher and lanes: they do not wait on this.)
                while url != "/v1/embeddings" and not self.room():
                    await asyncio.sleep(ROOM_POLL_S)
                return await self.send(url, body)

        return retrying(send, stop)

    def _finish(self, batch: dict[str, Any], owner: str, status: str) -> None:
        """Register the job's output and error files, then set the final `status`."""
        job = self.store.job_dir(batch["id"])
        for key, name in (("output_file_id", "output"), ("error_file_id", "errors")):
            path = job / f"{name}.jsonl"
            if batch[key] is None and path.exists() and path.stat().st_size:
                batch[key] = new_id("file-")
                self.store.save_batch(batch)  # the id first: a restart re-registers no file
                self.store.add_file(batch[key], owner, "batch_output",
                                    f"{batch['id']}_{name}.jsonl", path)
        self._set_status(batch, status)

    def _fail(self, batch: dict[str, Any], owner: str, code: str, message: str) -> None:
        """Fail the batch with the reason; answers already written stay reachable."""
        batch["errors"] = {"object": "list", "data": [
            {"code": code, "message": message, "param": None, "line": _line_of(message)}]}
        self._finish(batch, owner, "failed")

    def _set_status(self, batch: dict[str, Any], status: str) -> None:
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
        self.store.save_batch(batch)
        logger.info("batch %s: %s (%s)", batch["id"], status, batch["request_counts"])


def _line_of(message: str) -> int | None:
    match = re.search(r"lines? (\d+)", message)
    return int(match[1]) if match else None

