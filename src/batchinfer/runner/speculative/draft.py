"""The draft model (`speculative_method draft`): proposes tokens one row per sequence and step.

It is a second `ModelRunner` over its own model (`self-q4`: the served checkpoint with 4-bit
weights; or a smaller model with the same vocabulary) and its own paged KV cache of as many
blocks as the target's, addressed by the same block tables: a sequence's block holds its target
K/V in one cache and its draft K/V in the other. So the prefix cache, swaps (`swap_blocks`
copies both) and rollbacks follow the target's bookkeeping with nothing of their own.

The draft computes K/V lazily. Per sequence it keeps the tokens the runner has seen since it
first saw the sequence (positions from `start` on; the scheduler sends each token once) and
how far its own cache is written (`num_drafted`). Every step cuts both back to the target's
`num_computed_tokens` (a rejected proposal's position is rewritten), so nothing it wrote for a
rejected token is read; when a sequence proposes, the draft first writes what it has not yet
(the prompt, on the first proposal; the last accepted proposal and the new token after it),
then proposes one token per row, k rows deep. A sequence that does not propose costs the draft
nothing. Blocks taken from the prefix cache are assumed to hold draft K/V, as they do when the
sequence that computed them proposed; where not, proposals are worse (never outputs: the
target decides every token). Where the blocks before a sliding window were dropped, the draft
writes nothing before the first block kept: the first positions it catches up there read a
shortened context (again worse proposals at most).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.core.outputs import ScheduledSequence
from batchinfer.runner.input_batch import StepInputs, prepare_inputs
from batchinfer.runner.model_runner import ModelRunner
from batchinfer.runner.speculative.verify import DRAFT_STREAM, Proposal

# Positions the draft lacks that its first proposing step writes as rows of its own (more are
# written first, as prefill chunks).
ROW_CATCH_UP_TOKENS = 8


@dataclass(slots=True)
class _Seen:
    """A sequence's tokens from position `start` on, and the positions the draft's cache holds
    (every one before `num_drafted`)."""

    start: int
    tokens: list[int]
    num_drafted: int


class DraftModel:
    """Proposals of a draft model's runner (see the module docstring); `max_chunk_tokens`:
    the most tokens of one sequence the draft writes in one forward while catching up."""

    def __init__(self, runner: ModelRunner, max_chunk_tokens: int) -> None:
        self.runner = runner
        self.max_chunk_tokens = max_chunk_tokens
        self._seen: dict[str, _Seen] = {}

    def forget(self, request_ids: list[str]) -> None:
        """Sequences that left (finished, aborted, preempted)."""
        for request_id in request_ids:
            self._seen.pop(request_id, None)

    def observe(self, sequences: list[ScheduledSequence]) -> None:
        """Record a step's tokens; everything past each sequence's computed tokens is cut."""
        for seq in sequences:
            computed = seq.num_computed_tokens
            seen = self._seen.get(seq.request_id)
            if seen is None or not seen.start <= computed <= seen.start + len(seen.tokens):
                seen = self._seen[seq.request_id] = _Seen(computed, [], computed)
            del seen.tokens[computed - seen.start :]
            seen.num_drafted = min(seen.num_drafted, computed)
            seen.tokens.extend(seq.token_ids)

    def accepted(self, request_id: str, token_ids: list[int]) -> None:
        """The verified step accepted these proposals (computed by the target, in order)."""
        seen = self._seen.get(request_id)
        if seen is not None:
            seen.tokens.extend(token_ids)

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
                    ) -> None:
        self.runner.swap_blocks(swap_out, swap_in)

    def propose(self, sequences: list[ScheduledSequence], wanted: list[int]
                ) -> list[Proposal | None]:
        """`wanted[i]` tokens proposed for sequence i (0: none). Call after `observe`, under
        inference mode."""
        active = [i for i, k in enumerate(wanted) if k > 0]
        tokens: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        self._catch_up([sequences[i] for i in active], ROW_CATCH_UP_TOKENS)
        for depth in range(max((wanted[i] for i in active), default=0)):
            rows: list[ScheduledSequence] = []
            owners: list[int | None] = []
            for i in active:
                if wanted[i] <= depth:
                    continue
                if depth == 0:  # the few positions the draft lacks, as rows before its own
                    missing = self._missing_rows(sequences[i])
                    rows += missing
                    owners += [None] * len(missing)
                rows.append(self._row(sequences[i], tokens[i], depth))
                owners.append(i)
            self._draw(rows, owners, tokens, probs)
        proposals: list[Proposal | None] = [None] * len(sequences)
        for i in active:
            seq = sequences[i]
            seen = self._seen[seq.request_id]
            # Written: the sequence's tokens, then each proposal but the last.
            seen.num_drafted = seq.num_computed_tokens + seq.num_tokens + wanted[i] - 1
            stacked = torch.stack(probs[i]) if probs[i] else None
            proposals[i] = Proposal(tokens[i], stacked)
        return proposals

    def _catch_up(self, sequences: list[ScheduledSequence], keep: int) -> None:
        """Write the draft K/V each sequence lacks before its last token, in chunks of at most
        `max_chunk_tokens`, but for the last `keep` positions (the first proposing rows write
        those, and the last token)."""
        while True:
            chunks = []
            for seq in sequences:
                seen = self._seen[seq.request_id]
                end = seq.num_computed_tokens + seq.num_tokens - 1
                # Blocks before the sliding window are gone: nothing before them is written.
                seen.num_drafted = max(seen.num_drafted,
                                       seq.num_dropped_blocks * self.runner.block_size)
                if seen.num_drafted < end - keep:
                    take = min(end - keep - seen.num_drafted, self.max_chunk_tokens)
                    first = seen.num_drafted - seen.start
                    chunks.append(ScheduledSequence(
                        seq.request_id, seen.tokens[first : first + take], seen.num_drafted,
                        seq.block_table, False, seq.sampling_params, seq.num_prompt_tokens,
                        num_dropped_blocks=seq.num_dropped_blocks))
                    seen.num_drafted += take
            if not chunks:
                return
            self.runner.compute_logits(self._inputs(chunks))

    def _missing_rows(self, seq: ScheduledSequence) -> list[ScheduledSequence]:
        """One-token rows (not sampling) of the positions before `seq`'s last token the draft
        has not written (at most `ROW_CATCH_UP_TOKENS` once `_catch_up` ran)."""
        seen = self._seen[seq.request_id]
        end = seq.num_computed_tokens + seq.num_tokens - 1
        rows = [ScheduledSequence(seq.request_id, [seen.tokens[position - seen.start]],
                                  position, seq.block_table, False, seq.sampling_params,
                                  seq.num_prompt_tokens,
                                  num_dropped_blocks=seq.num_dropped_blocks)
                for position in range(seen.num_drafted, end)]
        seen.num_drafted = end
        return rows

    def _inputs(self, rows: list[ScheduledSequence]) -> StepInputs:
        """The draft runner's inputs of a step of `rows`."""
        return prepare_inputs(rows, self.runner.block_size, self.runner.device)

    @staticmethod
    def _row(seq: ScheduledSequence, proposed: list[int], depth: int) -> ScheduledSequence:
        """The draft's row proposing token `depth` of `seq`: it reads the token before."""
        last = seq.token_ids[-1] if depth == 0 else proposed[depth - 1]
        history = seq.all_token_ids
        return ScheduledSequence(
            request_id=seq.request_id, token_ids=[last],
            num_computed_tokens=seq.num_computed_tokens + seq.num_tokens - 1 + depth,
            block_table=seq.block_table, sample=True, sampling_params=seq.sampling_params,
            num_prompt_tokens=seq.num_prompt_tokens,
            all_token_ids=history + proposed[:depth] if history is not None else None,
            sample_index=seq.sample_index + depth, num_dropped_blocks=seq.num_dropped_blocks)

    def _draw(self, rows: list[ScheduledSequence], owners: list[int | None],
              tokens: dict[int, list[int]], probs: dict[int, list[torch.Tensor]]) -> None:
        """One draft step over `rows` (several may be positions of one sequence): each
        sampling row's token appended to its owner's `tokens`, and for a random row the
        distribution it was drawn from to its owner's `probs`."""
        inputs = self._inputs(rows)
        sampled = inputs.sampled_seq_indices
        logits = self.runner.compute_logits(inputs, shared_rows=True)
        views = [rows[i] for i in sampled]
        sampler = self.runner.sampler
        sampler.process(logits, views)
        _, drawn, kept = sampler.pick(logits, views, DRAFT_STREAM, keep_probs=True)
        random = 0
        for view_index, row_index in enumerate(sampled):
            owner = owners[row_index]
            assert owner is not None  # only a proposing row samples
            tokens[owner].append(drawn[view_index])
            if not views[view_index].sampling_params.greedy:
                assert kept is not None  # a random row keeps its distribution
                probs[owner].append(kept[random])
                random += 1
