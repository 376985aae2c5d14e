"""`batched_map`: offline fixed batches, sorted by length inside a window, input order kept."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from batchinfer.core.validation import check_int

T = TypeVar("T")
R = TypeVar("R")


def batched_map(
    fn: Callable[[list[T]], Sequence[R]],
    items: Iterable[T],
    batch_size: int = 64,
    *,
    max_batch_tokens: int | None = None,
    length_fn: Callable[[T], int] | None = None,
    sort_window: int | None = None,
    progress: bool = False,
    desc: str = "batches",
    return_exceptions: bool = False,
    num_workers: int = 1,
) -> list[R | Exception]:
    """Apply `fn(list[item]) -> list[result]` to `items` in batches; results in input order.

    With `length_fn`, each window of `sort_window` items (default 64 batches' worth) is sorted
    by length, longest first, so each batch pads little; `max_batch_tokens` then caps the padded
    cost (longest x count) of a batch. `progress=True` shows a tqdm bar on stderr.
    `return_exceptions=True` bisects a failing batch and puts each failing item's exception in
    its place; otherwise the first error is raised. `num_workers > 1` runs that many batches at
    once in threads (for a torch model on CPU: one stream per core, each with 1 torch thread).
    """
    return list(iter_batched_map(
        fn, items, batch_size, max_batch_tokens=max_batch_tokens, length_fn=length_fn,
        sort_window=sort_window, progress=progress, desc=desc,
        return_exceptions=return_exceptions, num_workers=num_workers))


def iter_batched_map(
    fn: Callable[[list[T]], Sequence[R]],
    items: Iterable[T],
    batch_size: int = 64,
    *,
    max_batch_tokens: int | None = None,
    length_fn: Callable[[T], int] | None = None,
    sort_window: int | None = None,
    progress: bool = False,
    desc: str = "batches",
    return_exceptions: bool = False,
    num_workers: int = 1,
) -> Iterator[R | Exception]:
    """Like `batched_map`, but yields results in input order one window at a time, so an
    unbounded input streams with bounded memory."""
    check_int("batch_size", batch_size)
    if max_batch_tokens is not None:
        check_int("max_batch_tokens", max_batch_tokens)
    window_size = sort_window if sort_window is not None else 64 * batch_size
    check_int("sort_window", window_size)
    check_int("num_workers", num_workers)
    total = len(items) if isinstance(items, Sized) else None
    bar = _progress_bar(total, desc) if progress else None
    pool = ThreadPoolExecutor(num_workers, "batched-map") if num_workers > 1 else None
    iterator = iter(items)

    def run(batch: list[T]) -> list[Any]:
        return _run(fn, batch) if return_exceptions else _checked(fn, batch)

    try:
        while window := list(itertools.islice(iterator, window_size)):
            lengths = [length_fn(x) for x in window] if length_fn is not None else None
            batches = list(_cut(lengths, len(window), batch_size, max_batch_tokens))
            inputs = [[window[i] for i in indices] for indices in batches]
            outputs = pool.map(run, inputs) if pool is not None else map(run, inputs)
            results: list[Any] = [None] * len(window)
            for indices, batch_outputs in zip(batches, outputs, strict=True):
                for i, output in zip(indices, batch_outputs, strict=True):
                    results[i] = output
                if bar is not None:
                    bar.update(len(indices))
            yield from results
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()


def _cut(lengths: list[int] | None, num_items: int, batch_size: int,
         max_batch_tokens: int | None) -> Iterator[list[int]]:
    """Batches of indices: longest first, at most `batch_size` items and, with lengths,
    at most `max_batch_tokens` padded tokens (a single longer item still gets its own batch)."""
    if lengths is None:
        order = list(range(num_items))
        for start in range(0, num_items, batch_size):
            yield order[start:start + batch_size]
        return
    order = sorted(range(num_items), key=lambda i: -lengths[i])
    batch: list[int] = []
    for i in order:
        # Sorted longest first, so the batch's padded length is its first item's length.
        longest = lengths[batch[0]] if batch else lengths[i]
        over_budget = max_batch_tokens is not None and longest * (len(batch) + 1) > max_batch_tokens
        if batch and (len(batch) == batch_size or over_budget):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _checked(fn: Callable[[list[T]], Sequence[R]], batch: list[T]) -> list[R]:
    outputs = list(fn(batch))
    if len(outputs) != len(batch):
        raise RuntimeError(f"batch function returned {len(outputs)} results for {len(batch)} items")
    return outputs


def _run(fn: Callable[[list[T]], Sequence[R]], batch: list[T]) -> list[R | Exception]:
    """Run with failure isolation: bisect until each failing item is alone."""
    try:
        return list(_checked(fn, batch))
    except Exception as exc:
        if len(batch) == 1:
            return [exc]
    mid = len(batch) // 2
    return _run(fn, batch[:mid]) + _run(fn, batch[mid:])


def _progress_bar(total: int | None, desc: str) -> Any:
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, desc=desc, unit="item", dynamic_ncols=True)
