"""`AsyncLLM`: the generative engine behind an asyncio event loop (what the server runs).

Two threads, one job each (docs/architecture.md has the map):
- the **engine thread** owns the `EngineCore` (scheduler + runner). Between steps it applies the
  commands queued for it (add, finish), then runs `EngineCore.step()` and hands the step's
  plain `EngineCoreOutput`s and `SchedulerStats` to the event loop with
  `call_soon_threadsafe`. When nothing can run it blocks on its command queue (with the dynamic
  form, until the next batch is due): no busy loop.
- the **event loop** owns the `OutputProcessor`: it detokenizes, finds stop strings (sending
  the finish back as a command) and feeds one output stream per request. Prompts are
  tokenized and validated by the `Processor` on a worker thread, off the loop.

Invariant: only the engine thread touches the engine core; only the loop touches the output
processor and the streams. What crosses between them is plain data.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import QUEUE_TIMEOUT, EngineCoreOutput, SchedulerStats
from batchinfer.core.request import Request, RequestStatus, SchedulingOptions
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.engine.inputs import Prompt
from batchinfer.engine.llm_engine import LLMEngine
from batchinfer.engine.outputs import RequestOutput, RequestOutputKind, RequestStats
from batchinfer.engine.processor import EngineRequest
from batchinfer.engine.stream import OutputStream

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_num_queued_requests`; the request was not queued."""


class RequestFailedError(RuntimeError):
    """The runner failed on this request (alone: rerun by itself, it failed again)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed in the engine: {message}")
        self.request_id = request_id


class QueueTimeoutError(RuntimeError):
    """The request waited in the queue longer than its limit (`max_queue_time_ms` or its own
    `timeout`) and left it unanswered (the server answers 503 `queue_timeout`)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a broken invariant); nothing more runs."""


class StatLogger(Protocol):
    """Receives engine stats on the event loop (see `server.metrics.ServerMetrics`)."""

    def record_step(self, stats: SchedulerStats) -> None: ...

    def record_requests(self, stats: list[RequestStats], now_s: float) -> None: ...


@dataclass(slots=True)
class _Add:
    """Requests admitted together, all or none (the prompts of one HTTP request)."""

    request_ids: list[str]
    sequences: list[Request]


@dataclass(slots=True)
class _Finish:
    child_ids: list[str]
    status: RequestStatus
    stop_reason: str | None = None


_STOP = object()
_Command = _Add | _Finish | object


@dataclass(slots=True)
class _StepResult:
    """What the engine thread hands to the loop after a step (or after commands)."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    rejected: list[tuple[str, Exception]] = field(default_factory=list)  # request id -> error


class AsyncLLM:
    """`async for output in llm.generate(prompt, params, request_id): ...` on an event loop.

    Outputs are `RequestOutput`s of the kind asked for: DELTA by default (each carries only
    what is new: what a stream sends), FINAL_ONLY for one output at the end; the last has
    `finished=True`. Leaving the loop early (or a cancelled task) aborts the request.
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
        self._core = engine.core  # engine thread only
        self._output_processor = engine.output_processor  # event loop only
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: int | None) -> AsyncLLM:
        return cls(LLMEngine.from_config(config), **kwargs)

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
    def tokenize(
        self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) as the engine will see them; `ValueError` if bad."""
        return self.engine.processor.tokenize(prompt, tools)

    async def process(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        scheduling: SchedulingOptions | None = None,
    ) -> EngineRequest:
        """Tokenize and validate a request on a worker thread (not queued yet); `ValueError`
        names what is wrong."""
        return await asyncio.to_thread(
            self.engine.processor.process, prompt, params, request_id, None, scheduling
        )

    def add_processed(
        self, requests: list[EngineRequest], kind: RequestOutputKind = RequestOutputKind.DELTA
    ) -> list[OutputStream]:
        """Queue processed requests (on the loop), admitted together or not at all; returns
        their streams. A duplicate id raises `ValueError` here (nothing queued); when the
        queue cannot take them all, or one can never fit, every stream fails."""
        if self._dead is not None:
            raise self._dead
        self.start()
        added: list[str] = []
        try:
            for request in requests:
                self._output_processor.add_request(request, kind)
                added.append(request.request_id)
        except ValueError:
            for request_id in added:
                self._output_processor.abort(request_id)
            raise
        streams = [OutputStream(kind) for _ in requests]
        self._streams.update(zip(added, streams, strict=True))
        sequences = [seq for request in requests for seq in request.sequences]
        self._commands.put(_Add(added, sequences))
        return streams

    def generate_many(
        self, requests: list[EngineRequest], kind: RequestOutputKind = RequestOutputKind.DELTA
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """One output stream per processed request, the requests admitted all or none."""
        streams = self.add_processed(requests, kind)
        return [self._follow(r.request_id, s) for r, s in zip(requests, streams, strict=True)]

    async def generate(
        self,
        prompt: Prompt | EngineRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kind: RequestOutputKind = RequestOutputKind.DELTA,
        scheduling: SchedulingOptions | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs until it finishes. `prompt` may be a request `process`
        built already. Raises `ValueError` (bad input or a prompt that can never fit),
        `QueueFullError`, `QueueTimeoutError`, `RequestFailedError`, `EngineDeadError`."""
        request = prompt
        if not isinstance(request, EngineRequest):
            request = await self.process(
                prompt, params, request_id, scheduling  # type: ignore[arg-type]
            )
        (stream,) = self.add_processed([request], kind)
        async for output in self._follow(request.request_id, stream):
            yield output

    async def _follow(
        self, request_id: str, stream: OutputStream
    ) -> AsyncGenerator[RequestOutput, None]:
        """A request's outputs until it finishes; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort_all(self) -> int:
        """Abort every unfinished request (each stream ends with finish_reason "abort");
        returns how many there were."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is: its stream ends with finish_reason "abort" and its KV
        blocks are free before the engine's next step. Unknown or finished ids are ignored."""
        child_ids = self._output_processor.child_ids(request_id)
        if not child_ids:
            return
        self._commands.put(_Finish(child_ids, RequestStatus.FINISHED_ABORTED))
        processed = self._output_processor.abort(request_id)
        self._deliver(processed.outputs)
        self._record(processed.stats)

    # ----------------------------------------------------------------- event-loop side
    def _on_step(self, result: _StepResult) -> None:
        for request_id, error in result.rejected:
            self._fail(request_id, error, record=False)
        try:
            self._process_step(result)
        except Exception as exc:  # e.g. a tokenizer that fails to decode: fail its requests
            logger.exception("processing a step's outputs failed")
            message = f"{type(exc).__name__}: {exc}"
            for request_id in self._output_processor.parent_ids(result.outputs):
                self._fail(request_id, RequestFailedError(request_id, message), record=True)

    def _process_step(self, result: _StepResult) -> None:
        processed = self._output_processor.process(result.outputs)
        for child_id, stop_string in processed.stopped:
            self._commands.put(_Finish([child_id], RequestStatus.FINISHED_STOPPED, stop_string))
        if processed.to_abort:
            self._commands.put(_Finish(processed.to_abort, RequestStatus.FINISHED_ABORTED))
        for request_id, (message, code) in processed.failed.items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                error: Exception = RequestFailedError(request_id, message)
                if code == QUEUE_TIMEOUT:
                    error = QueueTimeoutError(request_id, message)
                stream.fail(error)
        self._deliver(processed.outputs)
        for stat_logger in self.stat_loggers:
            stat_logger.record_step(result.stats)
        self._record(processed.stats, result.stats.time_s)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
            if output.finished:
                self._streams.pop(output.request_id, None)

    def _record(self, stats: list[RequestStats], now_s: float | None = None) -> None:
        if not stats:
            return
        now_s = self.engine.clock() if now_s is None else now_s
        for stat_logger in self.stat_loggers:
            stat_logger.record_requests(stats, now_s)

    def _fail(self, request_id: str, error: BaseException, record: bool) -> None:
        """End a request with an error: its sequences are aborted, its stream raises."""
        child_ids = self._output_processor.child_ids(request_id)
        if child_ids:
            self._commands.put(_Finish(child_ids, RequestStatus.FINISHED_ABORTED))
        processed = self._output_processor.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(error)
        if record:
            self._record(processed.stats)

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
        core = self._core
        idle = False
        try:
            while True:
                rejected, changed, stop = self._apply_commands(block=idle)
                if stop:
                    return
                outputs = core.step()
                last = core.last_scheduler_output
                idle = last is None or last.is_empty
                if idle and not (changed or outputs):
                    continue
                if not self._post(self._on_step, _StepResult(outputs, core.stats(), rejected)):
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
                    rejected.extend((request_id, error) for request_id in command.request_ids)
            elif isinstance(command, _Finish):
                self._core.finish(command.child_ids, command.status, command.stop_reason)
            command = self._next_command(block=False)
        return rejected, changed, False

    def _next_command(self, block: bool) -> _Command | None:
        try:
            if not block:
                return self._commands.get_nowait()
            due_s = self._core.next_dispatch_s()
            timeout_s = None if due_s is None else max(0.0, due_s - self._core.clock())
            return self._commands.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _admit(self, command: _Add) -> Exception | None:
        """Queue a command's sequences, all or none. The bound counts sequences waiting beyond
        the seats (`max_num_seqs`) the next step fills: a burst takes every free seat plus
        `max_num_queued_requests`, not the queue alone."""
        limit = self.max_num_queued_requests
        core = self._core
        if limit is not None:
            free_seats = max(0, core.max_num_seqs - core.num_running)
            if core.num_waiting + len(command.sequences) > limit + free_seats:
                return QueueFullError(
                    f"the server's queue is full ({limit} waiting requests beyond the "
                    f"{core.max_num_seqs} running); retry later"
                )
        try:
            self._core.add_requests(command.sequences)
        except ValueError as exc:
            return exc
        return None

