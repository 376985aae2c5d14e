"""How many tokens each sequence proposes this step (`speculative_depth auto`).

The runner verifies a sequence's k proposed tokens as k extra one-token rows of the step (each
over the sequence's paged KV, causal among themselves), so a step's cost is the cost of a step
of that many rows. `StepCosts` holds that cost as measured at start-up on this machine and
model (`runner/speculative/costs.py`, cached like the kernel choice): seconds per step of
`rows` one-token rows, the same for prefill tokens, and for `draft` the draft model's steps.

A proposed token at position j of a sequence whose proposals are accepted with probability
alpha (its running acceptance rate) adds alpha^j expected tokens: it counts only if the ones
before it were accepted too. `choose_depths` adds proposal positions in order of that gain
(weighted by priority class) and keeps the count that maximises expected tokens per second of
step time, drafting included. Where steps are memory-bound, rows are nearly free and depth
grows; where they are compute-bound, every row costs its share and depth falls to 0; a request
whose proposals are rarely accepted gets none.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

# Expected-token weight of a sequence by priority class: interactive requests get depth first.
CLASS_WEIGHTS = {"interactive": 2.0, "batch": 1.0}


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Measured step costs: `decode_s[i]` seconds for a step of `rows[i]` one-token rows
    (ascending rows), `prefill_token_s` seconds per token of prefill chunks in a step, and
    `draft_s[i]` seconds for a draft model step of `rows[i]` rows (None: no draft model)."""

    rows: tuple[int, ...]
    decode_s: tuple[float, ...]
    prefill_token_s: float
    draft_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.rows or list(self.rows) != sorted(set(self.rows)) or self.rows[0] < 1:
            raise ValueError(f"rows must be ascending distinct counts >= 1, got {self.rows}")
        for name in ("decode_s", "draft_s"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.rows):
                raise ValueError(f"{name} needs one time per row count")

    def step_s(self, num_rows: int, num_prefill_tokens: int = 0) -> float:
        """Seconds of a step of `num_rows` one-token rows and `num_prefill_tokens` tokens of
        prefill chunks."""
        return _interpolate(self.rows, self.decode_s, num_rows) + (
            self.prefill_token_s * num_prefill_tokens)

    def draft_step_s(self, num_rows: int) -> float:
        """Seconds of one draft model step of `num_rows` rows (0 without a draft model)."""
        if self.draft_s is None or num_rows <= 0:
            return 0.0
        return _interpolate(self.rows, self.draft_s, num_rows)


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """Piecewise linear through (xs, ys), extended linearly past both ends (never below 0)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A sequence that may propose: at most `max_depth` tokens, accepted with probability
    `acceptance` each, its expected tokens weighted by `weight`."""

    max_depth: int
    acceptance: float
    weight: float = 1.0


def choose_depths(candidates: Sequence[Candidate], costs: StepCosts, num_rows: int,
                  num_prefill_tokens: int, base_tokens: float, max_total: int,
                  drafts: bool) -> list[int]:
    """The depth of each candidate that maximises expected (weighted) tokens per second.

    `num_rows`: the step's one-token rows without proposals; `num_prefill_tokens`: its prefill
    tokens; `base_tokens`: the weighted tokens the step yields without proposals;
    `max_total`: the most proposed tokens the step's budget allows; `drafts`: a draft model
    proposes (draft round j costs a draft step of the sequences proposing more than j).
    """
    depths = [0] * len(candidates)
    # Max-heap of the next position of each candidate: (-gain, candidate, position).
    heap = [(-c.weight * c.acceptance, i, 1) for i, c in enumerate(candidates)
            if c.max_depth > 0 and c.acceptance > 0.0]
    heapq.heapify(heap)
    round_rows: list[int] = []  # draft round j: sequences proposing more than j tokens
    tokens, draft_s, total = base_tokens, 0.0, 0
    best_rate = base_tokens / costs.step_s(num_rows, num_prefill_tokens)
    chosen: list[int] = []  # candidate index of each position added, in order
    best_len = 0
    while heap and total < max_total:
        gain, i, position = heapq.heappop(heap)
        tokens -= gain
        total += 1
        chosen.append(i)
        if drafts:
            if len(round_rows) < position:
                round_rows.append(0)
            rows = round_rows[position - 1]
            draft_s += costs.draft_step_s(rows + 1) - costs.draft_step_s(rows)
            round_rows[position - 1] = rows + 1
        rate = tokens / (costs.step_s(num_rows + total, num_prefill_tokens) + draft_s)
        if rate > best_rate:
            best_rate, best_len = rate, len(chosen)
        candidate = candidates[i]
        if position < candidate.max_depth:
            heapq.heappush(heap, (gain * candidate.acceptance, i, position + 1))
    for i in chosen[:best_len]:
        depths[i] += 1
    return depths
