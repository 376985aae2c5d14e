"""Speculative decoding in the scheduler: who proposes how many tokens this step, and what the
verification accepted.

After the step is scheduled (running requests, admissions), `plan` looks at its decodes: a
sequence may propose when it samples from one new token, is not constrained by a grammar
(structured outputs: a rollback would have to rewind its matcher, so constrained sequences
always get depth 0), and has room for more than one more output token. Its depth is the fixed
`speculative_depth`, or with `auto` the one `spec_depth.choose_depths` finds best for this
step's load; it never exceeds the budget left in the step, the blocks free, the output tokens
left (max_tokens, the context) or, for `ngram`, the tokens the lookup found. Proposals take
only what the step left: they never preempt and never delay an admission.

The blocks of proposed tokens are allocated here; after the step (`Scheduler.
update_from_output`) the accepted ones count as computed, and blocks that only rejected
proposals reached go back (`BlockManager.trim`). A block enters the prefix cache only once full
of computed tokens, and a rejected token's slot is written again (with the accepted token of
that position) before any step counts it as computed, so no block holding a rejected token is
ever cached.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from batchinfer.core.block_manager import BlockManager
from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import ScheduledSequence, SchedulerOutput, SpecDecodeStats
from batchinfer.core.request import Request
from batchinfer.core.scheduling import ngram
from batchinfer.core.scheduling.spec_depth import (
    CLASS_WEIGHTS,
    Candidate,
    StepCosts,
    choose_depths,
)

# A request's acceptance rate: (accepted + PRIOR_WEIGHT x PRIOR_ACCEPTANCE) / (verified +
# PRIOR_WEIGHT), over its verified positions (each accepted one, and the first rejected one of
# a proposal), counted with a fading memory (older ones weigh `FORGET` less per proposal).
# The prior is optimistic, so where proposals are cheap a request is tried before anything is
# known of it. While a request that could propose does not, its counts fade by `RELAX` a step,
# so its rate drifts back towards the prior: one that did badly is tried again some tens of
# steps later, at the cost of one proposal.
PRIOR_ACCEPTANCE = 0.8
PRIOR_WEIGHT = 2.0
FORGET = 0.95
RELAX = 0.01


class Speculation:
    """Per-step speculation depths and the acceptance statistics (see the module docstring).
    `costs`: the step costs measured at start-up (needed by `speculative_depth auto`)."""

    def __init__(self, config: EngineConfig, costs: StepCosts | None = None) -> None:
        self.method = config.speculative_method
        self.max_depth = config.max_speculative_tokens
        self.auto = config.speculative_depth == "auto"
        if self.auto and costs is None:
            raise ValueError("speculative_depth auto needs the step costs measured at start-up")
        self.costs = costs
        self.lookup = (config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.max_depth)

    def plan(self, output: SchedulerOutput, requests: Mapping[str, Request], bm: BlockManager,
             budget: int, work_left: Callable[[Request], int], num_running: int) -> None:
        """Give this step's eligible decodes their proposed tokens (depth, blocks, and for
        ngram the tokens), within `budget` tokens; `work_left(request)`: output tokens it may
        still produce; `num_running`: requests running."""
        eligible: list[tuple[ScheduledSequence, Request, int, list[int] | None]] = []
        num_eligible = 0
        for seq in output.sequences:
            request = requests[seq.request_id]
            cap = self._cap(seq, request, work_left)
            if cap <= 0:
                continue
            num_eligible += 1
            proposal = None
            if self.method == "ngram":
                proposal = ngram.propose(request.all_token_ids, cap, *self.lookup)
                if not proposal:
                    continue
                cap = len(proposal)
            elif not self._may_start(request, cap, num_running):
                continue
            eligible.append((seq, request, cap, proposal))
        depths = self._depths(output, requests, eligible, budget)
        chosen = 0
        for (seq, request, _, proposal), depth in zip(eligible, depths, strict=True):
            depth = min(depth, budget, self._room_in_blocks(request, bm))
            if depth <= 0:
                self._relax(request)
                continue
            table = bm.allocate(request.request_id, request.num_tokens + depth)
            if table is None:  # not reached: `_room_in_blocks` counted the free blocks
                raise RuntimeError("speculation allocated more blocks than were free")
            seq.block_table = list(table)
            seq.num_spec_tokens = depth
            seq.spec_token_ids = proposal[:depth] if proposal is not None else None
            request.spec_draft_started = request.num_preemptions
            budget -= depth
            chosen += depth
        self.stats.depth = chosen / num_eligible if num_eligible else 0.0
        self.stats.max_depth = max((s.num_spec_tokens for s in output.sequences), default=0)

    def _cap(self, seq: ScheduledSequence, request: Request,
             work_left: Callable[[Request], int]) -> int:
        """The most tokens this sequence may propose now (0: it may not)."""
        if not seq.sample or seq.num_tokens != 1:
            return 0
        if request.sampling_params.structured_output is not None:
            return 0
        # k proposals yield up to k + 1 tokens: leave room for the last one.
        return min(self.max_depth, work_left(request) - 1)

    def _may_start(self, request: Request, cap: int, num_running: int) -> bool:
        """Whether a request whose draft K/V is not written yet may start proposing (auto
        depth, draft model): its first proposal writes the draft model's K/V of its whole
        context, worth it only if proposals go on paying in a step of every running request
        decoding, not only in this step (one dominated by prefill chunks, say): if every
        running request proposed like it, would any proposal pay?"""
        if not self.auto or self.method != "draft":
            return True
        if request.spec_draft_started == request.num_preemptions:
            return True  # started, and not preempted since (the runner forgets then)
        return self._pays_when_decoding(cap, round(acceptance(request), 2), num_running)

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (one per engine, bounded)
    def _pays_when_decoding(self, cap: int, rate: float, num_running: int) -> bool:
        assert self.costs is not None  # checked at construction
        depths = choose_depths([Candidate(cap, rate)] * num_running, self.costs,
                               num_rows=num_running, num_prefill_tokens=0,
                               base_tokens=num_running, max_total=cap * num_running,
                               drafts=True)
        return any(depths)

    @staticmethod
    def _room_in_blocks(request: Request, bm: BlockManager) -> int:
        """Proposed tokens the request's blocks and the free ones can hold."""
        held = len(bm.block_table(request.request_id))
        return (held + bm.num_free_blocks) * bm.block_size - request.num_tokens

    def _depths(self, output: SchedulerOutput, requests: Mapping[str, Request],
                eligible: list[tuple[ScheduledSequence, Request, int, list[int] | None]],
                budget: int) -> list[int]:
        if not self.auto:
            return [cap for _, _, cap, _ in eligible]
        assert self.costs is not None  # checked at construction
        candidates = []
        for _, request, cap, _ in eligible:
            candidates.append(Candidate(cap, acceptance(request),
                                        CLASS_WEIGHTS.get(request.priority_class, 1.0)))
        num_rows = sum(1 for s in output.sequences if s.num_tokens == 1)
        num_prefill = output.num_scheduled_tokens - num_rows
        base = sum(CLASS_WEIGHTS.get(requests[s.request_id].priority_class, 1.0)
                   for s in output.sequences if s.sample)
        return choose_depths(candidates, self.costs, num_rows, num_prefill, base, budget,
                             drafts=self.method == "draft")

    @staticmethod
    def _relax(request: Request) -> None:
        """A request that could propose but does not: its evidence fades."""
        request.spec_accepted *= 1.0 - RELAX
        request.spec_verified *= 1.0 - RELAX

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """One verification of `num_proposed` tokens of which the first `num_accepted` were
        accepted: the counters, and the request's acceptance rate."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        verified = num_accepted + (1 if num_accepted < num_proposed else 0)
        request.spec_accepted = request.spec_accepted * FORGET + num_accepted
        request.spec_verified = request.spec_verified * FORGET + verified


def acceptance(request: Request) -> float:
    """The request's estimated chance that a proposed token is accepted (given the ones
    before it were)."""
    return ((request.spec_accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE)
            / (request.spec_verified + PRIOR_WEIGHT))
