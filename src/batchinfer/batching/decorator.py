"""`@batch`: turn a list-in/list-out function into a per-item coroutine backed by a batcher."""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable
from typing import Any

from batchinfer.batching.batcher import BatchFn, DynamicBatcher
from batchinfer.batching.config import BatcherConfig
from batchinfer.batching.metrics import BatcherMetrics


class BatchedFunction:
    """What `@batch` returns: `await f(item)` queues `item` and returns its own result.

    One `DynamicBatcher` per event loop (and per instance when decorating a method), created
    on first use, so the function works under successive `asyncio.run()` calls.
    """

    def __init__(self, fn: BatchFn[Any, Any], config: BatcherConfig,
                 length_fn: Callable[[Any], int] | None, metrics: BatcherMetrics | None,
                 name: str) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.config = config
        self._length_fn = length_fn
        self._metrics = metrics
        self._name = name
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DynamicBatcher] = (
            weakref.WeakKeyDictionary())
        self._bound: weakref.WeakKeyDictionary[Any, BatchedFunction] = weakref.WeakKeyDictionary()

    async def __call__(self, item: Any, *, lane: str | None = None,
                       timeout_ms: float | None = None) -> Any:
        return await self.batcher.submit(item, lane=lane, timeout_ms=timeout_ms)

    def __get__(self, instance: Any, owner: type | None = None) -> BatchedFunction:
        if instance is None:
            return self
        bound = self._bound.get(instance)
        if bound is None:
            bound = BatchedFunction(functools.partial(self._fn, instance), self.config,
                                    self._length_fn, self._metrics, self._name)
            self._bound[instance] = bound
        return bound

    @property
    def batcher(self) -> DynamicBatcher[Any, Any]:
        """The batcher of the running event loop (created on first use)."""
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(loop)
        if batcher is None:
            batcher = DynamicBatcher(self._fn, self.config, length_fn=self._length_fn,
                                     metrics=self._metrics, name=self._name)
            self._batchers[loop] = batcher
        return batcher

    async def close(self) -> None:
        """Drain and stop the running loop's batcher."""
        batcher = self._batchers.pop(asyncio.get_running_loop(), None)
        if batcher is not None:
            await batcher.close()


def batch(
    fn: BatchFn[Any, Any] | None = None,
    *,
    config: BatcherConfig | None = None,
    length_fn: Callable[[Any], int] | None = None,
    metrics: BatcherMetrics | None = None,
    name: str | None = None,
    **overrides: Any,
) -> Any:
    """Decorate `fn(list[item]) -> list[result]` (sync or async, function or method) so that
    `await fn(item)` batches concurrent calls with a `DynamicBatcher`.

    ```python
    @batch(max_batch_size=32, max_batch_delay_ms=5)
    async def classify(images: list[Tensor]) -> list[int]: ...

    label = await classify(image)
    ```
    Keyword arguments are `BatcherConfig` fields; `ValueError` names a bad one.
    """
    base = config or BatcherConfig()
    resolved = BatcherConfig(**{**_as_dict(base), **overrides}) if overrides else base

    def wrap(f: BatchFn[Any, Any]) -> BatchedFunction:
        if not callable(f):
            raise ValueError(f"fn must be callable, got {type(f).__name__}")
        return BatchedFunction(f, resolved, length_fn, metrics,
                               name or str(getattr(f, "__name__", "batched")))

    return wrap(fn) if fn is not None else wrap


def _as_dict(config: BatcherConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}
