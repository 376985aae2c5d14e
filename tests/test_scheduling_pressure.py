"""The scheduler under pressure, step by step with the fake runner and a clock the test moves:
priorities with aging, queue deadlines, the soft watermark, victim choice, priority preemption,
elastic max_tokens, the per-request KV cap and presets. KV invariants are checked every step and
outputs compared with a cache-free reference, so a rule that corrupts a sequence fails here."""

from __future__ import annotations

import random

import pytest

from batchinfer.core import EngineConfig, Request, SamplingParams
from batchinfer.core.outputs import QUEUE_TIMEOUT
from batchinfer.core.preemption import PreemptionCosts
from batchinfer.core.request import SchedulingOptions
from batchinfer.core.scheduling.scheduler import Scheduler
from tests.fake_runner import FakeRunner, reference_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def request(name: str, prompt_len: int, max_tokens: int | None, now: float = 0.0,
            tier: str | None = None, priority: int | None = None, timeout_s: float | None = None,
            fixed: bool = True) -> Request:
    seed = sum(map(ord, name))
    prompt = [(seed * 7 + j) % 997 + 1 for j in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    r = Request(name, prompt, params, arrival_s=now, eos_token_ids=frozenset({0}))
    r.apply(SchedulingOptions(priority=priority, service_tier=tier, timeout_s=timeout_s,
                              max_tokens_fixed=fixed))
    return r


class Harness:
    """A scheduler, the fake runner, a clock advanced `dt` per step, and every output."""

    def __init__(self, num_blocks: int, max_model_len: int = 512, dt: float = 0.01,
                 num_swap_blocks: int = 0, costs: PreemptionCosts | None = None,
                 **knobs) -> None:
        knobs.setdefault("block_size", 4)
        self.config = EngineConfig.from_kwargs(**knobs)
        self.clock = Clock()
        self.dt = dt
        self.sched = Scheduler(self.config, num_blocks, max_model_len, self.clock,
                               num_swap_blocks, costs)
        self.runner = FakeRunner(self.config.block_size)
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, object] = {}
        self.first_scheduled: dict[str, float] = {}
        self.prompts: dict[str, list[int]] = {}
        self.arrivals: dict[str, float] = {}

    def add(self, r: Request) -> Request:
        r.arrival_s = r.metrics.arrival_s = self.clock.now
        self.arrivals[r.request_id] = r.arrival_s
        self.prompts[r.request_id] = list(r.prompt_token_ids)
        self.sched.add_request(r)
        return r

    def step(self):
        out = self.sched.schedule()
        bm = self.sched.block_manager
        bm.check_invariants()
        free = set(bm._free)
        size = bm.block_size
        for seq in out.sequences:
            assert not free & set(seq.block_table)
            self.first_scheduled.setdefault(seq.request_id, self.clock.now)
            # The blocks this step writes belong to this sequence alone (prefix caching shares
            # only full blocks, which are never written again).
            first = seq.num_computed_tokens // size
            last = (seq.num_computed_tokens + seq.num_tokens - 1) // size
            for block_id in seq.block_table[first : last + 1]:
                assert bm._ref_counts[block_id] == 1, "a step writes a shared block"
        # A step with running requests is never empty: the engine would wait forever.
        assert self.sched.running == [] or not out.is_empty, "stalled"
        assert out.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        cap = self.config.max_swap_blocks_per_step
        assert len(out.blocks_to_swap_out) <= cap and len(out.blocks_to_swap_in) <= cap
        # A swap-in fills blocks this step's sequences hold, and never a block a swap-out of
        # the same step reads unless that one is copied first (swap-outs run first).
        held = {b for seq in out.sequences for b in seq.block_table}
        assert {device for _, device in out.blocks_to_swap_in} <= held
        self.sched.swap_pool.check_invariants()
        if out.has_swaps:
            self.runner.swap_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in)
            self.sched.swaps_done()
        ended = self.sched.take_ended()
        if not out.is_empty:
            ended += self.sched.update_from_output(out, self.runner.execute(out))
        for o in ended:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.final[o.request_id] = o
        bm.check_invariants()
        self.clock.now += self.dt
        return out

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")

    def assert_exact(self, name: str) -> None:
        out = self.tokens[name]
        assert out == reference_tokens(self.prompts[name], len(out)), name


# --------------------------------------------------------------------------- priorities
def test_priority_policy_admits_by_priority_then_arrival_and_fcfs_ignores_it():
    def order(policy: str) -> list[str]:
        h = Harness(num_blocks=200, scheduling_policy=policy, priority_aging_ms=0,
                    max_num_seqs=1, max_num_batched_tokens=64)
        for name, priority in [("a", 5), ("b", 1), ("c", 5), ("d", 0)]:
            h.add(request(name, 6, 2, priority=priority))
            h.clock.now += 0.001
        h.run()
        return sorted(h.first_scheduled, key=h.first_scheduled.__getitem__)

    assert order("priority") == ["d", "b", "a", "c"]
    assert order("fcfs") == ["a", "b", "c", "d"]


@pytest.mark.parametrize("aging_ms", [100.0, 0.0])
def test_aging_admits_a_batch_request_under_a_constant_interactive_stream(aging_ms):
    """The documented bound: a waiting batch request (priority 10) ranks ahead of every
    interactive request arriving more than 10 x priority_aging_ms after it. With one seat that
    is never free and two interactive requests always waiting, it is admitted right after the
    ones that arrived within that time; without aging it starves."""
    h = Harness(num_blocks=400, scheduling_policy="priority", priority_aging_ms=aging_ms,
                max_num_seqs=1, max_num_batched_tokens=64, dt=0.01)
    background = h.add(request("bg", 8, 3, tier="batch"))
    serial = 0
    for _ in range(600):
        while sum(r.priority_class == "interactive" for r in h.sched.waiting) < 2:
            h.add(request(f"i{serial}", 8, 3))
            serial += 1
        h.step()
        if "bg" in h.first_scheduled:
            break
    if aging_ms == 0:
        assert "bg" not in h.first_scheduled  # starved: the stream never lets it in
        return
    limit_s = background.arrival_s + 10 * aging_ms / 1000
    admitted_s = h.first_scheduled["bg"]
    assert admitted_s <= limit_s + 3 * 4 * h.dt  # + the service times of the two ahead
    before = {n for n, t in h.first_scheduled.items() if t < admitted_s and n != "bg"}
    arrivals = {r: h.arrivals[r] for r in before}
    assert all(t <= limit_s + 1e-9 for t in arrivals.values())  # none arriving later jumped it


def test_service_tier_sets_class_and_default_priorities():
    assert request("x", 4, 1, tier="batch").priority == 10
    assert request("x", 4, 1).priority_class == "interactive"
    assert request("x", 4, 1, priority=12).priority_class == "batch"
    assert request("x", 4, 1, tier="interactive", priority=20).priority == 20
    with pytest.raises(ValueError, match="service_tier"):
        SchedulingOptions(service_tier="gold")
    with pytest.raises(ValueError, match="timeout"):
        SchedulingOptions(timeout_s=-1.0)


# --------------------------------------------------------------------------- queue deadlines
def test_queue_deadline_ends_a_never_scheduled_request_with_queue_timeout():
    h = Harness(num_blocks=200, max_num_seqs=1, max_queue_time_ms=50, dt=0.01,
                max_num_batched_tokens=64)
    h.add(request("long", 8, 30))
    h.add(request("late", 8, 2))
    h.add(request("patient", 8, 2, timeout_s=10.0))  # its own limit wins over the server's
    h.run()
    late = h.final["late"]
    assert late.error_code == QUEUE_TIMEOUT and late.finish_reason.value == "abort"
    assert h.tokens["late"] == [] and "late" not in h.first_scheduled  # never started
    assert late.finished_s == pytest.approx(0.05, abs=h.dt + 1e-9)
    assert h.final["patient"].error_code is None and len(h.tokens["patient"]) == 2
    h.assert_exact("long")


def test_idle_scheduler_wakes_up_for_a_deadline():
    h = Harness(num_blocks=200, batching="static", max_batch_size=4, max_queue_time_ms=200)
    h.add(request("a", 8, 2))
    assert h.sched.schedule().is_empty  # a static batch waits for more
    assert h.sched.next_dispatch_s() == pytest.approx(0.2)
    h.clock.now = 0.2
    h.sched.schedule()
    (ended,) = h.sched.take_ended()
    assert ended.request_id == "a" and ended.error_code == QUEUE_TIMEOUT
    assert not h.sched.has_unfinished()


def test_queue_deadline_counts_every_wait_and_can_expire_while_preempted():
    # 10 blocks of 4: two requests growing to 60 tokens cannot both fit; the later one is
    # preempted, waits again, and its two waits together pass the limit.
    h = Harness(num_blocks=10, max_model_len=64, max_queue_time_ms=300, dt=0.01,
                kv_admission_watermark=1.0, max_num_batched_tokens=64)
    h.add(request("first", 8, 40))
    h.clock.now += 0.2  # this one waits 0.2 s before it is first scheduled
    victim = h.add(request("second", 8, 40))
    h.sched.waiting.remove(victim)  # hold it back: simulate 0.2 s spent waiting
    victim.wait_start_s = 0.0
    h.sched.waiting.add(victim)
    h.run()
    assert victim.metrics.num_preemptions >= 1
    assert h.final["second"].error_code == QUEUE_TIMEOUT
    assert len(h.tokens["second"]) > 0  # it had produced tokens before it was preempted
    assert victim.time_waiting_s(h.clock.now) >= 0.3
    h.assert_exact("first")


# --------------------------------------------------------------------------- soft watermark
def test_soft_watermark_lets_a_short_request_pass_a_long_one_that_waits():
    # 100 blocks of 4; soft watermark 0.5. A running batch request commits 40 blocks; a long
    # batch request (prompt 60 -> 15 blocks) would pass the watermark and waits, the short one
    # behind it (8 + 4 tokens <= short_request_tokens) goes in.
    h = Harness(num_blocks=100, kv_soft_watermark=0.5, short_request_tokens=16,
                max_num_batched_tokens=400)
    h.add(request("big", 160, 50, tier="batch"))
    h.step()
    h.add(request("long", 60, 40, tier="batch"))
    h.add(request("short", 8, 4, tier="batch"))
    h.add(request("chat", 40, 20))  # interactive: exempt
    h.step()
    assert "short" in h.first_scheduled and "chat" in h.first_scheduled
    assert "long" not in h.first_scheduled
    h.run()
    for name in ("big", "long", "short", "chat"):
        h.assert_exact(name)
    assert h.first_scheduled["long"] > h.first_scheduled["short"]


def test_soft_watermark_counts_the_blocks_running_prefills_still_need():
    # A batch request admitted on its first 16-token chunk will need 40 blocks for its prompt:
    # a second one waits although the blocks in use are few.
    h = Harness(num_blocks=100, kv_soft_watermark=0.5, short_request_tokens=16,
                max_num_batched_tokens=16)
    h.add(request("a", 160, 8, tier="batch"))
    h.step()
    assert h.sched.block_manager.num_used_blocks == 4
    h.add(request("b", 60, 8, tier="batch"))
    h.step()
    assert "b" not in h.first_scheduled


# --------------------------------------------------------------------------- victims
def test_priority_victim_is_lowest_priority_then_most_blocks():
    h = Harness(num_blocks=24, scheduling_policy="priority", priority_aging_ms=0,
                kv_admission_watermark=1.0, max_num_batched_tokens=200)
    h.add(request("chat", 12, 30))               # 3 blocks, interactive
    h.add(request("small", 8, 30, tier="batch"))  # 2 blocks
    h.add(request("big", 40, 30, tier="batch"))   # 10 blocks
    h.step()
    assert h.sched.block_manager.num_free_blocks == 9
    h.run()
    # The first block shortage preempts "big": lowest priority and most blocks; the
    # interactive request is never a victim while a batch one runs.
    assert h.sched.requests == {}
    assert h.final["chat"].num_preemptions == 0
    assert h.final["big"].num_preemptions >= 1
    assert h.sched.preemptions_by_reason["kv_full"] >= 1
    for name in ("chat", "small", "big"):
        h.assert_exact(name)


def test_fcfs_victim_is_the_latest_admitted():
    h = Harness(num_blocks=24, kv_admission_watermark=1.0, max_num_batched_tokens=200)
    h.add(request("big", 40, 30, tier="batch"))
    h.add(request("small", 8, 30, tier="batch"))
    h.add(request("chat", 12, 30))
    h.run()
    assert h.final["chat"].num_preemptions >= 1  # latest admitted, whatever its class
    assert h.final["big"].num_preemptions == 0


def test_waiting_interactive_request_preempts_a_batch_one_for_room():
    h = Harness(num_blocks=30, scheduling_policy="priority", priority_aging_ms=0,
                kv_admission_watermark=0.6, max_num_batched_tokens=200)
    h.add(request("bg", 60, 40, tier="batch"))  # 15 blocks, grows
    h.step()
    h.add(request("chat", 20, 4))  # 5 more blocks would pass the watermark (18 blocks)
    h.step()
    assert "chat" in h.first_scheduled
    assert h.sched.preemptions_by_reason["priority"] == 1
    h.run()
    h.assert_exact("bg")
    h.assert_exact("chat")
    assert len(h.tokens["bg"]) == 40


def test_requests_of_one_priority_never_preempt_each_other_for_admission():
    h = Harness(num_blocks=20, scheduling_policy="priority", priority_aging_ms=10,
                kv_admission_watermark=1.0, max_num_batched_tokens=200)
    h.add(request("bg1", 60, 40, tier="batch"))
    h.step()
    h.clock.now += 5.0  # bg2 is old: its effective priority is far better than bg1's
    h.add(request("bg2", 20, 4, tier="batch"))
    h.sched.waiting.first().arrival_s = -100.0
    h.step()
    assert h.sched.preemptions_by_reason["priority"] == 0


def test_running_batch_prefill_yields_the_step_to_a_waiting_interactive_request():
    h = Harness(num_blocks=400, scheduling_policy="priority", max_num_batched_tokens=32)
    h.add(request("doc", 300, 4, tier="batch"))
    h.step()
    h.add(request("chat", 10, 4))
    out = h.step()
    # The interactive prompt goes first; the batch prefill gets what is left of the budget.
    assert [s.request_id for s in out.sequences] == ["chat", "doc"]
    assert [s.num_tokens for s in out.sequences] == [10, 22]


# --------------------------------------------------------------------------- elastic
def test_elastic_cap_under_pressure_never_below_what_was_produced():
    # Usage passes the soft watermark (12 of 40 blocks) at once, but there is no pressure
    # until a request waits: then the elastic request is capped at what it has + 1.
    h = Harness(num_blocks=40, kv_soft_watermark=0.3, elastic_max_tokens=True,
                elastic_min_tokens=1, max_num_batched_tokens=200, max_model_len=160,
                short_request_tokens=16)
    h.add(request("elastic", 30, None, tier="batch", fixed=False))
    h.add(request("chat", 30, 60, fixed=False))  # interactive: never capped
    for _ in range(5):
        h.step()
    produced = len(h.tokens["elastic"])
    h.add(request("fixed", 30, 60, tier="batch"))  # waits (soft watermark); chose max_tokens
    h.run()
    final = h.final["elastic"]
    assert final.finish_reason.value == "length" and final.elastic_cap == produced + 1
    assert len(h.tokens["elastic"]) == produced + 1
    assert h.final["fixed"].elastic_cap is None and len(h.tokens["fixed"]) == 60
    assert h.final["chat"].elastic_cap is None and len(h.tokens["chat"]) == 60
    h.assert_exact("elastic")


def test_elastic_cap_uses_elastic_min_tokens():
    h = Harness(num_blocks=40, kv_soft_watermark=0.3, elastic_max_tokens=True,
                elastic_min_tokens=12, max_num_batched_tokens=200, max_model_len=160,
                short_request_tokens=16)
    h.add(request("elastic", 60, None, tier="batch", fixed=False))  # 15 blocks > 0.3
    h.step()
    h.add(request("waiter", 60, 4, tier="batch"))
    h.run()
    assert h.final["elastic"].elastic_cap == 12 and len(h.tokens["elastic"]) == 12
    assert len(h.tokens["waiter"]) == 4


def test_elastic_needs_a_soft_watermark():
    with pytest.raises(ValueError, match="kv_soft_watermark"):
        EngineConfig(elastic_max_tokens=True)


# --------------------------------------------------------------------------- KV cap
def test_max_blocks_per_request_refuses_at_admission_and_bounds_open_requests():
    h = Harness(num_blocks=100, max_blocks_per_request=5)  # 20 tokens
    with pytest.raises(ValueError, match="max_blocks_per_request is 5"):
        h.add(request("big", 10, 11))
    with pytest.raises(ValueError, match="max_blocks_per_request"):
        h.add(request("prompt", 20, None))
    assert not h.sched.has_unfinished()
    h.add(request("fits", 10, 10))
    h.add(request("open", 10, None))  # no max_tokens: ends at the cap, "length"
    h.run()
    assert len(h.tokens["fits"]) == 10
    assert len(h.tokens["open"]) == 10 and h.final["open"].finish_reason.value == "length"


# --------------------------------------------------------------------------- presets
def test_presets_resolve_and_explicit_knobs_win():
    interactive = EngineConfig.from_kwargs(preset="interactive")
    assert (interactive.scheduling_policy, interactive.kv_soft_watermark,
            interactive.kv_admission_watermark, interactive.max_num_batched_tokens,
            interactive.priority_aging_ms) == ("priority", 0.7, 0.8, 256, 10_000)
    mine = EngineConfig.from_kwargs(preset="interactive", scheduling_policy="fcfs",
                                    kv_soft_watermark=0.6)
    assert (mine.scheduling_policy, mine.kv_soft_watermark) == ("fcfs", 0.6)
    offline = EngineConfig.from_kwargs(preset="offline")
    assert (offline.scheduling_policy, offline.kv_admission_watermark) == ("fcfs", 0.95)
    fitted = offline.fitted_to_cache(num_blocks=100)
    assert (fitted.max_num_seqs, fitted.max_num_batched_tokens) == (100, 1600)
    assert interactive.fitted_to_cache(10) is interactive
    assert EngineConfig().scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="preset"):
        EngineConfig.from_kwargs(preset="fast")


# --------------------------------------------------------------------------- everything at once
@pytest.mark.parametrize("seed", range(12))
def test_mixed_load_under_pressure_stays_exact(seed):
    rng = random.Random(seed)
    h = Harness(num_blocks=60, max_model_len=200, preset="interactive", block_size=4,
                max_num_batched_tokens=48, max_queue_time_ms=3000, dt=0.01,
                elastic_max_tokens=True, elastic_min_tokens=8, priority_aging_ms=50)
    names = []
    for i in range(60):
        if rng.random() < 0.3:
            r = request(f"b{i}", rng.randint(40, 120), rng.choice([None, 60]), tier="batch",
                        fixed=rng.random() < 0.5)
        else:
            r = request(f"i{i}", rng.randint(4, 20), rng.randint(2, 12))
        h.add(r)
        names.append(r.request_id)
        for _ in range(rng.randint(0, 3)):
            if h.sched.has_unfinished():
                h.step()
    h.run()
    assert set(h.final) == set(names)
    assert sum(h.sched.preemptions_by_reason.values()) > 0  # it did run under pressure
    for name in names:
        if h.final[name].error_code is None:
            h.assert_exact(name)
    stats = h.sched.stats()
    assert stats.preemption_rate >= 0 and stats.num_preemptions_total == sum(
        stats.preemptions.values())


@pytest.mark.parametrize("seed", [0, 2, 4])
def test_long_burst_with_an_interactive_stream_never_stalls_or_thrashes(seed):
    """The pressure benchmark's shape on a cache that holds one or two long prompts: a burst of
    long batch requests, then interactive ones arriving while they run. Every step makes
    progress (the harness asserts it) and everything finishes exactly."""
    rng = random.Random(seed)
    h = Harness(num_blocks=227, max_model_len=3632, preset="interactive", block_size=16,
                dt=0.1)
    for i in range(8):
        h.add(request(f"b{i}", rng.randint(1000, 2000), rng.randint(256, 512), tier="batch"))
    for i in range(32):
        h.add(request(f"i{i}", rng.randint(32, 128), rng.randint(16, 64)))
        for _ in range(20):
            if h.sched.has_unfinished():
                h.step()
    h.run(20_000)
    assert len(h.final) == 40 and all(o.error is None for o in h.final.values())
    for name in h.final:
        h.assert_exact(name)


def test_no_priority_preemption_for_a_request_that_would_not_fit_anyway():
    """Preempting the batch request would free 10 blocks, but the interactive prompt's 20 on
    top of what stays committed would still pass the watermark: nobody is preempted."""
    h = Harness(num_blocks=100, scheduling_policy="priority", priority_aging_ms=0,
                kv_admission_watermark=0.95, max_num_batched_tokens=32)
    big = h.add(request("big", 316, 40))  # interactive, 79 blocks
    while big.num_computed_tokens < 316:
        h.step()
    bg = h.add(request("bg", 36, 40, tier="batch"))  # 9 blocks, then grows
    while bg.num_computed_tokens < 36:
        h.step()
    # 20 blocks: 80 + 10 + 20 > 95, though its first chunk (8 blocks) would fit once bg left
    h.add(request("chat", 80, 4))
    for _ in range(3):
        h.step()
    assert h.sched.preemptions_by_reason["priority"] == 0
    assert "chat" not in h.first_scheduled
    h.run()
    for name in ("big", "bg", "chat"):
        h.assert_exact(name)


@pytest.mark.parametrize("queue_kind", ["fcfs", "priority"])
def test_waiting_queues_keep_their_order_when_many_leave_at_once(queue_kind):
    from batchinfer.core.policy import FCFSQueue, PriorityQueue

    queue = FCFSQueue() if queue_kind == "fcfs" else PriorityQueue(aging_s=1.0)
    requests = [request(f"q{i}", 4, 1, priority=i % 3) for i in range(12)]
    for i, r in enumerate(requests):
        r.arrival_s = float(i)
        queue.add(r)
    before = list(queue)
    queue.remove_all(before[1::3])
    assert list(queue) == [r for r in before if r not in before[1::3]]
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove_all([before[1]])
