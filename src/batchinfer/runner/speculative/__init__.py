"""Speculative decoding in the runner: the draft model's proposals (`draft.py`), their
verification in the batch and the acceptance rule (`verify.py`), and the step costs that
`speculative_depth auto` weighs, measured at start-up (`costs.py`). The scheduler decides who
proposes how many tokens (`core/scheduling/speculation.py`); ngram proposals come down
with the step, a draft model's are made here."""

from __future__ import annotations

import torch

from batchinfer.core.outputs import ModelRunnerOutput, SchedulerOutput
from batchinfer.runner.model_runner import ModelRunner
from batchinfer.runner.speculative.draft import DraftModel
from batchinfer.runner.speculative.verify import Proposal, verify


class SpeculativeSteps:
    """Runs `runner`'s steps when speculative decoding is on (`ModelRunner.speculative`):
    steps without proposals as usual, the others with their proposals verified; `draft`: the
    draft model (None: every proposal comes with the step)."""

    def __init__(self, runner: ModelRunner, draft: DraftModel | None = None) -> None:
        self.runner = runner
        self.draft = draft

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        sequences = scheduler_output.sequences
        draft = self.draft
        if draft is not None:
            draft.forget(scheduler_output.finished_request_ids)
            draft.observe(sequences)
        if not any(seq.num_spec_tokens for seq in sequences):
            return self.runner.sample_step(scheduler_output)
        with torch.inference_mode():
            proposals: list[Proposal | None] = [
                Proposal(seq.spec_token_ids) if seq.spec_token_ids is not None else None
                for seq in sequences]
            if draft is not None:
                wanted = [seq.num_spec_tokens if seq.spec_token_ids is None else 0
                          for seq in sequences]
                drafted = draft.propose(sequences, wanted)
                proposals = [p if p is not None else d
                             for p, d in zip(proposals, drafted, strict=True)]
            output = verify(self.runner, scheduler_output, proposals)
        if draft is not None and output.accepted_token_ids is not None:
            for seq, accepted in zip(sequences, output.accepted_token_ids, strict=True):
                draft.accepted(seq.request_id, accepted)
        return output

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
                    ) -> None:
        if self.draft is not None:
            self.draft.swap_blocks(swap_out, swap_in)
