"""ModelRunner: one `SchedulerOutput` in, one `ModelRunnerOutput` out.

It owns the attention backend (chosen at start-up by `attention_backend`, see `attention.py`),
which owns the KV cache. Per step it builds the flat batch, has the backend `build` the step's
attention once, runs the model with the backend as its attention callable, computes logits only
for the rows that sample (the last token of each sequence whose chunk ends its known tokens),
and samples. Its only per-request state is the grammar matchers of structured outputs
(`structured.py`), dropped for `finished_request_ids` and rebuilt from the token history when a
sequence comes back, so preemption and abort need nothing else from it (a draft model's record
of what it has written, with speculative decoding, is dropped and rebuilt the same way:
`runner/speculative/`). The grammar masks are filled after the forward is queued: on CUDA the
host fills them while the device computes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from batchinfer.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from batchinfer.models.linear_kernels import BUCKET_NAMES
from batchinfer.models.spec import ModelSpec
from batchinfer.runner.attention import select_attention_backend
from batchinfer.runner.input_batch import StepInputs, prepare_inputs
from batchinfer.runner.kv_cache import KVCacheSpec
from batchinfer.runner.native_decode import (
    NativeDecoder,
    choose_buckets,
    release_native_forms,
)
from batchinfer.runner.sampler import Sampler
from batchinfer.runner.structured import StructuredOutputs

logger = logging.getLogger(__name__)

# (layer_idx, q [tokens, heads, d], k [tokens, kv_heads, d], v) -> [tokens, heads, d]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CausalLM(Protocol):
    """What the runner needs of a model (`LlamaForCausalLM` satisfies it)."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class StepOverride(Protocol):
    """Takes over a runner's steps (speculative decoding: `runner/speculative/`)."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
                    ) -> None: ...


class ModelRunner:
    """Runs scheduled steps of `model` over a paged KV cache of `num_blocks` blocks.

    `kv_dtype` is the cache element type (see `kv_cache.resolve_kv_dtype`); `eos_token_ids` are
    masked while a sequence is short of `min_tokens`; `seed` seeds unseeded random sampling;
    `attention_backend` names the attention backend (`auto`, `sdpa`, `gather`, `cpu_sparse`;
    see `attention.py`); `calculate_kv_scales` calibrates an FP8 cache's scales on the first
    step; `num_swap_blocks` sizes the host swap space (`swap_blocks`); `native_decode` runs
    decode steps in one native call where it can and measures faster (`native_decode.py`;
    the choice cached under `cache_dir`); `structured_outputs` compiles grammars and masks the
    logits of constrained sequences (None: no request may be constrained).
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
        *,
        attention_backend: str = "auto",
        calculate_kv_scales: bool = False,
        num_swap_blocks: int = 0,
        native_decode: bool = False,
        cache_dir: Path | None = None,
        structured_outputs: StructuredOutputs | None = None,
    ) -> None:
        self.model = model
        self.structured_outputs = structured_outputs
        self.spec = spec
        self.block_size = block_size
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.attention = select_attention_backend(self.device, kv_dtype, attention_backend,
                                                  calculate_kv_scales)
        self.attention.allocate_kv_cache(spec, num_blocks, block_size)
        if isinstance(spec, ModelSpec):  # its layers' scale, windows and soft-capping
            self.attention.set_layers([spec.layer_attention(i) for i in range(spec.num_layers)])
        if num_swap_blocks:
            self.attention.allocate_swap_space(num_swap_blocks)
        self.sampler = Sampler(self.device, seed, eos_token_ids)
        # Whole decode steps in one native call where the model and cache allow it, at the
        # row buckets where that measured faster than the torch model.
        self.native_decode: NativeDecoder | None = None
        if native_decode:
            decoder, why = NativeDecoder.build(model, self.attention)
            if decoder is None:
                release_native_forms(model, (False,) * len(BUCKET_NAMES))
            else:  # frees the forms of the buckets it does not keep
                decoder.keep_buckets(choose_buckets(decoder, self._torch_logits, num_blocks,
                                                    cache_dir))
                why = "slower than the torch model at every row bucket"
                if any(decoder.buckets):
                    self.native_decode = decoder
                    moved = decoder.move_weights_to_huge_pages()
                    logger.info("native decode weights in huge pages: %.0f MiB", moved / 2**20)
            if self.native_decode is None:
                logger.info("native decode steps not used: %s", why)
            else:
                logger.info("native decode steps: %s", self.native_decode.describe())
        # Speculative decoding runs the steps when on (set by the worker).
        self.speculative: StepOverride | None = None

    @property
    def kv_cache(self) -> torch.Tensor:
        """The cache tensor, in the attention backend's own layout."""
        return self.attention.kv_cache

    def swap_blocks(
        self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
    ) -> None:
        """Copy (device, host) block pairs out to the swap space, then (host, device) pairs in;
        returns once the copies are done (the step after them reads the blocks)."""
        with torch.inference_mode():
            self.attention.swap_out(swap_out)
            self.attention.swap_in(swap_in)
        if self.speculative is not None:  # the draft model's cache
            self.speculative.swap_blocks(swap_out, swap_in)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; outputs are aligned with `scheduler_output.sequences`."""
        structured = self.structured_outputs
        if structured is not None:
            structured.forget(scheduler_output.finished_request_ids)
        if self.speculative is not None:
            return self.speculative.execute(scheduler_output)
        return self.sample_step(scheduler_output)

    def sample_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """A step without proposed tokens: one token for each sequence that samples."""
        sequences = scheduler_output.sequences
        sampled_token_ids: list[int | None] = [None] * len(sequences)
        structured = self.structured_outputs
        if not sequences:
            return ModelRunnerOutput(sampled_token_ids)
        with torch.inference_mode():
            inputs = prepare_inputs(sequences, self.block_size, self.device)
            sampled_seq_indices = inputs.sampled_seq_indices
            rows = [sequences[i] for i in sampled_seq_indices]
            # The grammar masks are filled on another thread while the forward runs.
            masking = structured.start_fill(rows) if structured is not None else None
            logits = self.compute_logits(inputs)
            mask = masking.result() if masking is not None else None
            if not sampled_seq_indices:
                return ModelRunnerOutput(sampled_token_ids)
            sampled = self.sampler(logits, rows, mask)
        for i, token_id in zip(sampled_seq_indices, sampled.token_ids, strict=True):
            sampled_token_ids[i] = token_id
        if sampled.logprobs is None:
            return ModelRunnerOutput(sampled_token_ids)
        logprobs: list[TokenLogprobs | None] = [None] * len(sequences)
        for i, entry in zip(sampled_seq_indices, sampled.logprobs, strict=True):
            logprobs[i] = entry
        return ModelRunnerOutput(sampled_token_ids, logprobs)

    def compute_logits(self, inputs: StepInputs, shared_rows: bool = False) -> torch.Tensor:
        """Forward one step (writing its K/V into the cache) and return the sampling rows'
        float32 logits `[num_sampled, vocab]` (row i: `inputs.sampled_seq_indices[i]`).
        Call under `torch.inference_mode()`. `shared_rows`: several sequences of the step may
        be positions of one sequence (speculative decoding's one-token rows; every backend
        writes a step's K/V before it attends, so each sees the ones before it)."""
        if self.native_decode is not None and self.native_decode.accepts(inputs):
            return self.native_decode.logits(inputs, shared_rows)[inputs.logits_indices]
        return self._torch_logits(inputs)

    def _torch_logits(self, inputs: StepInputs) -> torch.Tensor:
        """The sampling rows' logits of a step, by the torch model."""
        self.attention.build(inputs.attention)
        hidden = self.model(inputs.input_ids, inputs.positions, self.attention)
        if not inputs.sampled_seq_indices:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[inputs.logits_indices]).float()
