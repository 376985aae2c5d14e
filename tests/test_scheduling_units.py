"""Each scheduling rule alone, with hand-built inputs and no Scheduler: the unit that holds a
rule (docs/scheduling.md, "Where each rule lives") must decide exactly what the rule says."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from batchinfer.core import EngineConfig, Request, SamplingParams
from batchinfer.core.config import SCHEDULING_POLICIES
from batchinfer.core.policy import FCFSQueue
from batchinfer.core.preemption import KeptKV, PreemptionCosts, fits_swap_in, plan_kept_kv
from batchinfer.core.request import RequestStatus
from batchinfer.core.scheduling import victims
from batchinfer.core.scheduling.admission import Watermarks, admission_size, batch_due
from batchinfer.core.scheduling.deadlines import QueueDeadlines
from batchinfer.core.scheduling.deferral import deferral_target, is_deferred
from batchinfer.core.scheduling.elastic import ElasticCaps
from batchinfer.core.scheduling.policies import POLICIES, make_policy


def request(name: str, prompt_len: int = 8, *, priority: int = 0, arrival_s: float = 0.0,
            max_tokens: int | None = 16, tier: str = "interactive") -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    r = Request(name, list(range(1, prompt_len + 1)), params, arrival_s=arrival_s)
    r.priority, r.priority_class = priority, tier
    return r


# ----------------------------------------------------------------- policies
def test_the_config_accepts_exactly_the_registered_policies():
    assert SCHEDULING_POLICIES == tuple(POLICIES) == ("fcfs", "priority")
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lottery")


def test_fcfs_keeps_arrival_order_and_takes_the_latest_admitted_as_victim():
    fcfs = make_policy("fcfs", aging_s=1.0)
    queue = fcfs.new_queue()
    late, early = request("late", priority=0, arrival_s=2.0), request("early", priority=10)
    for r in (early, late):
        queue.add(r)
    assert list(queue) == [early, late]  # priorities are not read
    running = [early, late]
    fcfs.order_running(running, held=lambda r: 0, left=lambda r: 0)
    assert running == [early, late]
    assert fcfs.choose_victim(running, held=lambda r: 0, left=lambda r: 0) is late
    assert not fcfs.yields_to(early, late) and not fcfs.aged_to_interactive(early, now=99.0)


def test_priority_ranks_by_effective_priority_and_victimises_the_worst():
    policy = make_policy("priority", aging_s=1.0)
    batch = request("batch", priority=10, arrival_s=0.0)
    chat = request("chat", priority=0, arrival_s=5.0)
    queue = policy.new_queue()
    queue.add(chat)
    queue.add(batch)
    assert list(queue) == [chat, batch]
    assert policy.rank(batch, now=4.0) == 6.0
    assert not policy.aged_to_interactive(batch, now=9.9) and policy.aged_to_interactive(batch, 10)
    held = {"batch": 1, "chat": 9}
    running = [batch, chat]
    policy.order_running(running, held=lambda r: held[r.request_id], left=lambda r: 0)
    assert running == [chat, batch]  # the lowest priority last, blocks held notwithstanding
    other = request("other", priority=10, arrival_s=1.0)
    held["other"] = 2
    assert policy.choose_victim([batch, other], lambda r: held[r.request_id], lambda r: 0) is other


# ----------------------------------------------------------------- victims
def test_a_running_request_yields_only_to_a_better_base_priority_it_was_not_aged_to():
    chat = request("chat", priority=0)
    batch = request("batch", priority=10)
    batch.admitted_rank = 10.0
    assert victims.yields_to(batch, chat) and not victims.yields_to(chat, batch)
    batch.admitted_rank = 0.0  # it aged in at the interactive level: it keeps its place
    assert not victims.yields_to(batch, chat)
    assert not victims.yields_to(request("a", priority=5), request("b", priority=5))


def test_victim_key_orders_priority_then_blocks_then_work_then_arrival():
    a, b = request("a", priority=10, arrival_s=0.0), request("b", priority=10, arrival_s=1.0)
    key = victims.priority_victim_key
    assert key(a, 3, 0) > key(b, 2, 99)  # more blocks held beats more work left
    assert key(a, 2, 5) > key(b, 2, 4)
    assert key(b, 2, 4) > key(a, 2, 4)  # then the latest arrival
    assert key(request("c", priority=11), 0, 0) > key(a, 9, 9)


def test_nobody_is_preempted_for_nothing():
    room = dict(take=2, whole=6, committed=90, num_free_blocks=1, num_freed=1, num_pending=0,
                limit=95.0, all_yield=False)
    assert victims.preempting_makes_room(**room)
    assert not victims.preempting_makes_room(**{**room, "num_freed": 0})  # first chunk won't fit
    assert not victims.preempting_makes_room(**{**room, "whole": 7})  # past the watermark
    assert victims.preempting_makes_room(**{**room, "whole": 7, "all_yield": True})  # empties


# ----------------------------------------------------------------- preemption mode
COSTS = PreemptionCosts(prefill_s_per_token=1e-3, swap_s_per_block=1e-6, swap_fixed_s=2e-2)


def test_the_kept_kv_follows_the_mode_the_swap_cap_and_the_costs():
    # 10 computed tokens in blocks of 4: 3 blocks.
    assert plan_kept_kv("recompute", 10, 4, 100, 100, None) == KeptKV(0, 0)
    assert plan_kept_kv("swap", 10, 4, 100, 100, None) == KeptKV(3, 10)
    assert plan_kept_kv("swap", 10, 4, 100, 2, None) == KeptKV(2, 8)  # the step's cap: rest recomputed
    assert plan_kept_kv("swap", 10, 4, 1, 100, None) == KeptKV(1, 4)  # the host pool's free blocks
    assert plan_kept_kv("swap", 0, 4, 100, 100, None).mode == "recompute"
    # auto: a fixed 20 ms each way is worth it only past 40 tokens of recompute.
    assert plan_kept_kv("auto", 39, 4, 100, 100, COSTS).mode == "recompute"
    assert plan_kept_kv("auto", 41, 4, 100, 100, COSTS) == KeptKV(11, 41)


def test_a_swap_in_waits_for_a_step_with_room_under_the_cap():
    assert fits_swap_in(num_copied_in=120, num_blocks=8, max_swap_blocks_per_step=128)
    assert not fits_swap_in(num_copied_in=121, num_blocks=8, max_swap_blocks_per_step=128)


# ----------------------------------------------------------------- queue deadlines
def test_a_waiting_request_expires_when_its_own_or_the_engine_limit_runs_out():
    deadlines = QueueDeadlines(max_queue_time_ms=None)
    plain, own = request("plain"), request("own")
    own.queue_timeout_s = 2.0
    assert deadlines.expired([plain, own], now=100.0) == []  # nobody tracked: no scan at all
    deadlines.track(own)
    own.waited_s, own.wait_start_s = 1.5, 10.0  # preempted after 1.5 s of waiting, requeued at 10
    assert deadlines.deadline_s(own) == 10.5 and deadlines.deadline_s(plain) is None
    assert deadlines.expired([plain, own], now=10.4) == []
    assert deadlines.expired([plain, own], now=10.5) == [own]
    assert deadlines.earliest_s([plain, own]) == 10.5
    deadlines.untrack(own)
    assert not deadlines.active
    engine = QueueDeadlines(max_queue_time_ms=500.0)
    assert engine.expired([plain], now=0.5) == [plain] and engine.expired([plain], 0.49) == []


# ----------------------------------------------------------------- elastic max_tokens
def test_elastic_caps_only_uncapped_batch_requests_that_did_not_choose_max_tokens():
    caps = ElasticCaps(enabled=True, kv_soft_watermark=0.7, elastic_min_tokens=64)
    assert caps.under_pressure(num_waiting=1, kv_cache_usage=0.71)
    assert not caps.under_pressure(num_waiting=0, kv_cache_usage=0.99)
    assert not caps.under_pressure(num_waiting=1, kv_cache_usage=0.7)
    assert not ElasticCaps(False, 0.7, 64).under_pressure(1, 0.99)
    long = request("long", max_tokens=None, tier="batch")
    long.elastic = True
    assert caps.cap_for(long, output_limit=1000) == 64
    long.output_token_ids = [1] * 80
    assert caps.cap_for(long, output_limit=1000) == 81  # never below what it has + 1
    assert caps.cap_for(long, output_limit=81) is None  # it would not lower the limit
    chat = request("chat", max_tokens=None)
    chat.elastic = True
    assert caps.cap_for(chat, output_limit=1000) is None  # interactive
    long.elastic = False
    assert caps.cap_for(long, output_limit=1000) is None  # it chose its max_tokens


# ----------------------------------------------------------------- admission
@dataclass
class Blocks:
    num_blocks: int
    num_free_blocks: int

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


def watermarks(whole_prompt: bool = False, soft: float | None = 0.7) -> Watermarks:
    return Watermarks(max_num_seqs=4, kv_admission_watermark=0.9, kv_soft_watermark=soft,
                      short_request_tokens=32, whole_prompt=whole_prompt)


def test_admission_needs_a_seat_the_free_blocks_and_the_admission_watermark():
    fcfs, priority = watermarks(), watermarks(whole_prompt=True)
    blocks = Blocks(num_blocks=100, num_free_blocks=20)  # 80 used; the watermark is 90
    assert fcfs.admissible(needed=10, committed_after=200, num_running=1, blocks=blocks)
    assert not fcfs.admissible(needed=11, committed_after=0, num_running=1, blocks=blocks)
    assert not fcfs.admissible(needed=1, committed_after=0, num_running=4, blocks=blocks)  # seats
    assert fcfs.admissible(needed=20, committed_after=0, num_running=0, blocks=blocks)  # empty
    assert not fcfs.admissible(needed=21, committed_after=0, num_running=0, blocks=blocks)
    # The whole prompt on top of what running prefills still need, not the first chunk.
    assert priority.admissible(needed=15, committed_after=90, num_running=1, blocks=blocks)
    assert not priority.admissible(needed=1, committed_after=91, num_running=1, blocks=blocks)


def test_the_soft_watermark_holds_back_all_but_interactive_short_and_aged_requests():
    rules = watermarks(soft=0.7)
    assert rules.above_soft(committed_after=71, num_running=1, num_blocks=100)
    assert not rules.above_soft(committed_after=70, num_running=1, num_blocks=100)
    assert not rules.above_soft(committed_after=99, num_running=0, num_blocks=100)  # empty
    assert not watermarks(soft=None).above_soft(99, 1, 100)
    batch = request("batch", prompt_len=20, tier="batch")
    assert not rules.soft_exempt(batch, num_tokens_left=13, aged=False)
    assert rules.soft_exempt(batch, num_tokens_left=12, aged=False)  # 20 + 12: short
    assert rules.soft_exempt(batch, num_tokens_left=13, aged=True)
    assert rules.soft_exempt(request("chat", 20), num_tokens_left=500, aged=False)


def test_admission_size_counts_the_cached_prefix_and_the_first_chunk():
    r = request("r", prompt_len=30)  # blocks of 8: 4 blocks in all
    size = admission_size(r, budget=10, cached=[7, 9], num_reused=1, block_size=8)
    # The cached 16 tokens are not computed again; the chunk is 10 tokens, to token 26.
    assert (size.start, size.num_new) == (16, 10)
    assert size.whole == 4 - 2 + 1 and size.take == 4 - 2 + 1
    r.swap_blocks, r.num_computed_tokens = [0, 1], 12  # swapped out: its KV comes back
    size = admission_size(r, budget=100, cached=[], num_reused=0, block_size=8)
    assert (size.start, size.num_new, size.take) == (12, 18, 4)


def test_a_batch_form_starts_when_full_closed_resumed_or_overdue():
    queue = FCFSQueue()
    queue.add(request("a", arrival_s=1.0))
    due = dict(batching="dynamic", input_closed=False, max_batch_delay_ms=50.0)
    assert batch_due(queue, 1, clock=lambda: 0.0, **due)
    assert not batch_due(queue, 2, clock=lambda: 1.04, **due)
    assert batch_due(queue, 2, clock=lambda: 1.05, **due)
    assert not batch_due(queue, 2, clock=lambda: 9.0, **{**due, "batching": "static"})
    assert batch_due(queue, 2, clock=lambda: 0.0, **{**due, "input_closed": True})
    queue.first().status = RequestStatus.PREEMPTED
    assert batch_due(queue, 2, clock=lambda: 0.0, **{**due, "batching": "static"})


# ----------------------------------------------------------------- deferral
def test_a_prefill_chunk_waits_for_a_better_waiting_request_a_decode_never_does():
    priority, fcfs = make_policy("priority", 1.0), make_policy("fcfs", 1.0)
    queue = priority.new_queue()
    assert deferral_target(queue, continuous=True) is None
    chat = request("chat", priority=0)
    queue.add(chat)
    assert deferral_target(queue, continuous=False) is None
    assert deferral_target(queue, continuous=True) is chat
    batch = request("batch", prompt_len=100, priority=10)
    batch.admitted_rank, batch.num_computed_tokens = 10.0, 50
    assert is_deferred(batch, chat, priority)
    assert not is_deferred(batch, chat, fcfs)  # fcfs: nobody yields
    assert not is_deferred(batch, None, priority)
    batch.num_computed_tokens = 99  # one token left: a decode
    assert not is_deferred(batch, chat, priority)


# ----------------------------------------------------------------- prefix sharing
def test_a_copy_waits_for_the_running_prefill_of_its_prompt_then_finds_it_cached():
    from batchinfer.core.block_manager import BlockManager
    from batchinfer.core.scheduling.prefix_sharing import PrefixSharing

    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    sharing = PrefixSharing(bm)
    first, copy, other = request("a", 13), request("b", 13), request("c", 13)
    other.prompt_token_ids[:] = other.all_token_ids[:] = [9] * 13
    prefilling: dict = {}
    assert sharing.cached_prefix(first) == []
    bm.allocate("a", 13)
    sharing.admitted(first, prefilling)  # its prefill runs: 13 tokens, 3 full blocks to come
    assert sharing.cached_prefix(copy) == [] and sharing.cached_prefix(other) == []
    assert sharing.waits_for_a_running_prefill(copy, [], prefilling)
    assert not sharing.waits_for_a_running_prefill(other, [], prefilling)  # another prompt
    first.num_computed_tokens = 12  # its first 3 blocks are computed and cached
    bm.cache_blocks("a", first.all_token_ids, 12)
    assert not sharing.waits_for_a_running_prefill(copy, [], prefilling)
    assert len(sharing.cached_prefix(copy)) == 3
    # Without prefix caching nobody waits and nothing is cached.
    plain = PrefixSharing(BlockManager(num_blocks=16, block_size=4))
    assert plain.prefilling_by_first_block([first]) == {} and plain.cached_prefix(copy) == []
