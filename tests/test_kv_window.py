"""Sliding windows in the paged KV cache, driven step by step with a fake runner.

The fake model here is windowed: a sampled token is a hash of the last `WINDOW` tokens, and
every query of a chunk reads its window through the block table (a read before the blocks the
scheduler kept fails). Blocks before a request's window are dropped as it goes; outputs must
equal the windowed reference under every schedule (chunked prefill, preemption by recompute
and by swap, prefix caching), the block manager's invariants hold after every step, and no
request holds more blocks than `KVWindow.max_held_blocks`, so sequences far longer than the
cache run.
"""

from __future__ import annotations

import random

import pytest

from batchinfer.core import EngineConfig, Request, SamplingParams
from batchinfer.core.block_manager import BlockManager, block_keys
from batchinfer.core.outputs import ModelRunnerOutput, SchedulerOutput
from batchinfer.core.preemption import KeptKV, PreemptionCosts, plan_kept_kv
from batchinfer.core.scheduling.admission import admission_size
from batchinfer.core.scheduling.scheduler import Scheduler
from batchinfer.core.scheduling.window import KVWindow
from tests.fake_runner import FakeRunner, next_token
from tests.test_scheduler import check_step, make_request

WINDOW = 10
BLOCK_SIZE = 4


class WindowedRunner(FakeRunner):
    """`FakeRunner` whose model reads only the last `window` tokens of each query."""

    def __init__(self, block_size: int, window: int) -> None:
        super().__init__(block_size)
        self.window = window

    def _slot_of(self, table: list[int], dropped: int, pos: int) -> int:
        index = pos // self.block_size - dropped
        if index < 0:
            raise AssertionError(f"position {pos} lies in a dropped block")
        return table[index] * self.block_size + pos % self.block_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        sampled: list[int | None] = []
        for seq in scheduler_output.sequences:
            table, dropped, start = seq.block_table, seq.num_dropped_blocks, seq.num_computed_tokens
            for i, token in enumerate(seq.token_ids):
                self.slots[self._slot_of(table, dropped, start + i)] = token
            end = start + seq.num_tokens
            for query in range(start, end):  # every query reads its window
                window = [self.slots[self._slot_of(table, dropped, p)]
                          for p in range(max(0, query - self.window + 1), query + 1)]
            sampled.append(next_token(window) if seq.sample else None)
        return ModelRunnerOutput(sampled_token_ids=sampled)


def windowed_reference(prompt: list[int], max_tokens: int, window: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(context[-window:]))
        context.append(out[-1])
    return out


def run_windowed(sched: Scheduler, config: EngineConfig, runner: WindowedRunner
                 ) -> dict[str, list[int]]:
    """Run to the end, checking after every step the scheduler's invariants, that each
    sequence drops all it may and nothing it needs, and that none holds more than the bound."""
    bound = sched.window.max_held_blocks
    assert bound is not None
    outputs: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_step(sched, out, config)
        for seq in out.sequences:
            first = sched.window.first_block(seq.num_computed_tokens)
            assert seq.num_dropped_blocks == first, seq.request_id
            assert len(seq.block_table) <= bound
        runner.swap_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in)
        sched.swaps_done()
        for upd in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(upd.request_id, []).extend(upd.new_token_ids)
        sched.block_manager.check_invariants()
        for request in sched.running:
            assert len(sched.block_manager.block_table(request.request_id)) <= bound
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return outputs


def check_outputs(outputs: dict[str, list[int]], requests: list[tuple[int, int]],
                  limit: int | None = None) -> None:
    for i, (prompt_len, max_tokens) in enumerate(requests):
        prompt = make_request(i, prompt_len, max_tokens).prompt_token_ids
        expected = windowed_reference(prompt, max_tokens, WINDOW)
        if limit is not None:
            expected = expected[: limit - prompt_len]
        assert outputs[f"r{i}"] == expected, f"r{i}"


def workload(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, 60), rng.randint(1, 50)) for _ in range(n)]


@pytest.mark.parametrize("knobs", [
    {},
    {"max_num_batched_tokens": 7},
    {"max_num_seqs": 3},
    {"enable_prefix_caching": True},
    {"batching": "static", "max_batch_size": 5},
], ids=["continuous", "chunked", "few-seqs", "prefix-caching", "static"])
def test_windowed_outputs_are_exact_and_blocks_are_dropped(knobs: dict[str, object]) -> None:
    config = EngineConfig(block_size=BLOCK_SIZE,
                          max_num_batched_tokens=knobs.pop("max_num_batched_tokens", 64),
                          **knobs)
    sched = Scheduler(config, num_blocks=200, max_model_len=512, kv_window=WINDOW)
    requests = workload(25, seed=1)
    for i, (p, m) in enumerate(requests):
        sched.add_request(make_request(i, p, m))
    sched.close_input()
    check_outputs(run_windowed(sched, config, WindowedRunner(BLOCK_SIZE, WINDOW)), requests)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sequences_longer_than_the_cache_run_and_preempt_exactly(mode: str) -> None:
    """30 blocks hold 120 tokens; every request grows to 150-260 tokens. Without dropping
    none would fit; with it they run together, preempting when the windows collide."""
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                          preemption_mode=mode, max_swap_blocks_per_step=64)
    sched = Scheduler(config, num_blocks=30, max_model_len=1000,
                      num_swap_blocks=64 if mode == "swap" else 0, kv_window=WINDOW)
    requests = [(random.Random(i).randint(5, 60), 150 + 10 * i) for i in range(10)]
    for i, (p, m) in enumerate(requests):
        sched.add_request(make_request(i, p, m))
    outputs = run_windowed(sched, config, WindowedRunner(BLOCK_SIZE, WINDOW))
    assert sched.num_preemptions_total > 0
    if mode == "swap":
        assert sched.swapped_out_blocks > 0
    check_outputs(outputs, requests)


def test_prefix_cache_hits_past_the_window_stay_exact() -> None:
    """Requests sharing a long prompt find its blocks cached (those before their window are
    shared and dropped at once), and their outputs are the reference's."""
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=32,
                          enable_prefix_caching=True, max_num_seqs=1)
    sched = Scheduler(config, num_blocks=40, max_model_len=512, kv_window=WINDOW)
    prompt = [(7 * j) % 997 + 1 for j in range(70)]
    for i in range(3):
        params = SamplingParams(max_tokens=20 + i, temperature=0, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt + [500 + i], params, arrival_s=0.0,
                                  eos_token_ids=frozenset({0})))
    outputs = run_windowed(sched, config, WindowedRunner(BLOCK_SIZE, WINDOW))
    assert sched.prefix_cache_hits >= 2 * 68
    for i in range(3):
        assert outputs[f"r{i}"] == windowed_reference(prompt + [500 + i], 20 + i, WINDOW)


def test_admission_counts_what_a_windowed_request_holds() -> None:
    """Eight 50-token prompts need 104 blocks whole; under a window of 10 each holds at most
    `max_held_blocks`, so a 48-block cache runs all eight at once (and without the window it
    cannot)."""
    def most_running(kv_window: int | None) -> int:
        config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=16)
        sched = Scheduler(config, num_blocks=48, max_model_len=512, kv_window=kv_window)
        for i in range(8):
            sched.add_request(make_request(i, 50, 30))
        runner, most = WindowedRunner(BLOCK_SIZE, WINDOW), 0
        while sched.has_unfinished():
            out = sched.schedule()
            most = max(most, len(sched.running))
            sched.update_from_output(out, runner.execute(out))
        return most

    assert most_running(WINDOW) == 8
    assert most_running(None) < 8


def test_block_manager_drops_leading_blocks_and_keeps_its_invariants() -> None:
    bm = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=True)
    tokens = list(range(1, 30))
    assert bm.allocate("a", 20) == [0, 1, 2, 3, 4]
    bm.cache_blocks("a", tokens, 20)
    assert bm.drop_blocks_before("a", 3) == 3
    assert bm.block_table("a") == [3, 4] and bm.num_dropped_blocks("a") == 3
    assert bm.num_free_blocks == 6 and bm.num_blocks_needed("a", 28) == 2
    assert bm.drop_blocks_before("a", 2) == 0  # never back
    bm.check_invariants()
    assert bm.allocate("a", 28) == [3, 4, 5, 6]  # uncached free blocks before cached ones
    bm.cache_blocks("a", tokens, 28)  # the chain goes on past the dropped blocks
    # Another request finds the whole prefix cached (dropped blocks stay cached when free),
    # and holds only those from its window's first block on.
    cached = bm.cached_blocks(block_keys(tokens[:28], BLOCK_SIZE))
    assert cached == [0, 1, 2, 3, 4, 5, 6]
    bm.share("b", cached, first_block=4)
    assert bm.block_table("b") == [4, 5, 6] and bm.num_dropped_blocks("b") == 4
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    bm.check_invariants()
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 7


def test_window_maths() -> None:
    window = KVWindow(10, 4, 16)
    assert [window.first_block(c) for c in (0, 9, 12, 13, 100)] == [0, 0, 0, 1, 22]
    assert window.max_held_blocks == 8  # ceil((9 + 16) / 4) + 1
    assert window.blocks_held(20) == 5 and window.blocks_held(1000) == 8
    full = KVWindow(None, 4, 16)
    assert full.first_block(100) == 0 and full.max_held_blocks is None
    assert full.blocks_held(1000) == 250


def test_a_victim_with_dropped_blocks_swaps_all_it_holds_or_none() -> None:
    # 40 computed tokens, blocks 0-4 dropped: 5 held, all swapped or none.
    assert plan_kept_kv("swap", 40, 4, 100, 100, None, 5) == KeptKV(5, 40)
    assert plan_kept_kv("swap", 40, 4, 100, 4, None, 5) == KeptKV(0, 0)
    assert plan_kept_kv("swap", 40, 4, 3, 100, None, 5) == KeptKV(0, 0)
    costs = PreemptionCosts(prefill_s_per_token=1.0, swap_s_per_block=0.1)
    assert plan_kept_kv("auto", 40, 4, 100, 100, costs, 5) == KeptKV(5, 40)


def test_admission_size_holds_the_cached_blocks_inside_the_window() -> None:
    request = make_request(0, 50, 10)
    # 8 cached blocks (32 tokens), the window reaches back to block 5: 3 held, 1 of them idle.
    size = admission_size(request, budget=16, cached=list(range(8)), num_reused=1,
                          block_size=4, first_block=5, max_held_blocks=8)
    assert (size.start, size.num_new, size.first_block) == (32, 16, 5)
    assert size.take == 12 - 5 - 3 + 1  # blocks to 48 tokens, less dropped and held cached
    assert size.whole == 8 - 3 + 1
