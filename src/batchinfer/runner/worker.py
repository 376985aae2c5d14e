"""`Worker.from_config`: from an `EngineConfig` to a runner ready to step.

It does, once, everything that needs torch and the hardware: picks the device, dtype and CPU
threads, loads and prepares the model (packed weights on CPU float32), sizes the KV cache and
builds the `ModelRunner`. The engine above it sees only plain facts (`num_blocks`,
`max_model_len`, the tokenizer, the stop tokens), so `engine/` never imports torch.

KV budget. CPU: `kv_cache_memory`, as given. CUDA: `gpu_memory_utilization` of the device minus
what is in use once the weights are loaded minus the activations' peak, measured by a profiled
forward of a dummy step at `max_num_batched_tokens` (one long prefill plus one-token sequences
up to `max_num_seqs`, so both the longest attention and the most logit rows are counted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from batchinfer.core.block_manager import cdiv
from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import ScheduledSequence, SchedulerOutput
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.models.hardware import resolve_device, resolve_dtype
from batchinfer.models.llama import ModelSpec
from batchinfer.models.loader import LoadedModel, load_model
from batchinfer.models.prepack import prepack_supported
from batchinfer.runner.kv_cache import bytes_per_block, num_kv_blocks, resolve_kv_dtype
from batchinfer.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Worker:
    """A loaded model, its runner and the facts the engine needs about them."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    loaded: LoadedModel
    runner: ModelRunner
    num_blocks: int
    max_model_len: int
    # Peak bytes of a profiled step at `max_num_batched_tokens`; None where not profiled (CPU).
    activation_bytes: int | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> Worker:
        """Load, prepare and size; `ValueError` names the knob when the cache cannot fit."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        loaded = load_model(config.model, dtype, device)
        if config.prepack_weights and prepack_supported(device, dtype):
            loaded.model.prepack_weights()
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
        activation_bytes = None
        if device.type == "cuda":
            activation_bytes = profile_step_bytes(config, loaded, device, kv_dtype)
        budget = kv_cache_budget(config, device, activation_bytes or 0)
        num_blocks = num_kv_blocks(loaded.spec, config.block_size, kv_dtype, budget)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes hold no KV block of {config.block_size} tokens"
            )
        max_model_len = resolve_max_model_len(
            config.max_model_len, loaded.spec, num_blocks * config.block_size
        )
        runner = _make_runner(config, loaded, device, kv_dtype, num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s) on %s; "
            "max_model_len %d",
            num_blocks, config.block_size, num_blocks * config.block_size,
            num_blocks * bytes_per_block(loaded.spec, config.block_size, kv_dtype) / 2**20,
            str(kv_dtype).removeprefix("torch."), device, max_model_len,
        )
        return cls(config, device, dtype, kv_dtype, loaded, runner, num_blocks, max_model_len,
                   activation_bytes)

    # The facts the engine reads (see `engine.llm_engine.ModelWorker`).
    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.loaded.spec.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.loaded.eos_token_ids

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def spec(self) -> ModelSpec:
        return self.loaded.spec


def _make_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    device: torch.device,
    kv_dtype: torch.dtype,
    num_blocks: int,
) -> ModelRunner:
    return ModelRunner(
        loaded.model,
        loaded.spec,
        num_blocks=num_blocks,
        block_size=config.block_size,
        device=device,
        kv_dtype=kv_dtype,
        eos_token_ids=sorted(loaded.eos_token_ids),
        seed=config.seed,
    )


def kv_cache_budget(config: EngineConfig, device: torch.device, activation_bytes: int) -> int:
    """Bytes the KV cache may take, measured after the weights are loaded (see the module
    docstring); never negative."""
    if device.type != "cuda":
        return config.kv_cache_memory
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    in_use_bytes = total_bytes - free_bytes
    share_bytes = int(config.gpu_memory_utilization * total_bytes)
    return max(0, share_bytes - in_use_bytes - activation_bytes)


def profile_step_bytes(
    config: EngineConfig, loaded: LoadedModel, device: torch.device, kv_dtype: torch.dtype
) -> int:
    """Peak memory one step at `max_num_batched_tokens` allocates above what is resident
    (CUDA): runs a dummy step on a runner with just enough KV blocks for it."""
    step = dummy_step(config.max_num_batched_tokens, config.max_num_seqs, config.block_size)
    num_blocks = sum(len(s.block_table) for s in step.sequences)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    runner = _make_runner(config, loaded, device, kv_dtype, num_blocks)
    torch.cuda.reset_peak_memory_stats(device)
    resident_bytes = torch.cuda.memory_allocated(device)
    runner.execute(step)
    torch.cuda.synchronize(device)
    peak_bytes = torch.cuda.max_memory_allocated(device) - resident_bytes
    del runner
    torch.cuda.empty_cache()
    logger.info("profiled step of %d tokens: %.1f MiB of activations",
                config.max_num_batched_tokens, peak_bytes / 2**20)
    return peak_bytes


def dummy_step(num_tokens: int, max_num_seqs: int, block_size: int) -> SchedulerOutput:
    """A step of `num_tokens` tokens: one long first prefill chunk plus one-token sequences up
    to `max_num_seqs`, every one sampling (greedy), each in its own fresh blocks."""
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    lengths = [num_tokens - (num_seqs - 1)] + [1] * (num_seqs - 1)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    sequences, next_block = [], 0
    for i, length in enumerate(lengths):
        num_blocks = cdiv(length + 1, block_size)
        table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        sequences.append(ScheduledSequence(
            request_id=f"profile-{i}", token_ids=[0] * length, num_computed_tokens=0,
            block_table=table, sample=True, sampling_params=params, num_prompt_tokens=length,
        ))
    return SchedulerOutput(sequences=sequences)


def resolve_max_model_len(wanted: int | None, spec: ModelSpec, kv_capacity_tokens: int) -> int:
    """`max_model_len`: the model's limit capped by the cache, or the value asked for if both
    allow it (`ValueError` naming the knob otherwise)."""
    model_max = spec.max_position_embeddings
    if spec.sliding_window is not None:
        # Attention over a sliding window is not implemented; within it, full attention is
        # exact, so cap the length there rather than compute something else.
        model_max = min(model_max, spec.sliding_window)
    if wanted is None:
        return min(model_max, kv_capacity_tokens)
    if wanted > model_max:
        raise ValueError(f"max_model_len {wanted} exceeds the model's maximum {model_max}")
    if wanted > kv_capacity_tokens:
        raise ValueError(
            f"max_model_len {wanted} needs more KV cache than kv_cache_memory holds "
            f"({kv_capacity_tokens} tokens); raise kv_cache_memory or lower max_model_len"
        )
    return wanted
