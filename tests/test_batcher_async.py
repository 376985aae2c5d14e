"""The asyncio `DynamicBatcher`, `@batch` and `batched_map` with fake model functions."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from batchinfer.batching import (
    BatcherClosedError,
    BatcherMetrics,
    DynamicBatcher,
    ItemTimeoutError,
    OverloadedError,
    batch,
    batched_map,
)
from tests.waiting import until


class Recorder:
    """A batch function that records its calls; `poison` items make a whole call raise."""

    def __init__(self, poison: object = "poison") -> None:
        self.calls: list[list[object]] = []
        self.poison = poison

    def __call__(self, items: list[object]) -> list[object]:
        self.calls.append(list(items))
        if self.poison in items:
            raise RuntimeError("poisoned batch")
        return [f"r({x})" for x in items]


class FakeClock:
    """The batcher's clock, moved by the test: items fall due or expire when it says so."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Gate:
    """A sync batch function (it runs on a batch thread) that blocks until `release()`.

    `await gate.entered()` returns once a batch is inside, so the test knows what runs."""

    def __init__(self) -> None:
        self.seen: list[object] = []
        self._inside = threading.Event()
        self._open = threading.Event()

    def __call__(self, items: list[object]) -> list[object]:
        self.seen.extend(items)
        self._inside.set()
        self._open.wait(10)
        return items

    async def entered(self) -> None:
        assert await asyncio.to_thread(self._inside.wait, 10), "no batch started"

    def release(self) -> None:
        self._open.set()


def test_concurrent_submits_are_batched_and_results_keep_order() -> None:
    rec = Recorder()

    async def main() -> list[object]:
        async with DynamicBatcher(rec, max_batch_size=4, max_batch_delay_ms=20,
                                  num_buckets=1) as b:
            return await asyncio.gather(*(b.submit(i) for i in range(10)))

    assert asyncio.run(main()) == [f"r({i})" for i in range(10)]
    assert [len(c) for c in rec.calls] == [4, 4, 2]


def test_sync_batches_run_off_the_loop_on_threads_that_end_with_them() -> None:
    # A batch thread that outlived its batch would keep torch's OpenMP pool alive next to the
    # generative engine's (see batcher._run_on_own_thread).
    seen: list[threading.Thread] = []

    def fn(items: list[object]) -> list[object]:
        seen.append(threading.current_thread())
        return items

    async def main() -> list[object]:
        async with DynamicBatcher(fn, max_batch_size=2, max_batch_delay_ms=1,
                                  num_buckets=1, name="enc") as b:
            first = await b.submit("a")
            second = await b.submit("b")
            return [first, second]

    assert asyncio.run(main()) == ["a", "b"]
    assert len(seen) == 2 and seen[0] is not seen[1]
    assert all(t is not threading.main_thread() and t.name == "batcher-enc" for t in seen)
    for t in seen:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in seen)


def test_lone_item_waits_about_the_delay_not_longer() -> None:
    rec = Recorder()

    async def main() -> float:
        async with DynamicBatcher(rec, max_batch_size=32, max_batch_delay_ms=30) as b:
            start = time.monotonic()
            await b.submit("x")
            return time.monotonic() - start

    waited = asyncio.run(main())
    assert 0.029 <= waited < 0.25


def test_bisection_isolates_one_poisoned_item() -> None:
    rec = Recorder()

    async def main() -> list[object]:
        async with DynamicBatcher(rec, max_batch_size=8, max_batch_delay_ms=20,
                                  num_buckets=1) as b:
            items = ["a", "b", "c", "poison", "d", "e", "f", "g"]
            return await asyncio.gather(*(b.submit(x) for x in items), return_exceptions=True)

    results = asyncio.run(main())
    assert results[:3] == ["r(a)", "r(b)", "r(c)"] and results[4:] == ["r(d)", "r(e)", "r(f)",
                                                                        "r(g)"]
    assert isinstance(results[3], RuntimeError) and "poisoned" in str(results[3])
    assert len(rec.calls) <= 1 + 2 * 3  # the batch, then at most two calls per halving level


def test_without_isolation_the_whole_batch_fails() -> None:
    rec = Recorder()

    async def main() -> list[object]:
        async with DynamicBatcher(rec, max_batch_size=4, max_batch_delay_ms=10,
                                  isolate_failures=False) as b:
            return await asyncio.gather(*(b.submit(x) for x in ["a", "poison"]),
                                        return_exceptions=True)

    assert all(isinstance(r, RuntimeError) for r in asyncio.run(main()))


def test_wrong_result_count_is_an_error_for_the_items() -> None:
    async def main() -> object:
        async with DynamicBatcher(lambda xs: xs[:-1], max_batch_delay_ms=0) as b:
            return await asyncio.gather(b.submit(1), return_exceptions=True)

    (result,) = asyncio.run(main())
    assert isinstance(result, RuntimeError) and "results" in str(result)


def test_overload_raises_with_retry_after_and_counts() -> None:
    registry = CollectorRegistry()
    gate = Gate()

    async def main() -> tuple[list[object], OverloadedError]:
        b = DynamicBatcher(gate, max_batch_size=1, max_batch_delay_ms=0, max_queue_size=2,
                           metrics=BatcherMetrics(registry), name="t")
        running = asyncio.ensure_future(b.submit(0))  # occupies the worker
        await gate.entered()
        waiting = [asyncio.ensure_future(b.submit(i)) for i in (1, 2)]
        await until(lambda: b.num_waiting == 2)
        with pytest.raises(OverloadedError) as info:
            await b.submit(3)
        with pytest.raises(OverloadedError):
            await b.submit_many([4])
        gate.release()
        results = await asyncio.gather(running, *waiting)
        await b.close()
        return results, info.value

    results, error = asyncio.run(main())
    assert results == [0, 1, 2] and error.retry_after_s >= 1
    text = generate_latest(registry).decode()
    assert 'batchinfer_encoder_overloads_total{batcher="t"} 2.0' in text


def test_expired_items_fail_and_never_run() -> None:
    gate, clock = Gate(), FakeClock()

    async def main() -> list[object]:
        async with DynamicBatcher(gate, max_batch_size=1, max_batch_delay_ms=0,
                                  clock=clock) as b:
            first = asyncio.ensure_future(b.submit(1))
            await gate.entered()
            late = asyncio.ensure_future(b.submit(2, timeout_ms=20))
            await until(lambda: b.num_waiting == 1)
            clock.now_s = 1.0  # 2's deadline (0.02 s) passes while 1 still runs
            late_result = await asyncio.gather(late, return_exceptions=True)
            gate.release()
            return [await first, *late_result]

    first, late = asyncio.run(main())
    assert first == 1 and isinstance(late, ItemTimeoutError)
    assert gate.seen == [1]


def test_cancelled_waiting_item_never_runs() -> None:
    rec = Recorder()

    clock = FakeClock()

    async def main() -> list[object]:
        async with DynamicBatcher(rec, max_batch_size=8, max_batch_delay_ms=50,
                                  clock=clock) as b:
            keep = asyncio.ensure_future(b.submit("keep"))
            drop = asyncio.ensure_future(b.submit("drop"))
            await until(lambda: b.num_waiting == 2)  # neither is due: the clock stands still
            drop.cancel()
            await until(lambda: b.num_waiting == 1)
            assert rec.calls == []
            clock.now_s = 1.0  # "keep" is due
            return [await keep]

    assert asyncio.run(main()) == ["r(keep)"]
    assert rec.calls == [["keep"]]


@pytest.mark.parametrize("max_concurrent_batches", [1, 2])
def test_a_burst_runs_at_most_max_concurrent_batches_at_once(max_concurrent_batches: int) -> None:
    # 16 items at once are 4 full batches, all ready in the same pass of the dispatch loop.
    async def main() -> tuple[list[int], int, list[int]]:
        entered, release = asyncio.Event(), asyncio.Event()
        running, most_running, sizes = 0, 0, []

        async def held(items: list[int]) -> list[int]:
            nonlocal running, most_running
            running += 1
            most_running = max(most_running, running)
            sizes.append(len(items))
            entered.set()
            await release.wait()  # every batch started in this pass runs before the test resumes
            running -= 1
            return items

        async with DynamicBatcher(held, max_batch_size=4, max_batch_delay_ms=0, num_buckets=1,
                                  max_concurrent_batches=max_concurrent_batches) as b:
            results = asyncio.gather(*(b.submit(i) for i in range(16)))
            await entered.wait()
            release.set()
            return await results, most_running, sizes

    results, most_running, sizes = asyncio.run(main())
    assert results == list(range(16)) and sizes == [4, 4, 4, 4]
    assert most_running == max_concurrent_batches


def test_a_batch_that_dies_fails_only_its_items_and_frees_its_slot() -> None:
    class Abort(BaseException):
        """Not an `Exception`: failure isolation does not catch it; the batch task dies."""

    async def fragile(items: list[str]) -> list[str]:
        if "cancel" in items:
            raise asyncio.CancelledError  # the batch task ends cancelled
        if "abort" in items:
            raise Abort
        return items

    async def main() -> list[object]:
        async with DynamicBatcher(fragile, max_batch_size=1, max_batch_delay_ms=0,
                                  max_concurrent_batches=1) as b:
            return await asyncio.gather(*(b.submit(x) for x in ("cancel", "abort", "ok")),
                                        return_exceptions=True)

    cancelled, aborted, ok = asyncio.run(main())
    assert isinstance(cancelled, BatcherClosedError) and "cancelled" in str(cancelled)
    assert isinstance(aborted, BatcherClosedError) and "Abort" in str(aborted)
    assert ok == "ok"  # ran after both: each dead batch gave its slot back


def test_submit_many_keeps_order_and_reports_first_error() -> None:
    rec = Recorder()

    async def main() -> tuple[list[object], Exception]:
        async with DynamicBatcher(rec, max_batch_size=3, max_batch_delay_ms=5) as b:
            ok = await b.submit_many(["x", "y", "z", "w"])
            with pytest.raises(RuntimeError) as info:
                await b.submit_many(["p", "poison"])
            return ok, info.value

    ok, error = asyncio.run(main())
    assert ok == ["r(x)", "r(y)", "r(z)", "r(w)"] and "poisoned" in str(error)


def test_close_without_drain_fails_waiting_items() -> None:
    async def main() -> object:
        b = DynamicBatcher(Recorder(), max_batch_delay_ms=10_000)
        pending = asyncio.ensure_future(b.submit("x"))
        await until(lambda: b.num_waiting == 1)
        await b.close(drain=False)
        with pytest.raises(BatcherClosedError):
            await b.submit("y")
        return (await asyncio.gather(pending, return_exceptions=True))[0]

    assert isinstance(asyncio.run(main()), BatcherClosedError)


def test_metrics_record_batches_padding_and_latency() -> None:
    registry = CollectorRegistry()

    async def main() -> None:
        async with DynamicBatcher(lambda xs: xs, max_batch_size=4, max_batch_delay_ms=10,
                                  num_buckets=1, length_fn=len,
                                  metrics=BatcherMetrics(registry), name="m") as b:
            await asyncio.gather(*(b.submit("a" * n) for n in (1, 2, 3, 6)))

    asyncio.run(main())
    text = generate_latest(registry).decode()
    assert 'batchinfer_encoder_batch_size_sum{batcher="m"} 4.0' in text
    # lengths 1, 2, 3, 6 padded to 6: 12 real of 24 -> ratio 0.5
    assert 'batchinfer_batch_padding_ratio_sum{batcher="m"} 0.5' in text
    assert 'batchinfer_encoder_request_latency_seconds_count{batcher="m",lane="interactive"} 4.0' \
        in text
    assert 'batchinfer_encoder_dispatches_total{batcher="m",reason="size"} 1.0' in text


def test_batch_decorator_on_functions_and_methods() -> None:
    calls: list[int] = []

    @batch(max_batch_size=8, max_batch_delay_ms=5)
    async def double(xs: list[int]) -> list[int]:
        calls.append(len(xs))
        return [2 * x for x in xs]

    class Model:
        def __init__(self, offset: int) -> None:
            self.offset = offset

        @batch(max_batch_size=8, max_batch_delay_ms=5)
        def add(self, xs: list[int]) -> list[int]:  # sync: runs in a worker thread
            return [x + self.offset for x in xs]

    async def main() -> tuple[list[int], list[int], list[int]]:
        a, b = Model(100), Model(1000)
        doubled = await asyncio.gather(*(double(i) for i in range(5)))
        added = await asyncio.gather(*(a.add(i) for i in range(3)))
        other = await asyncio.gather(*(b.add(i) for i in range(3)))
        return doubled, added, other

    assert asyncio.run(main()) == ([0, 2, 4, 6, 8], [100, 101, 102], [1000, 1001, 1002])
    assert calls == [5]
    assert asyncio.run(double(21)) == 42  # a second event loop gets its own batcher
    with pytest.raises(ValueError, match="max_batch_size"):
        batch(max_batch_size=0)


def test_batched_map_keeps_order_sorts_by_length_and_respects_budget() -> None:
    seen: list[list[str]] = []

    def fn(xs: list[str]) -> list[str]:
        seen.append(xs)
        return [x.upper() for x in xs]

    items = ["a" * n for n in (3, 9, 1, 7, 5, 2, 8, 4, 6)]
    out = batched_map(fn, items, batch_size=4, length_fn=len, max_batch_tokens=20)
    assert out == [x.upper() for x in items]
    assert [len(x) for x in seen[0]] == [9, 8]  # longest first; 3 x 9 = 27 > 20
    for b in seen:
        assert max(map(len, b)) * len(b) <= 20 and len(b) <= 4
    assert batched_map(fn, items, batch_size=4, num_workers=2) == out


def test_batched_map_windows_and_isolated_failures() -> None:
    def fn(xs: list[int]) -> list[int]:
        if 13 in xs:
            raise ValueError("unlucky")
        return [x * 10 for x in xs]

    out = batched_map(fn, range(20), batch_size=8, sort_window=5, return_exceptions=True)
    assert [x for x in out if not isinstance(x, Exception)] == [i * 10 for i in range(20)
                                                                 if i != 13]
    assert isinstance(out[13], ValueError)
    with pytest.raises(ValueError, match="unlucky"):
        batched_map(fn, range(20), batch_size=8)
    with pytest.raises(ValueError, match="batch_size"):
        batched_map(fn, [1], batch_size=0)
