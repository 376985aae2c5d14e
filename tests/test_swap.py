"""Swap preemption in the scheduler, on the fake runner's simulated cache and host pool: a request
swapped out and back in produces exactly the tokens of a cache-free reference; the per-step cap,
the host pool running full, partial swaps, auto's cost comparison, aborts and deadlines of
swapped-out requests, priority preemption and the whole-batch forms. The harness checks the
block and host-pool invariants and the cap at every step."""

from __future__ import annotations

import random

import pytest

from batchinfer.core import EngineConfig
from batchinfer.core.preemption import HostBlockPool, PreemptionCosts
from batchinfer.core.scheduling.scheduler import Scheduler
from tests.test_scheduling_pressure import Harness, request

CHEAP_SWAP = PreemptionCosts(prefill_s_per_token=1e-3, swap_s_per_block=1e-5)
DEAR_SWAP = PreemptionCosts(prefill_s_per_token=1e-5, swap_s_per_block=1e-2)


def load(h: Harness, n: int = 12, seed: int = 0, prompt: tuple[int, int] = (10, 40),
         output: tuple[int, int] = (10, 40)) -> list[str]:
    rng = random.Random(seed)
    names = []
    for i in range(n):
        r = request(f"r{i}", rng.randint(*prompt), rng.randint(*output))
        h.add(r)
        names.append(r.request_id)
    return names


def assert_all_exact(h: Harness, names: list[str]) -> None:
    assert set(h.final) == set(names)
    for name in names:
        assert h.final[name].finish_reason is not None and h.final[name].error is None
        h.assert_exact(name)
    assert h.sched.swap_pool.num_free == h.sched.swap_pool.num_blocks  # every host block back


def test_swapped_requests_resume_exactly_without_recomputing():
    h = Harness(num_blocks=40, num_swap_blocks=400, preemption_mode="swap")
    names = load(h)
    h.run()
    assert_all_exact(h, names)
    by_mode = h.sched.preemptions_by_mode
    assert by_mode["swap"] > 0 and by_mode["recompute"] == 0
    assert h.sched.recomputed_tokens == 0
    assert h.sched.swapped_out_blocks == h.sched.swapped_in_blocks > 0


def test_recompute_mode_never_swaps_and_is_exact_too():
    h = Harness(num_blocks=40, preemption_mode="recompute")
    names = load(h)
    h.run()
    assert_all_exact(h, names)
    assert h.sched.preemptions_by_mode == {"recompute": h.sched.num_preemptions_total, "swap": 0}
    assert h.sched.recomputed_tokens > 0 and h.sched.swapped_out_blocks == 0


def test_a_request_longer_than_the_cap_swaps_its_leading_blocks_and_recomputes_the_rest():
    h = Harness(num_blocks=40, num_swap_blocks=400, preemption_mode="swap",
                max_swap_blocks_per_step=3)
    names = load(h, prompt=(30, 60))
    h.run()
    assert_all_exact(h, names)
    assert h.sched.preemptions_by_mode["swap"] > 0
    assert h.sched.recomputed_tokens > 0  # the blocks past the cap


def test_a_full_swap_space_falls_back_to_recompute():
    h = Harness(num_blocks=40, num_swap_blocks=6, preemption_mode="swap")
    names = load(h, n=16)
    h.run()
    assert_all_exact(h, names)
    by_mode = h.sched.preemptions_by_mode
    assert by_mode["swap"] > 0 and by_mode["recompute"] > 0


@pytest.mark.parametrize(("costs", "mode"), [(CHEAP_SWAP, "swap"), (DEAR_SWAP, "recompute")])
def test_auto_picks_the_cheaper_mode_by_the_measured_costs(costs, mode):
    h = Harness(num_blocks=40, num_swap_blocks=400, preemption_mode="auto", costs=costs)
    names = load(h)
    h.run()
    assert_all_exact(h, names)
    other = "recompute" if mode == "swap" else "swap"
    assert h.sched.preemptions_by_mode[mode] > 0 and h.sched.preemptions_by_mode[other] == 0


def test_auto_compares_per_victim_short_ones_recompute_long_ones_swap():
    # A swap costs a fixed 20 ms each way: worth it only for victims holding > 40 tokens.
    costs = PreemptionCosts(prefill_s_per_token=1e-3, swap_s_per_block=1e-6, swap_fixed_s=2e-2)
    assert costs.recompute_s(39) < costs.swap_s(10, 0) < costs.recompute_s(41)
    h = Harness(num_blocks=30, num_swap_blocks=400, preemption_mode="auto", costs=costs)
    decisions = []
    keep_kv = h.sched._keep_kv

    def recording(victim):
        computed = victim.num_computed_tokens
        mode = keep_kv(victim)
        decisions.append((computed, mode))
        return mode

    h.sched._keep_kv = recording
    names = load(h, n=16, prompt=(4, 80), output=(5, 40), seed=2)
    h.run()
    assert_all_exact(h, names)
    assert {mode for _, mode in decisions} == {"swap", "recompute"}
    for computed, mode in decisions:
        assert mode == ("swap" if computed > 40 else "recompute"), (computed, mode)


def test_aborting_or_expiring_a_swapped_out_request_frees_its_host_blocks():
    h = Harness(num_blocks=12, num_swap_blocks=100, preemption_mode="swap",
                max_queue_time_ms=400)
    first = h.add(request("first", 20, 30))
    second = h.add(request("second", 20, 30))
    while not second.swap_blocks and not first.swap_blocks:
        h.step()
    victim = second if second.swap_blocks else first
    held = len(victim.swap_blocks)
    assert h.sched.swap_pool.num_free == 100 - held
    out = h.sched.finish_request(victim.request_id, victim.status.FINISHED_ABORTED)
    assert out is not None and h.sched.swap_pool.num_free == 100
    # The other one is preempted in turn by a third and left to expire while swapped out.
    h.run()
    h.add(request("a", 20, 30))
    h.add(request("b", 20, 30))
    while not any(r.swap_blocks for r in h.sched.requests.values()):
        h.step()
    h.clock.now += 1.0
    h.step()
    assert any(o.error_code == "queue_timeout" for o in h.final.values())
    h.run()
    assert h.sched.swap_pool.num_free == 100


def test_priority_preemption_swaps_the_victim_and_it_resumes_exactly():
    h = Harness(num_blocks=24, num_swap_blocks=100, preemption_mode="swap",
                scheduling_policy="priority", max_num_batched_tokens=16)
    background = [h.add(request(f"bg{i}", 30, 40, tier="batch")) for i in range(2)]
    for _ in range(8):
        h.step()
    chat = h.add(request("chat", 20, 10))
    h.run()
    assert h.sched.preemptions["priority", "swap"] >= 1
    assert_all_exact(h, [r.request_id for r in background] + [chat.request_id])


@pytest.mark.parametrize("form", ["static", "dynamic"])
def test_whole_batch_forms_swap_and_resume_exactly(form):
    h = Harness(num_blocks=30, num_swap_blocks=400, preemption_mode="swap", batching=form,
                max_batch_size=6, max_swap_blocks_per_step=8)
    names = load(h, n=12)
    h.sched.close_input()
    h.run()
    assert_all_exact(h, names)
    assert h.sched.preemptions_by_mode["swap"] > 0


@pytest.mark.parametrize("seed", range(6))
def test_random_load_with_aborts_keeps_every_invariant_and_exact_outputs(seed):
    """Random arrivals, lengths, aborts, priorities, prefix sharing, caps and modes; the
    harness checks the block manager, the host pool and the cap each step."""
    rng = random.Random(seed)
    mode = ["swap", "auto"][seed % 2]
    h = Harness(num_blocks=rng.randint(24, 60), num_swap_blocks=rng.randint(4, 80),
                preemption_mode=mode, costs=PreemptionCosts(1e-3, rng.choice([1e-5, 3e-3])),
                max_swap_blocks_per_step=rng.randint(1, 12),
                scheduling_policy=rng.choice(["fcfs", "priority"]),
                enable_prefix_caching=rng.random() < 0.5, max_num_batched_tokens=32)
    names, aborted = [], set()
    shared = [rng.randint(1, 900) for _ in range(12)]
    for i in range(30):
        r = request(f"q{i}", rng.randint(5, 50), rng.randint(5, 40),
                    tier=rng.choice(["interactive", "batch"]))
        if rng.random() < 0.3:
            r.prompt_token_ids[: len(shared)] = shared[: len(r.prompt_token_ids)]
            h.prompts[r.request_id] = list(r.prompt_token_ids)
        h.add(r)
        h.prompts[r.request_id] = list(r.prompt_token_ids)
        names.append(r.request_id)
        for _ in range(rng.randint(0, 4)):
            if h.sched.has_unfinished():
                h.step()
        if rng.random() < 0.15:
            victim = rng.choice(names)
            if victim in h.sched.requests:
                out = h.sched.finish_request(victim, h.sched.requests[victim].status.FINISHED_ABORTED)
                assert out is not None
                aborted.add(victim)
    h.run()
    assert h.sched.num_preemptions_total > 0
    for name in names:
        if name not in aborted:
            h.assert_exact(name)
    assert h.sched.swap_pool.num_free == h.sched.swap_pool.num_blocks
    h.sched.block_manager.check_invariants()


def test_swap_modes_need_a_swap_space_and_auto_needs_costs():
    config = EngineConfig.from_kwargs(preemption_mode="swap")
    with pytest.raises(ValueError, match="swap_space"):
        Scheduler(config, 16, 64, num_swap_blocks=0)
    with pytest.raises(ValueError, match="costs"):
        Scheduler(EngineConfig.from_kwargs(preemption_mode="auto"), 16, 64, num_swap_blocks=4)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig.from_kwargs(preemption_mode="disk")
    with pytest.raises(ValueError, match="max_swap_blocks_per_step"):
        EngineConfig.from_kwargs(max_swap_blocks_per_step=0)
    assert EngineConfig.from_kwargs(swap_space="512M").swap_space == 512 << 20
    with pytest.raises(ValueError, match="swap_s_per_block"):
        PreemptionCosts(1e-3, -1.0)


def test_host_pool_holds_blocks_a_swap_in_reads_until_the_step_ends():
    pool = HostBlockPool(4)
    blocks = pool.allocate(3)
    pool.release(blocks[:2])  # read by this step's swap-in
    assert pool.num_free == 1  # a swap-out scheduled in the same step cannot take them
    pool.keep(blocks[:1])  # that swap-in was undone: block 0 stays with its request
    pool.end_step()
    assert pool.num_free == 2 and pool.usage == 0.5
    pool.check_invariants()
    with pytest.raises(RuntimeError):
        pool.allocate(3)
