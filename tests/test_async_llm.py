"""AsyncLLM on a tiny random model: streams equal LLM.generate, aborts free blocks, the queue
bound holds, a failing request fails alone, and the engine thread sleeps when idle."""

from __future__ import annotations

import asyncio
import time

import pytest

from batchinfer import LLM, SamplingParams
from batchinfer.core.config import EngineConfig
from batchinfer.engine.async_llm import AsyncLLM, QueueFullError, RequestFailedError
from tests.tiny_models import make_tiny_llama

ENGINE = {"dtype": "float32", "kv_cache_memory": 16 << 20}
POISON = 297  # a prompt containing this token id makes the patched runner raise


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("async")))


def make_llm(model_dir: str, queued: int | None = None, **engine: object) -> AsyncLLM:
    return AsyncLLM.from_config(
        EngineConfig.from_kwargs(model=model_dir, **(ENGINE | engine)),
        max_num_queued_requests=queued,
    )


class StepRecorder:
    def __init__(self) -> None:
        self.steps = []

    def record_step(self, stats) -> None:
        self.steps.append(stats)

    def record_requests(self, stats, now_s) -> None:
        pass


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str | None = None):
    outputs = [out async for out in llm.generate(prompt, params, request_id)]
    return outputs


def joined(outputs, index: int = 0) -> tuple[str, list[int]]:
    """A sequence's text and token ids, put together from its DELTA outputs."""
    parts = [c for o in outputs for c in o.outputs if c.index == index]
    return "".join(c.text for c in parts), [t for c in parts for t in c.token_ids]


async def wait_until(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def test_streams_equal_offline_generate(model_dir):
    prompts = ["the quick brown fox", "Hello world! How are", [5, 6, 7, 8, 9, 10], "attention"]
    params = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.0, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=5, ignore_eos=True),
    ]
    expected = LLM(model_dir, **ENGINE).generate(prompts, params, use_tqdm=False)

    async def main():
        llm = make_llm(model_dir)
        try:
            return await asyncio.gather(*(collect(llm, p, sp) for p, sp in zip(prompts, params, strict=True)))
        finally:
            llm.shutdown()

    for outputs, want in zip(asyncio.run(main()), expected, strict=True):
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        # the deltas add up to the whole sequence, each token and character once
        for completion in want.outputs:
            assert joined(outputs, completion.index) == (completion.text, completion.token_ids)


def test_abort_frees_blocks_and_ends_stream(model_dir):
    async def main():
        llm = make_llm(model_dir)
        recorder = StepRecorder()
        llm.stat_loggers.append(recorder)
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        stream = llm.generate("the quick brown fox", params, "r1")
        first = await anext(stream)
        assert not first.finished
        await stream.aclose()  # the client left
        await wait_until(lambda: recorder.steps and recorder.steps[-1].kv_cache_usage == 0.0)
        assert recorder.steps[-1].num_running == 0
        # an abort by id while another task reads: the reader sees finish_reason "abort"
        started = asyncio.Event()

        async def reader():
            outputs = []
            async for output in llm.generate("Hello", params, "r2"):
                outputs.append(output)
                started.set()
            return outputs

        task = asyncio.ensure_future(reader())
        await started.wait()
        llm.abort("r2")
        outputs = await task
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        assert len(joined(outputs)[1]) < 400
        await wait_until(lambda: recorder.steps[-1].kv_cache_usage == 0.0)
        llm.shutdown()

    asyncio.run(main())


def test_stop_string_finishes_in_engine(model_dir):
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    text = LLM(model_dir, **ENGINE).generate("the quick", greedy, use_tqdm=False)[0].outputs[0].text
    start = next(i for i in range(len(text) // 2, len(text)) if text[i].strip())
    stop = text[start : start + 2]

    async def main():
        llm = make_llm(model_dir)
        recorder = StepRecorder()
        llm.stat_loggers.append(recorder)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
        outputs = await collect(llm, "the quick", params)
        await wait_until(lambda: recorder.steps[-1].kv_cache_usage == 0.0)
        llm.shutdown()
        return outputs

    outputs = asyncio.run(main())
    completion = outputs[-1].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert joined(outputs)[0] == text[: text.find(stop)]


def test_queue_bound_rejects_without_losing_accepted(model_dir):
    async def main():
        llm = make_llm(model_dir, queued=1, max_num_seqs=1)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        results = await asyncio.gather(
            *(collect(llm, f"request number {i}", params) for i in range(6)),
            return_exceptions=True,
        )
        llm.shutdown()
        return results

    results = asyncio.run(main())
    rejected = [r for r in results if isinstance(r, QueueFullError)]
    done = [r for r in results if not isinstance(r, BaseException)]
    assert rejected and done and len(rejected) + len(done) == 6
    for outputs in done:
        assert outputs[-1].outputs[0].finish_reason == "length"
        assert len(joined(outputs)[1]) == 24


def test_failing_request_fails_alone(model_dir):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    good = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    expected = LLM(model_dir, **ENGINE).generate(good, params, use_tqdm=False)

    async def main():
        llm = make_llm(model_dir)
        runner = llm.engine.core.runner
        execute = runner.execute

        def poisoned(scheduler_output):
            if any(
                seq.is_prefill and POISON in seq.token_ids for seq in scheduler_output.sequences
            ):
                raise RuntimeError("poisoned batch")
            return execute(scheduler_output)

        runner.execute = poisoned
        results = await asyncio.gather(
            collect(llm, good[0], params),
            collect(llm, [5, POISON, 7], params, "bad"),
            collect(llm, good[1], params),
            return_exceptions=True,
        )
        # the engine keeps serving
        after = await collect(llm, good[0], params)
        llm.shutdown()
        return results, after

    (first, bad, second), after = asyncio.run(main())
    assert isinstance(bad, RequestFailedError) and "bad" in str(bad)
    assert joined(first)[1] == expected[0].outputs[0].token_ids
    assert joined(second)[1] == expected[1].outputs[0].token_ids
    assert joined(after)[1] == expected[0].outputs[0].token_ids


def test_bad_prompt_raises_and_engine_thread_sleeps_when_idle(model_dir):
    async def main():
        llm = make_llm(model_dir, max_model_len=64)
        calls = []
        step = llm.engine.core.step

        def counting():
            calls.append(1)
            return step()

        llm.engine.core.step = counting
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(llm, list(range(3, 80)), SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="prompt"):
            await collect(llm, "", SamplingParams(max_tokens=4))
        await collect(llm, "hello", SamplingParams(max_tokens=4, temperature=0))
        await asyncio.sleep(0.05)
        idle_calls = len(calls)
        await asyncio.sleep(0.3)
        assert len(calls) == idle_calls  # blocked on the command queue, not spinning
        llm.shutdown()

    asyncio.run(main())


def test_dynamic_batching_dispatches_after_delay(model_dir):
    async def main():
        llm = make_llm(model_dir, batching="dynamic", max_batch_size=8, max_batch_delay_ms=50)
        params = SamplingParams(max_tokens=3, temperature=0)
        try:
            # A lone request waits out the delay window (a lost wake-up would hang: bounded).
            return await asyncio.wait_for(collect(llm, "hello", params), timeout=30)
        finally:
            llm.shutdown()

    outputs = asyncio.run(main())
    assert outputs[-1].finished
    # Measured on the engine's clock from arrival to first scheduling: the forward pass and
    # the event loop are outside it, so only a dispatch before the window could break it.
    assert outputs[-1].metrics.queue_time_s >= 0.05
