"""`AsyncLLM`: the generative engine behind an asyncio event loop (what the server runs).

Two threads, one job each:
- the **engine thread** owns the scheduler and the runner. Between steps it applies the commands
  queued for it (add, abort, stop-string finish), then runs `schedule -> execute ->
  update_from_output` and hands the step's `RequestUpdate`s and stats to the event loop with
  `call_soon_threadsafe`. When nothing can run it blocks on its command queue (with the dynamic
  form, until the next batch is due): no busy loop.
- the **event loop** owns an `OutputProcessor`: it detokenizes, finds stop strings (sending the
  finish back as a command) and feeds one output stream per request.

Invariant: only the engine thread touches the scheduler. A `Request` built on the loop is handed
over in an add command and read on the loop afterwards only through the updates that carry it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import SchedulerOutput
from batchinfer.core.request import Request, RequestStatus
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.core.scheduler import RequestUpdate
from batchinfer.engine.inputs import Prompt, tokenize_prompt
from batchinfer.engine.llm_engine import LLMEngine
from batchinfer.engine.output_processor import OutputProcessor
from batchinfer.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_num_queued_requests`; the request was not queued."""


class RequestFailedError(RuntimeError):
    """The runner failed on this request (alone: rerun by itself, it failed again)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed in the engine: {message}")
        self.request_id = request_id


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a broken invariant); nothing more runs."""


@dataclass(slots=True)
class StepStats:
    """The engine's state after one step (or after commands changed it), for metrics."""

    time_s: float  # engine clock when the step's tokens were recorded
    num_scheduled_tokens: int  # tokens computed in the step (0: no step ran)
    num_scheduled_seqs: int  # sequences in the step
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_preemptions_total: int


class StatLogger(Protocol):
    """Receives engine stats on the event loop (see `server.metrics.ServerMetrics`)."""

    def record_step(self, stats: StepStats) -> None: ...

    def record_outputs(self, outputs: list[RequestOutput], now_s: float) -> None: ...


@dataclass(slots=True)
class _Add:
    request_id: str
    requests: list[Request]


@dataclass(slots=True)
class _Finish:
    child_ids: list[str]
    status: RequestStatus
    stop_reason: str | None = None


_STOP = object()
_Command = _Add | _Finish | object


@dataclass(slots=True)
class _StepResult:
    """What the engine thread hands to the loop after a step."""

    updates: list[RequestUpdate]
    stats: StepStats
    failed: dict[str, str] = field(default_factory=dict)  # child id -> message
    rejected: list[tuple[str, Exception]] = field(default_factory=list)  # request id -> error


class _Stream:
    """The latest undelivered output of one request, or its error. A reader that lags gets one
    merged output (text is cumulative; `new_token_ids` are joined), never a growing backlog."""

    __slots__ = ("error", "output", "_event")

    def __init__(self) -> None:
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.output is not None:
            merged = self.output.new_token_ids
            for index, ids in output.new_token_ids.items():
                merged[index] = merged.get(index, []) + ids
            output.new_token_ids = merged
        self.output = output
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    async def get(self) -> RequestOutput:
        while self.output is None and self.error is None:
            self._event.clear()
            await self._event.wait()
        if self.output is not None:
            output, self.output = self.output, None
            return output
        raise self.error  # type: ignore[misc]


class AsyncLLM:
    """`async for output in llm.generate(prompt, params, request_id): ...` on an event loop.

    Outputs are `RequestOutput`s with cumulative text, as `LLM.generate` returns them; the last
    has `finished=True`. Leaving the loop early (or a cancelled task) aborts the request.
    `max_num_queued_requests` bounds the scheduler's waiting queue: a request beyond it fails
    with `QueueFullError` and nothing already queued is dropped.
    """

    def __init__(self, engine: LLMEngine, max_num_queued_requests: int | None = None) -> None:
        if max_num_queued_requests is not None and max_num_queued_requests < 1:
            raise ValueError(
                f"max_num_queued_requests must be >= 1, got {max_num_queued_requests}"
            )
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_num_queued_requests = max_num_queued_requests
        self.stat_loggers: list[StatLogger] = []
        self._output_processor = OutputProcessor(engine.tokenizer)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._parent_of: dict[str, str] = {}  # child (sequence) id -> request id
        self._child_ids: dict[str, list[str]] = {}  # request id -> its child ids
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: int | None) -> AsyncLLM:
        return cls(LLMEngine(config), **kwargs)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Bind to the running event loop and start the engine thread (once)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._engine_loop, name="batchinfer-engine", daemon=True
        )
        self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread after its current step; unfinished requests fail with
        `EngineDeadError`."""
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout_s)
        self._mark_dead(EngineDeadError("the engine is shut down"))

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) as the engine will see them; `ValueError` if bad."""
        return tokenize_prompt(self.tokenizer, prompt, self.engine.spec.vocab_size)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Tokenize and queue a request (on the loop); returns its id. Bad input raises
        `ValueError` here; a queue-full or too-long request fails its stream."""
        if self._dead is not None:
            raise self._dead
        self.start()
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        arrival_s = self.engine.clock()
        child_ids = self._output_processor.add_request(
            request_id, text, token_ids, params, arrival_s
        )
        requests = self.engine.make_requests(child_ids, token_ids, params, arrival_s, priority)
        self._streams[request_id] = _Stream()
        self._parent_of.update(dict.fromkeys(child_ids, request_id))
        self._child_ids[request_id] = child_ids
        self._commands.put(_Add(request_id, requests))
        return request_id

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs until it finishes. Raises `ValueError` (bad input or a
        prompt that can never fit), `QueueFullError`, `RequestFailedError`, `EngineDeadError`."""
        request_id = self.add_request(prompt, params, request_id, priority)
        stream = self._streams[request_id]
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is: its stream ends with finish_reason "abort" and its KV
        blocks are free before the engine's next step. Unknown or finished ids are ignored."""
        child_ids = self._output_processor.child_ids(request_id)
        if not child_ids:
            return
        self._commands.put(_Finish(child_ids, RequestStatus.FINISHED_ABORTED))
        final = self._output_processor.abort(request_id)
        if final is not None:
            self._deliver([final], self.engine.clock())

    # ----------------------------------------------------------------- event-loop side
    def _on_step(self, result: _StepResult) -> None:
        for request_id, error in result.rejected:
            self._fail(request_id, error, record=False)
        outputs, stops = self._output_processor.process(result.updates)
        for child_id, stop_string in stops:
            self._commands.put(_Finish([child_id], RequestStatus.FINISHED_STOPPED, stop_string))
        self._deliver(outputs, result.stats.time_s)
        for child_id, message in result.failed.items():
            request_id = self._parent_of.get(child_id)
            if request_id is not None:
                self._fail(request_id, RequestFailedError(request_id, message), record=True)
        for stat_logger in self.stat_loggers:
            stat_logger.record_step(result.stats)

    def _deliver(self, outputs: list[RequestOutput], now_s: float) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
            if output.finished:
                self._forget(output.request_id)
        for stat_logger in self.stat_loggers:
            stat_logger.record_outputs(outputs, now_s)

    def _fail(self, request_id: str, error: BaseException, record: bool) -> None:
        """End a request with an error: its other sequences are aborted, its stream raises."""
        child_ids = self._output_processor.child_ids(request_id)
        if child_ids:
            self._commands.put(_Finish(child_ids, RequestStatus.FINISHED_ABORTED))
        final = self._output_processor.abort(request_id)
        stream = self._streams.get(request_id)
        self._forget(request_id)
        if stream is not None:
            stream.fail(error)
        if record and final is not None:
            for stat_logger in self.stat_loggers:
                stat_logger.record_outputs([final], self.engine.clock())

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        for child_id in self._child_ids.pop(request_id, ()):
            self._parent_of.pop(child_id, None)

    def _mark_dead(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
        for request_id in list(self._streams):
            self._fail(request_id, self._dead, record=False)

    def _on_engine_dead(self, exc: BaseException) -> None:
        logger.error("engine thread stopped", exc_info=exc)
        self._mark_dead(EngineDeadError(f"the engine stopped: {type(exc).__name__}: {exc}"))

    # ----------------------------------------------------------------- engine-thread side
    def _engine_loop(self) -> None:
        """Commands, then a step; block on the command queue while nothing can run."""
        engine = self.engine
        idle = False
        try:
            while True:
                rejected, changed, stop = self._apply_commands(block=idle)
                if stop:
                    return
                scheduler_output, updates, failed = engine.step_core()
                idle = scheduler_output.is_empty
                if idle and not (changed or failed):
                    continue
                result = _StepResult(updates, self._stats(scheduler_output), failed, rejected)
                if not self._post(self._on_step, result):
                    return
        except BaseException as exc:  # a broken invariant: every request must hear of it
            self._post(self._on_engine_dead, exc)

    def _post(self, callback: object, arg: object) -> bool:
        try:
            self._loop.call_soon_threadsafe(callback, arg)  # type: ignore[union-attr, arg-type]
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False
        return True

    def _apply_commands(self, block: bool) -> tuple[list[tuple[str, Exception]], bool, bool]:
        """Apply every queued command (waiting for one first if `block`). Returns the rejected
        adds, whether anything was applied, and whether to stop."""
        rejected: list[tuple[str, Exception]] = []
        command = self._next_command(block)
        changed = command is not None
        while command is not None:
            if command is _STOP:
                return rejected, changed, True
            if isinstance(command, _Add):
                error = self._admit(command)
                if error is not None:
                    rejected.append((command.request_id, error))
            elif isinstance(command, _Finish):
                for child_id in command.child_ids:
                    self.engine.scheduler.finish_request(
                        child_id, command.status, command.stop_reason
                    )
            command = self._next_command(block=False)
        return rejected, changed, False

    def _next_command(self, block: bool) -> _Command | None:
        try:
            if not block:
                return self._commands.get_nowait()
            due_s = self.engine.scheduler.next_dispatch_s()
            timeout_s = None if due_s is None else max(0.0, due_s - self.engine.clock())
            return self._commands.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _admit(self, command: _Add) -> Exception | None:
        scheduler = self.engine.scheduler
        limit = self.max_num_queued_requests
        if limit is not None and scheduler.num_waiting >= limit:
            return QueueFullError(
                f"the server's queue is full ({limit} waiting requests); retry later"
            )
        added: list[str] = []
        try:
            for request in command.requests:
                scheduler.add_request(request)
                added.append(request.request_id)
        except ValueError as exc:
            for child_id in added:
                scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            return exc
        return None

    def _stats(self, scheduler_output: SchedulerOutput) -> StepStats:
        scheduler = self.engine.scheduler
        return StepStats(
            time_s=self.engine.clock(),
            num_scheduled_tokens=scheduler_output.num_scheduled_tokens,
            num_scheduled_seqs=len(scheduler_output.sequences),
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=scheduler.block_manager.usage,
            num_preemptions_total=scheduler.num_preemptions_total,
        )
