"""Scheduler driven step by step with a fake runner; invariants checked after every step."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from batchinfer.core import EngineConfig, Request, RequestStatus, SamplingParams
from batchinfer.core.scheduling.scheduler import Scheduler
from tests.fake_runner import FakeRunner, reference_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_request(i: int, prompt_len: int, max_tokens: int, arrival_s: float = 0.0, **kw) -> Request:
    prompt = [(i * 7 + j) % 997 + 1 for j in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)
    return Request(f"r{i}", prompt, params, arrival_s=arrival_s, eos_token_ids=frozenset({0}))


def check_step(sched: Scheduler, out, config: EngineConfig) -> None:
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    free = set(bm._free)
    for seq in out.sequences:
        assert not free & set(seq.block_table), "a scheduled sequence references a free block"
        held = len(seq.block_table) + seq.num_dropped_blocks  # dropped: outside the window
        assert held * bm.block_size >= seq.num_computed_tokens + seq.num_tokens
    assert out.num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(out.sequences) <= config.max_num_seqs
    assert len(sched.running) <= config.max_num_seqs
    ids = [s.request_id for s in out.sequences]
    assert len(ids) == len(set(ids))


def run_to_end(sched: Scheduler, config: EngineConfig, max_steps: int = 10_000, clock=None):
    runner = FakeRunner(config.block_size)
    outputs: dict[str, list[int]] = {}
    trace = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_step(sched, out, config)
        trace.append(out)
        if out.is_empty:
            if clock is None:
                raise AssertionError("scheduler made no progress")
            clock.now += 0.001
            continue
        for upd in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(upd.request_id, []).extend(upd.new_token_ids)
        sched.block_manager.check_invariants()
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return outputs, trace


def workload(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 90), rng.randint(1, 40)) for _ in range(n)]


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"max_num_batched_tokens": 7},  # tiny budget: every prompt is chunked
        {"max_num_seqs": 3},
        {"batching": "static", "max_batch_size": 5},
        {"batching": "dynamic", "max_batch_size": 4},
    ],
    ids=["continuous", "chunked", "few-seqs", "static", "dynamic"],
)
def test_outputs_exact_under_every_schedule(knobs):
    config = EngineConfig(block_size=4, max_num_batched_tokens=knobs.pop("max_num_batched_tokens", 64), **knobs)
    sched = Scheduler(config, num_blocks=200, max_model_len=512)
    reqs = workload(31)
    for i, (p, m) in enumerate(reqs):
        sched.add_request(make_request(i, p, m))
    sched.close_input()
    outputs, _ = run_to_end(sched, config)
    for i, (p, m) in enumerate(reqs):
        prompt = make_request(i, p, m).prompt_token_ids
        assert outputs[f"r{i}"] == reference_tokens(prompt, m), f"r{i}"


def test_forced_preemption_keeps_outputs_and_counts():
    config = EngineConfig(block_size=4, max_num_batched_tokens=64)
    # 30 blocks * 4 = 120 token slots for 12 requests of up to ~130 tokens: must preempt.
    sched = Scheduler(config, num_blocks=30, max_model_len=120)
    reqs = [(random.Random(i).randint(5, 60), 40) for i in range(12)]
    for i, (p, m) in enumerate(reqs):
        sched.add_request(make_request(i, p, m))
    outputs, _ = run_to_end(sched, config)
    assert sched.num_preemptions_total > 0
    for i, (p, m) in enumerate(reqs):
        prompt = make_request(i, p, m).prompt_token_ids
        expected = reference_tokens(prompt, m)[: 120 - p]  # max_model_len caps the length
        assert outputs[f"r{i}"] == expected


def test_victim_is_latest_arrival():
    config = EngineConfig(block_size=4, max_num_batched_tokens=100, kv_admission_watermark=1.0)
    sched = Scheduler(config, num_blocks=6, max_model_len=24)
    for i in range(3):
        sched.add_request(make_request(i, 8, 10))  # 2 blocks each: all 6 used after prefill
    runner = FakeRunner(4)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.block_manager.num_free_blocks == 0
    out = sched.schedule()  # r0 needs a third block at position 8: the latest (r2) is preempted
    assert [s.request_id for s in out.sequences] == ["r0", "r1"]
    assert sched.waiting.first().request_id == "r2"
    assert sched.waiting.first().status == RequestStatus.PREEMPTED
    assert "r2" in sched.schedule().finished_request_ids  # the runner hears of it next step
    sched.block_manager.check_invariants()


def test_fcfs_admission_order():
    config = EngineConfig(block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    sched = Scheduler(config, num_blocks=100, max_model_len=256)
    for i in range(6):
        sched.add_request(make_request(i, 10, 3, arrival_s=float(i)))
    _, trace = run_to_end(sched, config)
    first_seen: list[str] = []
    for out in trace:
        for seq in out.sequences:
            if seq.request_id not in first_seen:
                first_seen.append(seq.request_id)
    assert first_seen == [f"r{i}" for i in range(6)]


def test_continuous_admits_while_others_run():
    config = EngineConfig(block_size=4, max_num_batched_tokens=64)
    sched = Scheduler(config, num_blocks=100, max_model_len=256)
    runner = FakeRunner(4)
    sched.add_request(make_request(0, 5, 20))
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request(1, 5, 5))
    out = sched.schedule()
    assert {s.request_id for s in out.sequences} == {"r0", "r1"}
    assert [s.is_prefill for s in out.sequences] == [False, True]  # decode and prefill mixed


def test_static_waits_for_full_batch_until_input_closes():
    config = EngineConfig(block_size=4, batching="static", max_batch_size=4)
    sched = Scheduler(config, num_blocks=100, max_model_len=256)
    runner = FakeRunner(4)
    for i in range(3):
        sched.add_request(make_request(i, 5, 2))
    assert sched.schedule().is_empty  # 3 < 4 and more may come
    sched.add_request(make_request(3, 5, 2))
    sched.add_request(make_request(4, 5, 2))
    out = sched.schedule()
    assert [s.request_id for s in out.sequences] == ["r0", "r1", "r2", "r3"]
    sched.add_request(make_request(5, 5, 2))
    while sched.running:
        assert {s.request_id for s in out.sequences} <= {"r0", "r1", "r2", "r3"}
        sched.update_from_output(out, runner.execute(out))
        out = sched.schedule()
    assert out.is_empty and sched.num_waiting == 2  # a partial batch is not run...
    sched.close_input()
    out = sched.schedule()  # ...until no more input is coming
    assert [s.request_id for s in out.sequences] == ["r4", "r5"]


def test_dynamic_dispatches_on_delay_from_oldest_arrival():
    clock = Clock()
    config = EngineConfig(block_size=4, batching="dynamic", max_batch_size=4, max_batch_delay_ms=10)
    sched = Scheduler(config, num_blocks=100, max_model_len=256, clock=clock)
    runner = FakeRunner(4)
    sched.add_request(make_request(0, 5, 3, arrival_s=0.0))
    clock.now = 0.006
    sched.add_request(make_request(1, 5, 3, arrival_s=0.006))
    assert sched.schedule().is_empty
    assert sched.next_dispatch_s() == pytest.approx(0.010)
    clock.now = 0.0101  # timed from the OLDEST request, not the newest
    out = sched.schedule()
    assert [s.request_id for s in out.sequences] == ["r0", "r1"]
    sched.add_request(make_request(2, 5, 3, arrival_s=clock.now))
    clock.now += 1.0
    while {"r0", "r1"} & set(sched.requests):  # a running batch is never joined by newcomers
        assert "r2" not in {s.request_id for s in out.sequences}
        sched.update_from_output(out, runner.execute(out))
        out = sched.schedule()
    assert [s.request_id for s in out.sequences] == ["r2"]


def test_dynamic_dispatches_at_size_without_waiting():
    clock = Clock()
    config = EngineConfig(block_size=4, batching="dynamic", max_batch_size=3, max_batch_delay_ms=1e6)
    sched = Scheduler(config, num_blocks=100, max_model_len=256, clock=clock)
    for i in range(4):
        sched.add_request(make_request(i, 5, 3))
    out = sched.schedule()
    assert [s.request_id for s in out.sequences] == ["r0", "r1", "r2"]


def test_stop_conditions():
    config = EngineConfig(block_size=4)
    sched = Scheduler(config, num_blocks=50, max_model_len=256)
    prompt = make_request(0, 6, 1).prompt_token_ids
    ref = reference_tokens(prompt, 10)
    cases = {
        "eos": (SamplingParams(max_tokens=10), frozenset({ref[2]}), 3, "stop", None),
        "stop_id": (SamplingParams(max_tokens=10, stop_token_ids=[ref[1]]), frozenset(), 2, "stop", ref[1]),
        "min_tokens": (SamplingParams(max_tokens=10, min_tokens=4), frozenset({ref[2]}), 10, "length", None),
        "ignore_eos": (SamplingParams(max_tokens=5, ignore_eos=True), frozenset({ref[0]}), 5, "length", None),
    }
    runner = FakeRunner(4)
    for name, (params, eos, n, reason, stop_reason) in cases.items():
        req = Request(name, list(prompt), params, arrival_s=0.0, eos_token_ids=eos)
        sched.add_request(req)
        while sched.has_unfinished():
            out = sched.schedule()
            sched.update_from_output(out, runner.execute(out))
        assert req.output_token_ids == ref[:n], name
        assert req.status.finish_reason == reason, name
        assert req.stop_reason == stop_reason, name


def test_abort_frees_blocks_and_reports_to_runner():
    config = EngineConfig(block_size=4)
    sched = Scheduler(config, num_blocks=50, max_model_len=256)
    runner = FakeRunner(4)
    sched.add_request(make_request(0, 20, 50))
    sched.add_request(make_request(1, 3, 50))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.block_manager.num_used_blocks > 0
    aborted = sched.finish_request("r0", RequestStatus.FINISHED_ABORTED)
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.finished
    assert sched.block_manager.block_table("r0") == []
    assert sched.finish_request("r1", RequestStatus.FINISHED_ABORTED) is not None
    assert sched.block_manager.num_free_blocks == 50
    # No step runs while nothing is left: the ids wait for the next step the runner sees.
    assert sched.schedule().finished_request_ids == []
    sched.add_request(make_request(2, 3, 5))
    assert set(sched.schedule().finished_request_ids) == {"r0", "r1"}
    assert sched.finish_request("r0", RequestStatus.FINISHED_ABORTED) is None


def test_requests_that_can_never_fit_are_refused():
    config = EngineConfig(block_size=4)
    sched = Scheduler(config, num_blocks=5, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request(0, 64, 1))
    with pytest.raises(ValueError, match="kv_cache_memory"):
        sched.add_request(make_request(1, 30, 1))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("e", [], SamplingParams(), arrival_s=0.0))
    assert not sched.has_unfinished()


def test_watermark_holds_back_admission():
    config = EngineConfig(block_size=4, kv_admission_watermark=0.5, max_num_batched_tokens=1000)
    sched = Scheduler(config, num_blocks=20, max_model_len=256)
    for i in range(4):
        sched.add_request(make_request(i, 16, 5))  # 4 blocks each
    out = sched.schedule()
    # r0 and r1 bring usage to 8/20; r2 would reach 12/20 > 0.5.
    assert [s.request_id for s in out.sequences] == ["r0", "r1"]


def test_core_does_not_import_torch():
    code = "import sys, batchinfer.core, batchinfer.core.scheduling.scheduler; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
