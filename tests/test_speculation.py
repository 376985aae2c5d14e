"""Speculative decoding in the scheduler, driven step by step by the fake runner.

The fake runner writes proposed tokens into their KV slots and verifies them greedily (tests/
fake_runner.py), so a scheduler that counted a rejected token as computed, cached a block
holding one, or lost a block in a rollback produces different tokens or breaks an invariant,
checked after every step.
"""

from __future__ import annotations

import random

import pytest

from batchinfer.core import EngineConfig, Request, SamplingParams
from batchinfer.core.block_manager import BlockManager
from batchinfer.core.scheduling import ngram
from batchinfer.core.scheduling.scheduler import Scheduler
from batchinfer.core.scheduling.spec_depth import Candidate, StepCosts, choose_depths
from tests import fake_runner
from tests.fake_runner import FakeRunner, next_token, reference_tokens
from tests.test_scheduler import check_step, make_request

# A memory-bound machine: a step of 8 rows costs little more than one of 1 row.
MEMORY_BOUND = StepCosts((1, 8, 64, 256), (0.020, 0.024, 0.080, 0.300), 0.001,
                         (0.004, 0.005, 0.016, 0.060))
# A compute-bound one: every row costs the same.
COMPUTE_BOUND = StepCosts((1, 8, 64, 256), (0.010, 0.080, 0.640, 2.560), 0.010,
                          (0.004, 0.032, 0.256, 1.024))


def quoting_model(context: list[int]) -> int:
    """A model that mostly repeats the token 12 back (it quotes), with a fresh token every
    ninth position: prompt lookup finds most of its tokens."""
    if len(context) % 9 == 0 or len(context) < 12:
        return next_token(context)
    return context[-12]


def check_cached_blocks(sched: Scheduler, runner: FakeRunner) -> None:
    """Every cached block holds exactly the tokens its key names: no rejected proposal."""
    bm = sched.block_manager
    size = bm.block_size
    for key, block_id in bm._cached.items():
        stored = [runner.slots.get(block_id * size + i) for i in range(size)]
        assert stored == list(key[1]), f"cached block {block_id} holds other tokens"


def run(sched: Scheduler, config: EngineConfig, runner: FakeRunner,
        max_steps: int = 20_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_step(sched, out, config)
        for seq in out.sequences:
            if seq.num_spec_tokens:
                request = sched.requests[seq.request_id]
                assert seq.sample and seq.num_tokens == 1
                assert seq.num_spec_tokens <= config.max_speculative_tokens
                # k proposals yield at most k + 1 tokens: never past the output limit.
                assert seq.num_spec_tokens < sched._work_left(request)
        if out.has_swaps:
            runner.swap_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in)
            sched.swaps_done()
        if out.is_empty:
            raise AssertionError("scheduler made no progress")
        for update in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        sched.block_manager.check_invariants()
        check_cached_blocks(sched, runner)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return outputs


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1, 900) for _ in range(rng.randint(13, 80))], rng.randint(1, 60))
            for _ in range(n)]


SPECULATION = {
    "ngram-3": {"speculative_method": "ngram", "speculative_depth": 3},
    "ngram-auto": {"speculative_method": "ngram"},
    "draft-4": {"speculative_method": "draft", "speculative_model": "self-q4",
                "speculative_depth": 4},
    "draft-auto": {"speculative_method": "draft", "speculative_model": "self-q4"},
}
PRESSURE = {
    "roomy": ({}, 400),
    "chunked": ({"max_num_batched_tokens": 9}, 400),
    "recompute": ({}, 40),
    "swap": ({"preemption_mode": "swap"}, 40),
    "no-prefix-cache": ({"enable_prefix_caching": False}, 40),
}


@pytest.mark.parametrize("pressure", PRESSURE)
@pytest.mark.parametrize("method", SPECULATION)
def test_outputs_exact_with_speculation(method, pressure):
    knobs, num_blocks = PRESSURE[pressure]
    config = EngineConfig.from_kwargs(
        **{"block_size": 4, "max_num_batched_tokens": 64, **knobs, **SPECULATION[method]})
    sched = Scheduler(config, num_blocks=num_blocks, max_model_len=160, step_costs=MEMORY_BOUND,
                      num_swap_blocks=64 if config.preemption_mode == "swap" else 0)
    runner = FakeRunner(4, quoting_model)
    requests = workload(24)
    shared = requests[0][0][:24]  # some prompts share a prefix: the prefix cache is used
    for i, (prompt, max_tokens) in enumerate(requests):
        prompt = shared + prompt if i % 3 == 0 else prompt
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True), arrival_s=0.0))
    outputs = run(sched, config, runner)
    for i, (prompt, max_tokens) in enumerate(requests):
        prompt = shared + prompt if i % 3 == 0 else prompt
        expected = reference_tokens(prompt, max_tokens, quoting_model)[: 160 - len(prompt)]
        assert outputs[f"r{i}"] == expected, f"r{i}"
    stats = sched.speculation.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.accepted_per_position == sorted(stats.accepted_per_position, reverse=True)
    if num_blocks == 40:
        assert sched.num_preemptions_total > 0


def perfect_drafts(monkeypatch):
    monkeypatch.setattr(fake_runner, "draft_misses", lambda context: False)


@pytest.mark.parametrize("stop_at", range(8))
def test_stop_token_inside_an_accepted_run_ends_there(monkeypatch, stop_at):
    perfect_drafts(monkeypatch)  # every proposal accepted: 5 tokens a step at depth 4
    config = EngineConfig(block_size=4, speculative_method="draft", speculative_model="self-q4",
                          speculative_depth=4)
    sched = Scheduler(config, num_blocks=50, max_model_len=256)
    prompt = make_request(0, 6, 1).prompt_token_ids
    expected = reference_tokens(prompt, 20)
    stop = expected[stop_at]
    assert stop not in expected[:stop_at]
    request = Request("r", prompt, SamplingParams(max_tokens=20, stop_token_ids=[stop]),
                      arrival_s=0.0)
    sched.add_request(request)
    outputs = run(sched, config, FakeRunner(4))
    assert outputs["r"] == expected[: stop_at + 1]
    assert request.stop_reason == stop and request.status.finish_reason == "stop"


def test_max_tokens_and_context_end_inside_an_accepted_run(monkeypatch):
    perfect_drafts(monkeypatch)
    config = EngineConfig(block_size=4, speculative_method="draft", speculative_model="self-q4",
                          speculative_depth=4)
    sched = Scheduler(config, num_blocks=50, max_model_len=20)
    prompts = [make_request(i, 6, 1).prompt_token_ids for i in range(3)]
    for i, max_tokens in enumerate((7, 3, 100)):  # the last is cut by max_model_len (20)
        sched.add_request(Request(f"r{i}", prompts[i], SamplingParams(
            max_tokens=max_tokens, ignore_eos=True), arrival_s=0.0))
    outputs = run(sched, config, FakeRunner(4))
    assert outputs["r0"] == reference_tokens(prompts[0], 7)
    assert outputs["r1"] == reference_tokens(prompts[1], 3)
    assert outputs["r2"] == reference_tokens(prompts[2], 14)


class WrongDrafts(FakeRunner):
    """Every proposal of its draft model is wrong."""

    def _draft(self, context: list[int], k: int) -> list[int]:
        return [(t + 1) % fake_runner.VOCAB for t in super()._draft(context, k)]


def test_rejected_proposals_give_their_blocks_back():
    config = EngineConfig(block_size=4, speculative_method="draft", speculative_model="self-q4",
                          speculative_depth=8)
    sched = Scheduler(config, num_blocks=20, max_model_len=256)
    runner = WrongDrafts(4)
    sched.add_request(make_request(0, 9, 30))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    request = sched.requests["r0"]
    free_before = sched.block_manager.num_free_blocks
    out = sched.schedule()
    (seq,) = out.sequences
    assert seq.num_spec_tokens == 8
    # The proposal's blocks are allocated for the step: positions 10..17 reach a 5th block...
    assert len(seq.block_table) == 5 and sched.block_manager.num_free_blocks == free_before - 2
    result = runner.execute(out)
    assert result.accepted_token_ids == [[]]
    sched.update_from_output(out, result)
    # ...and go back once rejected: 11 tokens (one new) need 3 blocks.
    assert request.num_computed_tokens == 10 and request.num_tokens == 11
    assert len(sched.block_manager.block_table("r0")) == 3
    assert sched.block_manager.num_free_blocks == free_before
    sched.block_manager.check_invariants()


def test_constrained_and_finishing_sequences_do_not_propose():
    from batchinfer.core.structured_output import StructuredOutput

    config = EngineConfig(block_size=4, speculative_method="draft", speculative_model="self-q4",
                          speculative_depth=4)
    sched = Scheduler(config, num_blocks=50, max_model_len=256)
    prompts = [make_request(i, 6, 1).prompt_token_ids for i in range(3)]
    sched.add_request(Request("grammar", prompts[0], SamplingParams(
        max_tokens=20, structured_output=StructuredOutput(regex="[a-z]+")), arrival_s=0.0))
    sched.add_request(Request("short", prompts[1], SamplingParams(max_tokens=2), arrival_s=0.0))
    sched.add_request(Request("free", prompts[2], SamplingParams(max_tokens=20), arrival_s=0.0))
    runner = FakeRunner(4)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    depths = {s.request_id: s.num_spec_tokens for s in out.sequences}
    # "short" has one token left to produce: a proposal could only be wasted.
    assert depths == {"grammar": 0, "short": 0, "free": 4}


def test_proposals_take_only_what_the_step_leaves():
    config = EngineConfig(block_size=4, max_num_batched_tokens=6, speculative_method="draft",
                          speculative_model="self-q4", speculative_depth=4)
    sched = Scheduler(config, num_blocks=50, max_model_len=256)
    runner = FakeRunner(4)
    for i in range(3):
        sched.add_request(make_request(i, 2, 30))
    out = sched.schedule()  # three 2-token prompts: 6 tokens, the whole budget
    assert [s.num_spec_tokens for s in out.sequences] == [0, 0, 0]
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()  # three decodes leave 3 tokens: the first sequence takes them
    assert [s.num_spec_tokens for s in out.sequences] == [3, 0, 0]
    assert out.num_scheduled_tokens == 6


# ----------------------------------------------------------------- depth from the load
def test_auto_depth_follows_the_cost_of_rows():
    likely = [Candidate(6, 0.9)] * 4
    deep = choose_depths(likely, MEMORY_BOUND, num_rows=4, num_prefill_tokens=0,
                         base_tokens=4, max_total=100, drafts=False)
    assert deep == [6, 6, 6, 6]
    assert choose_depths(likely, COMPUTE_BOUND, 4, 0, 4, 100, drafts=False) == [0, 0, 0, 0]
    # Rarely accepted proposals are not worth even cheap rows.
    assert choose_depths([Candidate(6, 0.02)] * 4, MEMORY_BOUND, 4, 0, 4, 100,
                         drafts=False) == [0, 0, 0, 0]
    # The budget caps the total.
    assert sum(choose_depths(likely, MEMORY_BOUND, 4, 0, 4, 5, drafts=False)) == 5


def test_auto_depth_weighs_the_draft_model_and_priority_classes():
    likely = [Candidate(6, 0.9)] * 2
    without = choose_depths(likely, MEMORY_BOUND, 2, 0, 2, 100, drafts=False)
    with_draft = choose_depths(likely, MEMORY_BOUND, 2, 0, 2, 100, drafts=True)
    assert 0 < sum(with_draft) < sum(without)  # each draft round costs a draft step
    # Between the extremes, the heavier class gets depth first.
    costs = StepCosts((1, 8, 64), (0.010, 0.030, 0.200), 0.001)
    mixed = [Candidate(6, 0.7, weight=2.0), Candidate(6, 0.7, weight=1.0)]
    interactive, batch = choose_depths(mixed, costs, 2, 0, 3.0, 100, drafts=False)
    assert interactive > batch


def test_auto_depth_turns_itself_off_when_compute_bound():
    config = EngineConfig(block_size=4, speculative_method="draft", speculative_model="self-q4")
    sched = Scheduler(config, num_blocks=400, max_model_len=256, step_costs=COMPUTE_BOUND)
    for i in range(8):
        sched.add_request(make_request(i, 5, 30))
    outputs = run(sched, config, FakeRunner(4))
    assert sched.speculation.stats.num_draft_tokens == 0
    for i in range(8):
        assert outputs[f"r{i}"] == reference_tokens(make_request(i, 5, 30).prompt_token_ids, 30)


def test_a_draft_model_starts_only_where_proposals_pay_once_prefills_are_done():
    """Steps dominated by prefill chunks make a few decodes' proposals cheap, but a draft
    model's first proposal writes the sequence's whole context: with 40 requests, whose
    decode steps are compute-bound, no sequence starts; one request alone does."""
    costs = StepCosts((1, 8, 64), (0.010, 0.012, 0.200), 0.005, (0.002, 0.004, 0.050))
    assert choose_depths([Candidate(4, 0.8)] * 3, costs, 3, 1000, 3, 100, drafts=True) != [
        0, 0, 0]  # on its own, a prefill step would take proposals
    config = EngineConfig(block_size=4, speculative_method="draft", speculative_model="self-q4",
                          max_num_batched_tokens=256)
    for num_requests, proposing in ((40, False), (1, True)):
        sched = Scheduler(config, num_blocks=2000, max_model_len=256, step_costs=costs)
        for i in range(num_requests):
            sched.add_request(make_request(i, 60, 20))
        run(sched, config, FakeRunner(4))
        assert (sched.speculation.stats.num_drafts > 0) == proposing, num_requests


def test_a_request_whose_proposals_fail_stops_proposing():
    config = EngineConfig(block_size=4, speculative_method="draft", speculative_model="self-q4")
    sched = Scheduler(config, num_blocks=400, max_model_len=512, step_costs=MEMORY_BOUND)
    sched.add_request(make_request(0, 5, 200))
    run(sched, config, WrongDrafts(4))
    stats = sched.speculation.stats
    assert stats.num_accepted_tokens == 0
    # Tried, then left alone but for a try every few tens of steps (200 tokens: 200 steps).
    assert 0 < stats.num_drafts < 25


def test_auto_depth_needs_step_costs():
    config = EngineConfig(speculative_method="ngram")
    with pytest.raises(ValueError, match="step costs"):
        Scheduler(config, num_blocks=10, max_model_len=64)


# ----------------------------------------------------------------- units
def test_prompt_lookup_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert ngram.propose(tokens, 3, 2, 4) == [5, 6, 7]  # the latest "1 2 3", not the first
    assert ngram.propose(tokens, 10, 2, 4) == [5, 6, 7, 1, 2, 3]
    assert ngram.propose([1, 2, 3, 4], 3, 1, 3) == []  # nothing earlier matches
    assert ngram.propose([7, 7, 7], 2, 1, 2) == [7]  # overlapping: "7 7" at 0, then one "7"
    # The longest suffix that matches wins: "8 3" occurs once, "3" twice.
    assert ngram.propose([8, 3, 4, 3, 5, 8, 3], 1, 1, 2) == [4]


def test_prompt_lookup_skips_matches_that_straddle_tokens():
    # As bytes, 256 = 00 01 00 00 and 1 = 01 00 00 00: the pattern [1, 0] packed appears
    # inside [256, 0, 0] one byte off; only token-aligned matches count.
    tokens = [256, 0, 0, 9, 1, 0]
    assert ngram.propose(tokens, 2, 2, 2) == []
    assert ngram.propose([1, 0, 4, 256, 0, 0, 1, 0], 1, 2, 2) == [4]


def test_trim_gives_back_uncached_tail_blocks_only():
    bm = BlockManager(10, 4, enable_prefix_caching=True)
    tokens = list(range(1, 13))
    table = bm.allocate("r", 12)
    assert table is not None and len(table) == 3
    bm.cache_blocks("r", tokens, 8)  # two full blocks computed: cached
    bm.trim("r", 9)  # 9 tokens need 3 blocks: nothing goes
    assert len(bm.block_table("r")) == 3
    bm.allocate("r", 20)
    bm.trim("r", 9)
    assert len(bm.block_table("r")) == 3 and bm.num_free_blocks == 7
    bm.check_invariants()
    with pytest.raises(RuntimeError, match="cached block"):
        bm.trim("r", 4)


def test_speculation_knobs_are_validated():
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_depth"):
        EngineConfig(speculative_method="ngram", speculative_depth="deep")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=4, prompt_lookup_max=3)
    assert EngineConfig(speculative_method="ngram", speculative_depth="3").speculative_depth == 3
    assert EngineConfig(speculative_method="ngram", speculative_depth=3).max_speculative_tokens == 3
    assert EngineConfig().max_speculative_tokens == 0
