"""The engine without a model: `LLMEngine` / `EngineCore` / `AsyncLLM` on the fake runner.

The fake runner simulates a paged KV cache (tests/fake_runner.py), so these run in milliseconds
and still fail when a wrong block, a lost token or a misrouted output slips through.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from batchinfer.core import EngineConfig, SamplingParams, SchedulerOutput
from batchinfer.core.preemption import PreemptionCosts
from batchinfer.core.scheduling.spec_depth import StepCosts
from batchinfer.engine.async_llm import AsyncLLM, RequestFailedError
from batchinfer.engine.core import EngineStepError
from batchinfer.engine.llm_engine import LLMEngine
from batchinfer.engine.outputs import RequestOutputKind
from tests.fake_runner import VOCAB, FakeRunner, reference_tokens

POISON = 999  # a prompt holding this token id makes the poisoned runner raise


class LetterTokenizer:
    """Token i is the letter `chr(97 + i % 26)`; text encodes letter by letter."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


@dataclass
class FakeWorker:
    runner: FakeRunner
    num_blocks: int = 64
    max_model_len: int = 4096
    tokenizer: LetterTokenizer = field(default_factory=LetterTokenizer)
    vocab_size: int = VOCAB
    eos_token_ids: frozenset[int] = frozenset({VOCAB - 1})
    model_name: str = "fake"
    num_swap_blocks: int = 0
    preemption_costs: PreemptionCosts | None = None
    structured_outputs: None = None
    step_costs: StepCosts | None = None
    kv_window: int | None = None


class RecordingRunner(FakeRunner):
    """Keeps every scheduler output; raises on a step that prefills a POISON token."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.outputs: list[SchedulerOutput] = []

    def execute(self, scheduler_output: SchedulerOutput):  # type: ignore[no-untyped-def]
        self.outputs.append(scheduler_output)
        if any(s.is_prefill and POISON in s.token_ids for s in scheduler_output.sequences):
            raise RuntimeError("poisoned step")
        return super().execute(scheduler_output)


def make_engine(num_blocks: int = 64, **config: object) -> LLMEngine:
    runner = RecordingRunner(block_size=4)
    engine_config = EngineConfig.from_kwargs(block_size=4, **config)
    return LLMEngine(engine_config, FakeWorker(runner, num_blocks=num_blocks))


def run(engine: LLMEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)


def test_engine_does_not_import_torch():
    code = (
        "import sys, batchinfer.engine, batchinfer.engine.async_llm, batchinfer.engine.llm_engine\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_output_kinds_agree_and_tokens_are_exact():
    engine = make_engine(num_blocks=20)  # tight: some requests are preempted and recomputed
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
    for i, prompt in enumerate(prompts):
        for kind in kinds:
            engine.add_request(prompt, GREEDY, f"{kind.name}-{i}", kind=kind)
    outputs = run(engine)
    assert engine.core.scheduler.num_preemptions_total > 0
    for i, prompt in enumerate(prompts):
        want = reference_tokens(prompt, GREEDY.max_tokens)
        text = "".join(chr(97 + t % 26) for t in want)
        cumulative = outputs[f"CUMULATIVE-{i}"]
        assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 10))
        assert cumulative[-1].outputs[0].token_ids == want
        assert cumulative[-1].outputs[0].text == text
        delta = outputs[f"DELTA-{i}"]
        assert [t for o in delta for t in o.outputs[0].token_ids] == want
        assert "".join(o.outputs[0].text for o in delta) == text
        (final,) = outputs[f"FINAL_ONLY-{i}"]
        assert final.finished and final.outputs[0].token_ids == want
        assert final.outputs[0].text == text and final.outputs[0].finish_reason == "length"
        assert final.metrics.first_token_s is not None


def test_n_sequences_share_one_request():
    engine = make_engine()
    params = SamplingParams(n=3, max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request([1, 2, 3], params, "r", kind=RequestOutputKind.FINAL_ONLY)
    child_ids = engine.output_processor.child_ids("r")
    assert len(set(child_ids)) == 3 and all(c.startswith("r@") for c in child_ids)
    (final,) = run(engine)["r"]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(c.token_ids == reference_tokens([1, 2, 3], 4) for c in final.outputs)
    assert engine.output_processor.child_ids("r") == []  # forgotten once finished


def test_stop_string_finishes_the_sequence_in_the_core():
    engine = make_engine()
    want = reference_tokens([5, 6, 7], 30)
    text = "".join(chr(97 + t % 26) for t in want)
    stop = text[10:12]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    engine.add_request([5, 6, 7], params, "r", kind=RequestOutputKind.DELTA)
    outputs = run(engine)["r"]
    assert "".join(o.outputs[0].text for o in outputs) == text[: text.find(stop)]
    assert outputs[-1].outputs[0].finish_reason == "stop"
    assert outputs[-1].outputs[0].stop_reason == stop
    assert engine.core.scheduler.block_manager.num_used_blocks == 0
    # The core stopped within a step of the stop string: no token was computed past it.
    assert sum(len(o.outputs[0].token_ids) for o in outputs) <= text.find(stop) + len(stop) + 1


def letters(tokens: list[int]) -> str:
    return "".join(chr(97 + t % 26) for t in tokens)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_held_back_text_and_included_stop_strings(kind):
    engine = make_engine()
    want = letters(reference_tokens([5, 6, 7], 30))
    never = "zzzzzz"  # longer than any run in `want`: held back while running, never matches
    assert never not in want
    stop = want[10:13]
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                 stop=[never]), "held", kind=kind)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                 stop=[stop], include_stop_str_in_output=True),
                       "kept", kind=kind)
    outputs = run(engine)

    def text(request_id: str) -> str:
        pieces = [o.outputs[0].text for o in outputs[request_id]]
        return "".join(pieces) if kind == RequestOutputKind.DELTA else pieces[-1]

    # One letter per token. While running, the last len(never) - 1 letters were held back; at
    # the length finish they come out.
    shown, visible = 0, []
    for output in outputs["held"][:-1]:
        text_now = output.outputs[0].text
        shown = shown + len(text_now) if kind == RequestOutputKind.DELTA else len(text_now)
        visible.append(shown)
    assert visible == [max(0, n - (len(never) - 1)) for n in range(1, 30)]
    assert text("held") == want
    assert text("kept") == want[: want.find(stop) + len(stop)]
    assert outputs["kept"][-1].outputs[0].stop_reason == stop


def test_abort_ends_every_sequence_with_its_text_so_far():
    engine = make_engine()
    params = SamplingParams(n=2, max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request([8, 9], params, "r", kind=RequestOutputKind.DELTA)
    streamed = []
    for _ in range(4):
        streamed += engine.step()
    final = engine.abort_request("r")
    assert final is not None and final.finished
    assert [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    text = "".join(c.text for o in [*streamed, final] for c in o.outputs if c.index == 1)
    assert text == letters(reference_tokens([8, 9], 4))
    assert engine.core.scheduler.block_manager.num_used_blocks == 0
    assert engine.abort_request("r") is None


def test_core_add_requests_is_all_or_nothing():
    engine = make_engine()
    first = engine.processor.process([1, 2, 3], GREEDY, "a").sequences
    engine.core.add_requests(first)
    again = engine.processor.process([4, 5], SamplingParams(n=2), "b").sequences
    again[1].request_id = first[0].request_id  # the second sequence is refused
    with pytest.raises(ValueError, match="already in use"):
        engine.core.add_requests(again)
    assert engine.core.scheduler.num_waiting == 1  # b's first sequence was taken back


def test_a_step_where_every_sequence_fails_stops_the_engine():
    engine = make_engine()
    engine.add_request([POISON], GREEDY, "x")
    engine.add_request([POISON, 1], GREEDY, "y")
    with pytest.raises(EngineStepError, match="all 2 sequences"):
        engine.step()


def test_token_history_goes_to_the_runner_only_for_penalties():
    engine = make_engine()
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                               repetition_penalty=1.2)
    engine.add_request([1, 2, 3, 4], plain, "plain")
    engine.add_request([5, 6, 7, 8], penalised, "penalised")
    run(engine)
    runner = engine.core.runner
    sampled = [s for out in runner.outputs for s in out.sequences if s.sample]  # type: ignore[attr-defined]
    assert {s.request_id.split("@")[0] for s in sampled} == {"plain", "penalised"}
    assert all(s.all_token_ids is None for s in sampled if s.request_id.startswith("plain@"))
    history = [s.all_token_ids for s in sampled if s.request_id.startswith("penalised@")]
    assert history[0] == [5, 6, 7, 8] and len(history[-1]) == 4 + 5


def test_a_failing_request_fails_alone_and_is_logged_once(caplog):
    engine = make_engine()
    for request_id, prompt in (("a", [1, 2, 3]), ("bad", [4, POISON, 6]), ("b", [7, 8, 9])):
        engine.add_request(prompt, GREEDY, request_id, kind=RequestOutputKind.FINAL_ONLY)
    with caplog.at_level(logging.ERROR, logger="batchinfer.engine.core"):
        outputs = run(engine)
    assert outputs["a"][0].outputs[0].token_ids == reference_tokens([1, 2, 3], 9)
    assert outputs["b"][0].outputs[0].token_ids == reference_tokens([7, 8, 9], 9)
    bad = outputs["bad"][0]
    assert bad.finished and bad.outputs[0].finish_reason == "abort"
    assert bad.error is not None and "poisoned step" in bad.error
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1 and "poisoned step" in str(tracebacks[0].exc_info[1])
    assert engine.core.scheduler.block_manager.num_used_blocks == 0


def test_bad_input_leaves_nothing_queued():
    engine = make_engine(num_blocks=8)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 5000, GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):  # 8 blocks of 4 tokens
        engine.add_request(list(range(1, 40)), SamplingParams(n=2))
    engine.add_request([1, 2], GREEDY, "dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], GREEDY, "dup")
    assert engine.core.scheduler.num_waiting == 1
    assert engine.output_processor.num_unfinished_requests == 1


def test_async_stream_hands_each_character_once():
    """2,000 tokens streamed as deltas: the loop sees each token and character exactly once."""
    engine = make_engine(num_blocks=600)
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)

    async def main():
        llm = AsyncLLM(engine)
        try:
            return [o async for o in llm.generate([3, 4, 5], params, "long")]
        finally:
            llm.shutdown()

    outputs = asyncio.run(main())
    want = reference_tokens([3, 4, 5], 2000)
    assert sum(len(o.outputs[0].text) for o in outputs) == 2000
    assert "".join(o.outputs[0].text for o in outputs) == "".join(chr(97 + t % 26) for t in want)
    assert [t for o in outputs for t in o.outputs[0].token_ids] == want


def test_async_failure_fails_the_stream_only():
    engine = make_engine()

    async def main():
        llm = AsyncLLM(engine)
        try:
            good, bad = await asyncio.gather(
                _collect(llm, [1, 2, 3], "good"), _collect(llm, [POISON], "bad"),
                return_exceptions=True,
            )
        finally:
            llm.shutdown()
        return good, bad

    good, bad = asyncio.run(main())
    assert isinstance(bad, RequestFailedError) and "poisoned step" in str(bad)
    assert [t for o in good for t in o.outputs[0].token_ids] == reference_tokens([1, 2, 3], 9)


async def _collect(llm: AsyncLLM, prompt: list[int], request_id: str) -> list:
    return [o async for o in llm.generate(prompt, GREEDY, request_id)]


def test_a_lagging_reader_gets_merged_deltas_and_tokens_are_counted_once():
    engine = make_engine()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    counted = []

    class Counter:
        def record_step(self, stats) -> None:
            pass

        def record_requests(self, stats, now_s) -> None:
            counted.extend(s.num_new_tokens for s in stats)

    async def main():
        llm = AsyncLLM(engine)
        llm.stat_loggers.append(Counter())
        outputs = []
        try:
            async for output in llm.generate([1, 2], params, "slow"):
                outputs.append(output)
                await asyncio.sleep(0.02)  # the engine steps on meanwhile
        finally:
            llm.shutdown()
        return outputs

    outputs = asyncio.run(main())
    assert len(outputs) < 40  # several steps' deltas were merged into one output
    assert [t for o in outputs for t in o.outputs[0].token_ids] == reference_tokens([1, 2], 40)
    assert sum(counted) == 40
