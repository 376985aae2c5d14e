"""Verification of proposed tokens inside the batch, and the acceptance rule.

A sequence that proposes k tokens runs as k + 1 one-token rows of the step: its last token and
each proposed token, at successive positions, over the sequence's paged KV (every backend writes
a step's K/V before any row attends, so row j sees rows 0..j-1: causal among them). Row j is
sampled as the sequence's j-th next output token (`sample_index + j`, its history extended by
the proposals before it), so the target's distribution at every row is the one plain decoding
would have there.

Acceptance, per sequence, in proposal order:
- a deterministic proposal (ngram; a draft model's greedy rows): its distribution q is one-hot,
  so the speculative-sampling test "accept d with probability min(1, p(d) / q(d)), else draw
  from max(0, p - q)" becomes "accept d with probability p(d), else draw from p without d".
  Drawing t from p at the row as plain decoding would (the same random number) and accepting
  while t == d realises exactly that, and the tokens are then those plain decoding draws:
  greedy outputs, and seeded ones, are the same with or without speculation;
- a draft model's random rows: the test itself, with q the draft's filtered distribution
  (`Proposal.probs`); its random numbers come from streams of their own (`ACCEPT_STREAM`,
  `RESIDUAL_STREAM`), so seeded requests still reproduce run to run.
The token after the accepted ones is the target's own draw at the first rejected row, or at
the row after the last proposal when all were accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from batchinfer.core.outputs import (
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    TokenLogprobs,
)
from batchinfer.runner.input_batch import StepInputs, prepare_inputs
from batchinfer.runner.sampler import Sampler, check_drawn, filtered_probs
from batchinfer.runner.structured import StructuredOutputs

# Random streams of seeded rows (`Sampler.uniforms`); stream 0 is the target's own draw.
DRAFT_STREAM = 1
ACCEPT_STREAM = 2
RESIDUAL_STREAM = 3


@dataclass(slots=True)
class Proposal:
    """A sequence's proposed tokens; `probs` `[k, vocab]`: the distribution each was drawn from
    (a draft model's random rows), None for a deterministic proposal."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Verifier(Protocol):
    """What verification needs of a model runner (`ModelRunner`)."""

    sampler: Sampler
    structured_outputs: StructuredOutputs | None
    block_size: int
    device: torch.device

    def compute_logits(self, inputs: StepInputs, shared_rows: bool = False) -> torch.Tensor: ...


def rows_of(seq: ScheduledSequence, proposed: Sequence[int]) -> list[ScheduledSequence]:
    """`seq` (a one-token decode) with its `proposed` tokens as one-token rows, each sampling as
    the next output token after the ones before it."""
    if seq.num_tokens != 1 or not seq.sample:
        raise RuntimeError(f"request {seq.request_id}: proposals need a one-token decode")
    tokens = [seq.token_ids[0], *proposed]
    history = seq.all_token_ids
    return [
        ScheduledSequence(
            request_id=seq.request_id, token_ids=[token],
            num_computed_tokens=seq.num_computed_tokens + j, block_table=seq.block_table,
            sample=True, sampling_params=seq.sampling_params,
            num_prompt_tokens=seq.num_prompt_tokens,
            all_token_ids=history + tokens[1 : j + 1] if history is not None else None,
            sample_index=seq.sample_index + j, num_dropped_blocks=seq.num_dropped_blocks,
        )
        for j, token in enumerate(tokens)
    ]


def verify(runner: Verifier, scheduler_output: SchedulerOutput,
           proposals: Sequence[Proposal | None]) -> ModelRunnerOutput:
    """Run the step with each sequence's proposal (`proposals[i]` for sequence i, None: none)
    as extra rows; accept by the rule of the module docstring. Call under inference mode."""
    sequences = scheduler_output.sequences
    rows: list[ScheduledSequence] = []
    first_rows: list[int] = []
    for seq, proposal in zip(sequences, proposals, strict=True):
        first_rows.append(len(rows))
        rows.extend(rows_of(seq, proposal.token_ids) if proposal else [seq])
    inputs = prepare_inputs(rows, runner.block_size, runner.device)
    sampled = inputs.sampled_seq_indices
    logits_row = {row: r for r, row in enumerate(sampled)}
    views = [rows[row] for row in sampled]
    structured = runner.structured_outputs
    # The grammar masks are filled on another thread while the forward runs.
    masking = structured.start_fill(views) if structured is not None else None
    logits = runner.compute_logits(inputs, shared_rows=True)
    mask = masking.result() if masking is not None else None
    sampler = runner.sampler
    raw_logprobs = sampler.process(logits, views, mask)
    drawn, drawn_list, _ = sampler.pick(logits, views)
    chosen = drawn.clone()  # per logits row: the token it emits, if it is reached
    emitted: list[tuple[list[int], list[int]]] = []  # per sequence: (tokens, logits rows)
    for i, (seq, proposal) in enumerate(zip(sequences, proposals, strict=True)):
        if not seq.sample:
            emitted.append(([], []))
            continue
        if proposal is None:
            row = logits_row[first_rows[i]]
            emitted.append(([drawn_list[row]], [row]))
            continue
        verified = [logits_row[first_rows[i] + j] for j in range(len(proposal.token_ids) + 1)]
        num_accepted, last = accept(sampler, logits, views, verified, proposal, drawn_list)
        chosen[verified[num_accepted]] = last
        emitted.append(([*proposal.token_ids[:num_accepted], last],
                        verified[: num_accepted + 1]))
    logprobs = sampler.logprobs(raw_logprobs, chosen, views)
    return _output(emitted, logprobs)


def accept(sampler: Sampler, logits: torch.Tensor, views: list[ScheduledSequence],
           rows: list[int], proposal: Proposal, drawn: list[int]) -> tuple[int, int]:
    """How many of `proposal`'s tokens the target accepts, and the token after them.

    `rows`: the logits rows of the sequence (one per proposed token, and one more); `drawn`:
    the target's draw at every row; `logits`: processed (bias, penalties, min_tokens)."""
    proposed = proposal.token_ids
    k = len(proposed)
    params = views[rows[0]].sampling_params
    if proposal.probs is None or params.greedy:
        num_accepted = 0
        while num_accepted < k and drawn[rows[num_accepted]] == proposed[num_accepted]:
            num_accepted += 1
        return num_accepted, drawn[rows[num_accepted]]
    device = logits.device
    target = filtered_probs(logits[torch.tensor(rows[:k], device=device)], [params] * k)
    draft = proposal.probs.to(device)
    columns = torch.tensor(proposed, device=device)[:, None]
    p, q = target.gather(1, columns)[:, 0], draft.gather(1, columns)[:, 0]
    uniforms = sampler.uniforms([views[r] for r in rows[:k]], device, ACCEPT_STREAM)[:, 0]
    # Accepted with probability min(1, p / q): u < p / q, written without dividing.
    passed = (uniforms * q < p).tolist()
    num_accepted = passed.index(False) if False in passed else k
    if num_accepted == k:
        return k, drawn[rows[k]]
    residual = (target[num_accepted] - draft[num_accepted]).clamp_(min=0.0)
    if not float(residual.sum()) > 0.0:  # q equals p to rounding: p itself is the residual
        residual = target[num_accepted].clone()
    view = views[rows[num_accepted]]
    token = sampler.draw(residual[None], [view], RESIDUAL_STREAM)
    return num_accepted, check_drawn(token, residual.shape[0], [view])[0]


def _output(emitted: list[tuple[list[int], list[int]]],
            logprobs: list[TokenLogprobs | None] | None) -> ModelRunnerOutput:
    """The runner output of the sequences' emitted tokens (the last one is each's sampled
    token, the others its accepted proposals) and their rows' logprobs."""
    sampled: list[int | None] = []
    accepted: list[list[int]] = []
    sampled_logprobs: list[TokenLogprobs | None] = []
    accepted_logprobs: list[list[TokenLogprobs]] = []
    for tokens, rows in emitted:
        sampled.append(tokens[-1] if tokens else None)
        accepted.append(tokens[:-1])
        entries = [logprobs[r] for r in rows] if logprobs is not None else []
        sampled_logprobs.append(entries[-1] if entries else None)
        accepted_logprobs.append([e for e in entries[:-1] if e is not None])
    return ModelRunnerOutput(sampled, sampled_logprobs if logprobs is not None else None,
                             accepted, accepted_logprobs)
