"""ModelRunner: one `SchedulerOutput` in, one `ModelRunnerOutput` out.

It owns the KV cache tensor, builds the step's flat batch and `PagedAttention`, runs the model,
computes logits only for the rows that sample (the last token of each sequence whose chunk ends
its known tokens), and samples. It keeps no per-request state, so preemption and abort need
nothing from it; `finished_request_ids` is accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from batchinfer.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from batchinfer.runner.attention import PagedAttention, max_decode_group_tokens
from batchinfer.runner.input_batch import prepare_inputs
from batchinfer.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from batchinfer.runner.sampler import Sampler

# (layer_idx, q [tokens, heads, d], k [tokens, kv_heads, d], v) -> [tokens, heads, d]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CausalLM(Protocol):
    """What the runner needs of a model (`LlamaForCausalLM` satisfies it)."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    """Runs scheduled steps of `model` over a paged KV cache of `num_blocks` blocks.

    `kv_dtype` is the cache element type (see `kv_cache.resolve_kv_dtype`); `eos_token_ids` are
    masked while a sequence is short of `min_tokens`; `seed` seeds unseeded random sampling.
    """

    def __init__(
        self,
        model: CausalLM,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        kv_dtype: torch.dtype,
        eos_token_ids: Sequence[int],
        seed: int,
    ) -> None:
        self.model = model
        self.spec = spec
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_cache = allocate_kv_cache(spec, num_blocks, block_size, kv_dtype, self.device)
        self.sampler = Sampler(self.device, seed, eos_token_ids)
        self.max_decode_group_tokens = max_decode_group_tokens(
            spec.num_kv_heads, spec.head_dim, kv_dtype, self.device
        )
        self._workspace: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[2]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; outputs are aligned with `scheduler_output.sequences`."""
        sequences = scheduler_output.sequences
        sampled_token_ids: list[int | None] = [None] * len(sequences)
        if not sequences:
            return ModelRunnerOutput(sampled_token_ids)
        with torch.inference_mode():
            logits, sampled_seq_indices = self.compute_logits(scheduler_output)
            if not sampled_seq_indices:
                return ModelRunnerOutput(sampled_token_ids)
            sampled = self.sampler(logits, [sequences[i] for i in sampled_seq_indices])
        for i, token_id in zip(sampled_seq_indices, sampled.token_ids, strict=True):
            sampled_token_ids[i] = token_id
        if sampled.logprobs is None:
            return ModelRunnerOutput(sampled_token_ids)
        logprobs: list[TokenLogprobs | None] = [None] * len(sequences)
        for i, entry in zip(sampled_seq_indices, sampled.logprobs, strict=True):
            logprobs[i] = entry
        return ModelRunnerOutput(sampled_token_ids, logprobs)

    def compute_logits(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Forward one step (writing its K/V into the cache) and return the sampling rows' logits.

        Returns float32 logits `[num_sampled, vocab]` and, for each row, the index of its
        sequence in `scheduler_output.sequences`. Call under `torch.inference_mode()`.
        """
        inputs = prepare_inputs(
            scheduler_output.sequences,
            self.block_size,
            self.device,
            max_decode_group_tokens=self.max_decode_group_tokens,
        )
        attention = PagedAttention(self.kv_cache, inputs.attention, self._workspace)
        self._workspace = attention.workspace
        hidden = self.model(inputs.input_ids, inputs.positions, attention)
        if not inputs.sampled_seq_indices:
            return hidden.new_empty((0, 0), dtype=torch.float32), []
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        return logits, inputs.sampled_seq_indices
