"""Prefix caching: the block manager's sharing, caching and eviction under random operations,
and the scheduler reusing cached prefixes with exact outputs (the fake runner reads the KV
through the block tables, so a wrongly shared or overwritten block changes the tokens)."""

from __future__ import annotations

import random

import pytest

from batchinfer.core import (
    EngineConfig,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SamplingParams,
)
from batchinfer.core.block_manager import BlockManager, block_keys
from batchinfer.core.scheduling.scheduler import Scheduler
from tests.fake_runner import FakeRunner, reference_tokens
from tests.test_scheduling_pressure import Harness


# --------------------------------------------------------------------------- block manager
def test_block_keys_chain_the_whole_prefix():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2
    assert a[1][1] == b[1][1]  # same tokens in the second block...
    assert a[1] != b[1]  # ...but a different prefix: a different key


def test_random_operations_keep_the_invariants():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=40, block_size=4, enable_prefix_caching=True)
    prompts = [[rng.randint(1, 5) for _ in range(rng.randint(4, 30))] for _ in range(6)]
    live: dict[str, list[int]] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.45 and len(live) < 12:
            rid = f"r{step}"
            tokens = list(rng.choice(prompts)) + [rng.randint(1, 5) for _ in range(rng.randint(0, 9))]
            cached = bm.cached_blocks(block_keys(tokens[:-1], 4))
            bm.share(rid, cached)
            if bm.allocate(rid, len(tokens)) is None:
                bm.free(rid)
                continue
            bm.cache_blocks(rid, tokens, len(tokens))
            live[rid] = tokens
        elif live:
            rid = rng.choice(sorted(live))
            del live[rid]
            bm.free(rid)
        bm.check_invariants()
        # a block holding a cached prefix holds exactly that prefix's tokens for every holder
        for rid, tokens in live.items():
            table = bm.block_table(rid)
            for i, key in enumerate(block_keys(tokens, 4)):
                owner = bm._cached.get(key)
                if owner is not None and owner in table:
                    assert table.index(owner) == i
    for rid in list(live):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    for rid, tokens in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        bm.allocate(rid, len(tokens))
        bm.cache_blocks(rid, tokens, len(tokens))
        bm.free(rid)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    assert len(bm.cached_blocks(block_keys([1, 2, 3, 4], 2))) == 2
    bm.allocate("c", 8)  # 4 blocks: the 2 never used, then "a"'s (freed first), tail first
    assert bm.cached_blocks(block_keys([1, 2, 3, 4], 2)) == []
    assert len(bm.cached_blocks(block_keys([5, 6, 7, 8], 2))) == 2
    bm.check_invariants()


# --------------------------------------------------------------------------- scheduler
def _shared_prefix_workload(seed: int, n: int, prefix_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randint(1, 900) for _ in range(prefix_len)]
    return [prefix + [rng.randint(1, 900) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _run(prompts: list[list[int]], caching: bool, **knobs) -> Harness:
    h = Harness(num_blocks=knobs.pop("num_blocks", 400), enable_prefix_caching=caching,
                max_num_batched_tokens=knobs.pop("max_num_batched_tokens", 64), **knobs)
    for i, prompt in enumerate(prompts):
        r = Request(f"p{i}", list(prompt), SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True), arrival_s=0.0)
        h.add(r)
        if i % 3 == 2:
            h.step()
    h.run()
    return h


@pytest.mark.parametrize("knobs", [
    {},
    {"num_blocks": 60},  # preemptions: resumed requests find their own blocks cached
    {"num_blocks": 60, "scheduling_policy": "priority"},
    {"max_num_batched_tokens": 7},
])
def test_outputs_identical_with_and_without_prefix_caching(knobs):
    prompts = _shared_prefix_workload(1, 24, 50)
    on = _run(prompts, True, **dict(knobs))
    off = _run(prompts, False, **dict(knobs))
    for name in on.tokens:
        assert on.tokens[name] == off.tokens[name] == reference_tokens(
            on.prompts[name], len(on.tokens[name]))
    assert on.sched.prefix_cache_hits > 0
    assert off.sched.prefix_cache_hits == 0


def test_a_request_with_a_cached_prefix_prefills_only_the_rest():
    h = Harness(num_blocks=100, max_num_batched_tokens=256)
    prompt = list(range(1, 42))  # 41 tokens: 10 full blocks of 4
    h.add(Request("a", prompt, SamplingParams(max_tokens=2, temperature=0), arrival_s=0.0))
    h.run()
    h.add(Request("b", prompt + [7, 8], SamplingParams(max_tokens=2, temperature=0),
                  arrival_s=0.0))
    out = h.step()
    (seq,) = out.sequences
    assert seq.num_computed_tokens == 40 and seq.token_ids == [41, 7, 8]
    assert (h.sched.prefix_cache_queries, h.sched.prefix_cache_hits) == (41 + 43, 40)
    h.run()
    h.assert_exact("b")


def test_an_identical_prompt_keeps_its_last_token_to_compute():
    h = Harness(num_blocks=100, max_num_batched_tokens=256)
    prompt = list(range(1, 41))  # exactly 10 blocks
    for name in ("a", "b"):
        h.add(Request(name, prompt, SamplingParams(max_tokens=3, temperature=0), arrival_s=0.0))
        h.run()
    assert h.sched.prefix_cache_hits == 36  # 9 blocks: the 10th holds the last prompt token
    assert h.tokens["a"] == h.tokens["b"]


def test_sequences_of_one_prompt_share_its_prefill():
    """n = 3 copies of a 100-token prompt arrive together: one prefills, the other two wait
    for it and take its blocks (not three prefills of the same tokens)."""
    h = Harness(num_blocks=200, max_num_batched_tokens=32)
    prompt = [random.Random(3).randint(1, 900) for _ in range(100)]
    for i in range(3):
        h.add(Request(f"s#{i}", list(prompt), SamplingParams(max_tokens=4, temperature=0,
                                                            ignore_eos=True), arrival_s=0.0))
    prefill_tokens = 0
    while h.sched.has_unfinished():
        out = h.step()
        prefill_tokens += sum(s.num_tokens for s in out.sequences if s.is_prefill)
    assert prefill_tokens == 100 + 2 * (100 - 96)  # the copies compute only the last block
    for i in range(3):
        h.assert_exact(f"s#{i}")


def test_blocks_written_by_a_step_are_never_shared():
    # The harness asserts it at every step; here under preemption with a shared prefix.
    prompts = _shared_prefix_workload(5, 30, 37)
    h = Harness(num_blocks=80, max_num_batched_tokens=48)
    for i, prompt in enumerate(prompts):
        h.add(Request(f"p{i}", prompt, SamplingParams(max_tokens=20, temperature=0,
                                                     ignore_eos=True), arrival_s=0.0))
        for _ in range(2):
            h.step()
    h.run()
    assert h.sched.num_preemptions_total > 0 and h.sched.prefix_cache_hits > 0
    for name in h.tokens:
        h.assert_exact(name)


def test_scheduler_without_prefix_caching_shares_nothing():
    config = EngineConfig(block_size=4, enable_prefix_caching=False)
    sched = Scheduler(config, num_blocks=50, max_model_len=256)
    runner = FakeRunner(4)
    for name in ("a", "b"):
        sched.add_request(Request(name, list(range(1, 21)), SamplingParams(max_tokens=2),
                                  arrival_s=0.0))
        while sched.has_unfinished():
            out = sched.schedule()
            sched.update_from_output(out, runner.execute(out))
    assert sched.block_manager.num_cached_blocks == 0 and sched.prefix_cache_hits == 0


def test_blocks_of_a_failed_sequence_never_enter_the_cache():
    config = EngineConfig(block_size=4)
    sched = Scheduler(config, num_blocks=50, max_model_len=256)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=2), arrival_s=0.0))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=[None]), failed={"a"})
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED, error="boom")
    assert sched.block_manager.num_cached_blocks == 0
    sched.add_request(Request("b", prompt, SamplingParams(max_tokens=2), arrival_s=0.0))
    (seq,) = sched.schedule().sequences
    assert seq.num_computed_tokens == 0 and sched.prefix_cache_hits == 0
