"""`DynamicBatcher`: the asyncio side of dynamic batching around any list-in/list-out callable.

Callers `await batcher.submit(item)`; a background task asks the pure `BatchQueue` what to run
whenever a worker is free and sleeps until the next event (an arrival, a batch finishing, the
next item becoming due, the next timeout). The model runs on a thread of its own per batch
(sync callables; see `_run_on_own_thread`) or on the loop (async ones). A failing batch is
bisected so that only its failing items get the error; results always go back to the item that
asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from batchinfer.batching.config import BatcherConfig
from batchinfer.batching.errors import BatcherClosedError, ItemTimeoutError, OverloadedError
from batchinfer.batching.metrics import BatcherMetrics
from batchinfer.batching.policy import BatchQueue, Dispatch, QueuedItem

T = TypeVar("T")
R = TypeVar("R")
BatchFn = Callable[[list[T]], "Sequence[R] | Awaitable[Sequence[R]]"]


@dataclasses.dataclass(slots=True)
class _Pending(Generic[R]):
    item_id: int
    future: asyncio.Future[R]


class DynamicBatcher(Generic[T, R]):
    """Group concurrent `submit()` calls into batches for `fn(list[item]) -> list[result]`.

    A batch runs when `max_batch_size` items wait, when one more item would exceed
    `max_batch_tokens` (padded cost: longest x count, lengths from `length_fn`), or when the
    oldest waiting item has waited `max_batch_delay_ms`. Knobs are `BatcherConfig` fields, given
    as `config=` and/or keyword arguments. `clock` (seconds, monotonic) is injectable for tests.
    Use it from one event loop; the background task starts on the first `submit()`.
    """

    def __init__(
        self,
        fn: BatchFn[T, R],
        config: BatcherConfig | None = None,
        *,
        length_fn: Callable[[T], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: BatcherMetrics | None = None,
        name: str = "default",
        **overrides: Any,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        config = config or BatcherConfig()
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        self.name = name
        self._fn = fn
        # An async function, or an object whose __call__ is one.
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__)
        self._length_fn = length_fn
        self._clock = clock
        self._metrics = metrics
        self._queue = BatchQueue(self.config)
        self._futures: dict[int, asyncio.Future[R]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self._num_running = 0
        self._closing = False
        self._mean_batch_s = 0.0  # moving average, for Retry-After

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Current length bucket boundaries (learned or given)."""
        return self._queue.buckets.boundaries

    async def submit(self, item: T, *, lane: str | None = None, timeout_ms: float | None = None,
                     length: int | None = None) -> R:
        """Queue one item and wait for its result.

        Raises `OverloadedError` if the queue is full, `ItemTimeoutError` if it waited past
        `timeout_ms`, `ValueError` for a bad lane/length, or whatever `fn` raised for this item.
        Cancelling the awaiting task takes a waiting item out of the queue (it never runs).
        """
        self._check_room(1)
        return await self._await(self._enqueue(item, lane, timeout_ms, length))

    async def submit_many(self, items: Sequence[T], *, lane: str | None = None,
                          timeout_ms: float | None = None,
                          lengths: Sequence[int] | None = None) -> list[R]:
        """Queue several items (all or none: overload is checked for all of them) and return
        their results in order. If one fails, the others still waiting are cancelled and the
        first error is raised."""
        if lengths is not None and len(lengths) != len(items):
            raise ValueError(f"lengths has {len(lengths)} entries for {len(items)} items")
        self._check_room(len(items))
        pendings = [self._enqueue(item, lane, timeout_ms, None if lengths is None else lengths[i])
                    for i, item in enumerate(items)]
        try:
            return [await self._await(pending) for pending in pendings]
        finally:
            for pending in pendings:
                if not pending.future.done():
                    self._cancel(pending)
                elif not pending.future.cancelled():
                    pending.future.exception()  # mark retrieved: only the first error is raised

    async def close(self, *, drain: bool = True) -> None:
        """Stop accepting items. `drain=True` runs what waits; else it fails with
        `BatcherClosedError`. Waits for running batches to finish."""
        self._closing = True
        if not drain:
            for item_id in list(self._futures):
                waiting = self._queue.remove(item_id)
                if waiting is not None:
                    self._fail(waiting, BatcherClosedError("the batcher was closed"))
        self._wakeup.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def __aenter__(self) -> DynamicBatcher[T, R]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- submission ------------------------------------------------------------------------

    def _check_room(self, num_items: int) -> None:
        if self._closing:
            raise BatcherClosedError("the batcher is closed")
        if not self._queue.has_room(num_items):
            if self._metrics is not None:
                self._metrics.overloads.labels(self.name).inc()
            raise OverloadedError(
                f"queue full: {len(self._queue)} items waiting, max_queue_size="
                f"{self.config.max_queue_size}", retry_after_s=self._retry_after_s())

    def _enqueue(self, item: T, lane: str | None, timeout_ms: float | None,
                 length: int | None) -> _Pending[R]:
        loop = self._ensure_started()
        if length is None:
            length = 1 if self._length_fn is None else self._length_fn(item)
        queued = self._queue.push(item, self._clock(), length=length, lane=lane,
                                  timeout_ms=timeout_ms)
        pending = _Pending(queued.item_id, loop.create_future())
        self._futures[queued.item_id] = pending.future
        self._set_queue_gauge()
        self._wakeup.set()
        return pending

    async def _await(self, pending: _Pending[R]) -> R:
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            self._cancel(pending)
            raise

    def _cancel(self, pending: _Pending[R]) -> None:
        """Take the item out if it still waits; a running item's result is dropped."""
        if self._queue.remove(pending.item_id) is not None:
            self._futures.pop(pending.item_id, None)
            self._set_queue_gauge()
            self._wakeup.set()
        pending.future.cancel()

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._task = loop.create_task(self._run(), name=f"batcher-{self.name}")
        elif self._loop is not loop:
            raise RuntimeError("a DynamicBatcher is bound to the event loop that first used it")
        return loop

    # -- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                now = self._clock()
                for item in self._queue.pop_expired(now):
                    self._expire(item, now)
                while self._num_running < self.config.max_concurrent_batches:
                    dispatch = self._queue.pop_batch(now, flush=self._closing)
                    if dispatch is None:
                        break
                    self._start(dispatch, now)
                self._set_queue_gauge()
                if self._closing and not self._queue and not self._batch_tasks:
                    return
                self._wakeup.clear()
                await self._sleep(self._next_wake_s(now))
        except BaseException as exc:
            for item_id in list(self._futures):
                waiting = self._queue.remove(item_id)
                if waiting is not None:
                    self._fail(waiting, BatcherClosedError(f"the batcher stopped: {exc!r}"))
            raise

    def _next_wake_s(self, now: float) -> float | None:
        times = [self._queue.next_deadline_s()]
        if self._num_running < self.config.max_concurrent_batches:
            times.append(self._queue.next_due_s())
        pending = [t for t in times if t is not None]
        return max(0.0, min(pending) - now) if pending else None

    async def _sleep(self, timeout_s: float | None) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self._wakeup.wait()
        except TimeoutError:
            pass

    def _start(self, dispatch: Dispatch, now: float) -> None:
        if self._metrics is not None:
            m, name = self._metrics, self.name
            m.batch_size.labels(name).observe(len(dispatch.items))
            padded = dispatch.num_padded_tokens
            m.padding_ratio.labels(name).observe((padded - dispatch.num_tokens) / padded)
            m.dispatches.labels(name, dispatch.reason.value).inc()
            for item in dispatch.items:
                m.queue_time.labels(name, item.lane).observe(now - item.arrival_s)
        # The slot is taken here, before the task runs: `_run` dispatches several batches in one
        # pass, and counting inside the task would let all of them past max_concurrent_batches.
        self._num_running += 1
        task = asyncio.get_running_loop().create_task(self._run_batch(dispatch))
        self._batch_tasks.add(task)
        task.add_done_callback(functools.partial(self._batch_done, dispatch))

    def _batch_done(self, dispatch: Dispatch, task: asyncio.Task[None]) -> None:
        """Give back the slot `_start` took, however the batch ended (a task cancelled before
        its first step never runs its own `finally`); fail the items it left unanswered."""
        self._batch_tasks.discard(task)
        self._num_running -= 1
        self._wakeup.set()
        if task.cancelled():
            message = "batch aborted: cancelled"
        elif (exc := task.exception()) is not None:
            message = f"batch aborted: {exc!r}"
        else:
            return
        for item in dispatch.items:
            self._fail(item, BatcherClosedError(message))

    async def _run_batch(self, dispatch: Dispatch) -> None:
        start_s = self._clock()
        outcomes = await self._call_isolated(list(dispatch.items))
        end_s = self._clock()
        self._mean_batch_s = 0.8 * self._mean_batch_s + 0.2 * (end_s - start_s) \
            if self._mean_batch_s else end_s - start_s
        if self._metrics is not None:
            self._metrics.batch_duration.labels(self.name).observe(end_s - start_s)
        for item, (ok, value) in zip(dispatch.items, outcomes, strict=True):
            future = self._futures.pop(item.item_id, None)
            if future is None or future.done():
                continue
            if ok:
                future.set_result(value)
                if self._metrics is not None:
                    self._metrics.latency.labels(self.name, item.lane).observe(
                        end_s - item.arrival_s)
            else:
                future.set_exception(value)
                if self._metrics is not None:
                    self._metrics.failures.labels(self.name).inc()

    async def _call_isolated(self, items: list[QueuedItem]) -> list[tuple[bool, Any]]:
        """Run `items`; if the call raises, bisect so only the failing items get the error."""
        try:
            return [(True, r) for r in await self._call([it.payload for it in items])]
        except Exception as exc:
            if len(items) == 1 or not self.config.isolate_failures:
                return [(False, exc)] * len(items)
        mid = len(items) // 2
        return await self._call_isolated(items[:mid]) + await self._call_isolated(items[mid:])

    async def _call(self, payloads: list[Any]) -> list[Any]:
        if self._is_async:
            results = await self._fn(payloads)  # type: ignore[misc]
        else:
            results = await _run_on_own_thread(self._fn, payloads, f"batcher-{self.name}")
        results = list(results)
        if len(results) != len(payloads):
            raise RuntimeError(f"batch function returned {len(results)} results for "
                               f"{len(payloads)} items")
        return results

    # -- helpers ---------------------------------------------------------------------------

    def _expire(self, item: QueuedItem, now: float) -> None:
        waited_ms = (now - item.arrival_s) * 1e3
        self._fail(item, ItemTimeoutError(f"item waited {waited_ms:.1f} ms in the queue, "
                                          "past its timeout_ms; it was not run"))
        if self._metrics is not None:
            self._metrics.timeouts.labels(self.name, item.lane).inc()

    def _fail(self, item: QueuedItem, exc: BaseException) -> None:
        future = self._futures.pop(item.item_id, None)
        if future is not None and not future.done():
            future.set_exception(exc)

    def _set_queue_gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_size.labels(self.name).set(len(self._queue))

    def _retry_after_s(self) -> float:
        """Time to drain the queue at the recent batch rate; at least one second."""
        num_batches = math.ceil(len(self._queue) / self.config.max_batch_size)
        return max(1.0, num_batches * self._mean_batch_s)


async def _run_on_own_thread(fn: Callable[[Any], Any], arg: Any, name: str) -> Any:
    """`fn(arg)` on a new thread that ends with the call; its result or exception, awaited.

    Not a thread pool: torch's OpenMP runtime (libgomp) keeps a pool of worker threads per
    thread that ran parallel work, for as long as that thread lives. A pooled batch thread
    would keep one next to the generative engine's, and with more OpenMP threads than cores
    libgomp stops spinning between parallel regions, which slowed `batchinfer serve
    --embedding-model` generation once an embeddings request had run (docs/server.md). A
    thread that ends takes its OpenMP pool with it; starting one costs well under a batch
    (docs/dynamic-batching.md, "Measured figures").
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the awaiting task was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(arg), None)
        except BaseException as exc:  # handed to the awaiting task, like run_in_executor
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits it
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future
