"""`Worker.from_config`: from an `EngineConfig` to a runner ready to step.

It does, once, everything that needs torch and the hardware: picks the device, dtype and CPU
threads, loads and prepares the model (packed weights on CPU float32), sizes the KV cache and
builds the `ModelRunner`. The engine above it sees only plain facts (`num_blocks`,
`max_model_len`, the tokenizer, the stop tokens), so `engine/` never imports torch.

KV budget. CPU: `kv_cache_memory`, as given (a profiled step would cost seconds of start-up for a
figure the budget does not depend on). CUDA: `gpu_memory_utilization` of the device minus what
is in use once the weights are loaded minus the peak of a profiled dummy step at
`max_num_batched_tokens` (`dummy_step`: the most expensive step the scheduler can build, as far
as memory goes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchinfer import native
from batchinfer.core.block_manager import cdiv
from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import ScheduledSequence, SchedulerOutput
from batchinfer.core.paths import default_cache_dir
from batchinfer.core.preemption import PreemptionCosts
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.core.scheduling.spec_depth import StepCosts
from batchinfer.core.scheduling.window import KVWindow
from batchinfer.models.gguf import WeightFormat
from batchinfer.models.hardware import resolve_device, resolve_dtype
from batchinfer.models.linear_kernels import (
    KERNELS_BY_QUANTIZATION,
    KernelPlan,
    choose_weight_form,
    set_int8_inputs,
)
from batchinfer.models.loader import LoadedModel, load_checkpoint, locate_checkpoint
from batchinfer.models.spec import ModelSpec
from batchinfer.native.memory import move_to_huge_pages
from batchinfer.runner.kv_cache import bytes_per_block, resolve_kv_dtype
from batchinfer.runner.model_runner import ModelRunner
from batchinfer.runner.speculative.setup import (
    enable_speculation,
    load_draft,
    runner_identity,
)
from batchinfer.runner.structured import StructuredOutputs
from batchinfer.runner.timing import timed_runs

logger = logging.getLogger(__name__)


def _resolve_dtype(config: EngineConfig, device: torch.device, stored: WeightFormat
                   ) -> torch.dtype:
    """`dtype`, with `auto` resolved (`resolve_dtype`), but float32 on a CPU with fast
    bfloat16 where the weights are quantized (a `quantization` form, or `auto` on a checkpoint
    `stored` quantized) and the native kernels are built: their products and native decode
    steps take float32 activations, and bfloat16 ones would leave the steps to the torch model
    (docs/architecture.md, "Weight form chosen by measurement")."""
    dtype = resolve_dtype(config.dtype, device)
    form = stored.form if config.quantization == "auto" else config.quantization
    if (config.dtype != "auto" or device.type != "cpu" or dtype == torch.float32
            or form == "none" or native.library() is None):
        return dtype
    logger.info("dtype auto -> float32, not bfloat16: %s weights run on the native CPU "
                "kernels, which take float32 activations", form)
    return torch.float32


def _resolve_quantization(config: EngineConfig, loaded: LoadedModel, device: torch.device,
                          dtype: torch.dtype) -> str:
    """`quantization`, with `auto` resolved: the form a forced `linear_kernels` runs, else the
    checkpoint's own where it measured faster than float32 here (`choose_weight_form`)."""
    if config.quantization != "auto":
        return config.quantization
    if config.linear_kernels != "auto":
        return next(form for form, names in KERNELS_BY_QUANTIZATION.items()
                    if config.linear_kernels in names)
    form = choose_weight_form(loaded.model, loaded.stored.form, loaded.stored.describe(),
                              device, dtype, default_cache_dir(), config.prepack_weights,
                              heads=("lm_head",))
    logger.info("quantization auto -> %s: %s", form.form, form.reason)
    return form.form


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
    # Host blocks of the swap space (0: preemption_mode recompute), and what preempting costs
    # here (measured at start-up for preemption_mode auto).
    num_swap_blocks: int = 0
    preemption_costs: PreemptionCosts | None = None
    # The linear kernels chosen per weight shape and row bucket (measured, cached or forced).
    linear_kernels: KernelPlan | None = None
    # Native kernels whose many-row products take 8-bit inputs (`prefill_activations int8`).
    int8_input_linears: int = 0
    # The instruction-set level of the native CPU kernels in use (`native.isa_level()`); None
    # where they are not (no compiler, BATCHINFER_NATIVE=0, CUDA).
    cpu_isa: str | None = None
    # The weight form that runs (`quantization`, with `auto` resolved).
    quantization: str = "none"
    # Step costs measured for speculative_depth auto (None: not measured).
    step_costs: StepCosts | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> Worker:
        """Load, prepare and size; `ValueError` names the knob when the cache cannot fit."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        checkpoint = locate_checkpoint(config.model, revision=config.revision,
                                       gguf_file=config.gguf_file)
        dtype = _resolve_dtype(config, device, checkpoint.stored)
        loaded = load_checkpoint(checkpoint, dtype, device)
        quantization = _resolve_quantization(config, loaded, device, dtype)
        if device.type == "cpu" and quantization == "none":
            # Before any kernel form keeps a pointer into the weights. Quantized forms are
            # moved once made (NativeDecoder.move_weights_to_huge_pages): the float weights
            # they replace are freed then, which one mapping holding them all would prevent.
            moved = move_to_huge_pages(loaded.model)
            logger.info("weights in huge pages: %.0f MiB", moved / 2**20)
        kernels = loaded.model.choose_linear_kernels(
            quantization, config.linear_kernels, device, dtype, default_cache_dir(),
            config.prepack_weights, config.native_decode)
        cpu_isa = native.isa_level() if device.type == "cpu" else None
        logger.info("linear kernels (%s; weights %s; native ISA level %s): %s", kernels.source,
                    quantization, cpu_isa or "none", kernels.describe())
        int8_linears = 0
        if config.prefill_activations == "int8":
            int8_linears = set_int8_inputs(loaded.model)
            logger.info("prefill activations int8: %d native linears (products of 8+ rows; "
                        "0: no 8-bit products at this ISA level, or no native kernel chosen)", int8_linears)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
        draft, draft_kernels = (load_draft(config, loaded, quantization, device, dtype)
                                if config.speculative_method == "draft" else (None, None))
        activation_bytes = None
        if device.type == "cuda":
            activation_bytes = profile_step_bytes(config, loaded, device, kv_dtype)
        budget = kv_cache_budget(config, device, activation_bytes or 0)
        block_bytes = bytes_per_block(loaded.spec, config.block_size, kv_dtype)
        # A draft model keeps its own cache of as many blocks (the same block tables).
        draft_bytes = bytes_per_block(draft.spec, config.block_size, kv_dtype) if draft else 0
        num_blocks = budget // (block_bytes + draft_bytes)
        knob = "gpu_memory_utilization" if device.type == "cuda" else "kv_cache_memory"
        if num_blocks < 1:
            raise ValueError(
                f"{knob}: {budget} bytes left for the KV cache hold no block of "
                f"{config.block_size} tokens (activations of a step at max_num_batched_tokens: "
                f"{activation_bytes} bytes); raise {knob} or lower max_num_batched_tokens"
            )
        window = KVWindow(loaded.spec.kv_window, config.block_size,
                          config.max_num_batched_tokens)
        max_model_len = resolve_max_model_len(
            config.max_model_len, loaded.spec, kv_capacity_tokens(window, num_blocks), knob
        )
        loaded.model.fit_context(max_model_len)  # LongRoPE's factors depend on it
        num_swap_blocks = swap_space_blocks(config, block_bytes + draft_bytes)
        runner = _make_runner(config, loaded, device, kv_dtype, num_blocks, num_swap_blocks)
        step_costs = None
        if config.speculative_method != "none":
            draft_runner = None
            if draft is not None:
                draft.model.fit_context(max_model_len)
                draft_runner = _make_runner(config, draft, device, kv_dtype, num_blocks,
                                            num_swap_blocks)
            identity = {"target": runner_identity(runner, loaded.spec, kernels),
                        "draft": runner_identity(draft_runner, draft.spec, draft_kernels)
                        if draft_runner is not None and draft is not None else None}
            step_costs = enable_speculation(config, runner, draft_runner, max_model_len,
                                            identity)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s) on %s; "
            "max_model_len %d",
            num_blocks, config.block_size, num_blocks * config.block_size,
            num_blocks * (block_bytes + draft_bytes) / 2**20,
            str(kv_dtype).removeprefix("torch.") + (" + the draft model's" if draft else ""),
            device,
            max_model_len,
        )
        costs = None
        if num_swap_blocks:
            logger.info("swap space: %d blocks (%.1f MiB of host memory); preemption_mode %s",
                        num_swap_blocks, num_swap_blocks * (block_bytes + draft_bytes) / 2**20,
                        config.preemption_mode)
        if config.preemption_mode == "auto":
            costs = measure_preemption_costs(runner, config, num_blocks, num_swap_blocks,
                                             max_model_len, loaded.spec.vocab_size)
            logger.info("preemption costs measured: %s", costs.describe())
        return cls(config, device, dtype, kv_dtype, loaded, runner, num_blocks, max_model_len,
                   activation_bytes, num_swap_blocks, costs, kernels, int8_linears, cpu_isa,
                   quantization, step_costs)

    # The facts the engine reads (see `engine.llm_engine.ModelWorker`).
    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.loaded.spec.vocab_size

    @property
    def kv_window(self) -> int | None:
        return self.loaded.spec.kv_window

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.loaded.eos_token_ids

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def structured_outputs(self) -> StructuredOutputs | None:
        return self.runner.structured_outputs

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
    num_swap_blocks: int = 0,
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
        attention_backend=config.attention_backend,
        calculate_kv_scales=config.calculate_kv_scales,
        num_swap_blocks=num_swap_blocks,
        native_decode=config.native_decode,
        cache_dir=default_cache_dir(),
        structured_outputs=StructuredOutputs(loaded.tokenizer, loaded.spec.vocab_size,
                                             loaded.eos_token_ids, config.max_cached_grammars),
    )


def swap_space_blocks(config: EngineConfig, block_bytes: int) -> int:
    """Host blocks `swap_space` holds when a preemption mode swaps (else 0); `ValueError`
    naming `swap_space` when it holds none."""
    if config.preemption_mode == "recompute":
        return 0
    num_blocks = config.swap_space // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"swap_space: {config.swap_space} bytes hold no KV block of {block_bytes} bytes; "
            f"raise swap_space or use preemption_mode recompute"
        )
    return num_blocks


# Start-up measurement of preemption costs: a prefill of this many tokens (at most), and swaps
# of this many blocks (at most) out and back in, each timed a few times (the fastest counts).
COST_PREFILL_TOKENS = 128
COST_SWAP_BLOCKS = 32
COST_REPEATS = 3


def measure_preemption_costs(
    runner: ModelRunner, config: EngineConfig, num_blocks: int, num_swap_blocks: int,
    max_model_len: int, vocab_size: int,
) -> PreemptionCosts:
    """Time, on this machine and model: one prefill of up to `COST_PREFILL_TOKENS` tokens (per
    token), and round trips of 1 and of up to `COST_SWAP_BLOCKS` blocks to the swap space (per
    block, and the fixed part). Runs before any request, on blocks nobody holds yet; a round
    trip leaves the blocks as they were, and FP8 scales are reset to be calibrated afterwards
    on real tokens."""
    size = config.block_size
    num_tokens = max(1, min(COST_PREFILL_TOKENS, config.max_num_batched_tokens,
                            max_model_len - 1, num_blocks * size))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    step = SchedulerOutput(sequences=[ScheduledSequence(
        request_id="cost-prefill", token_ids=[(7 * i + 1) % vocab_size for i in range(num_tokens)],
        num_computed_tokens=0, block_table=list(range(cdiv(num_tokens, size))), sample=True,
        sampling_params=params, num_prompt_tokens=num_tokens)])
    prefill_s = _fastest(lambda: runner.execute(step), runner.device) / num_tokens
    runner.attention.reset_kv_scales()
    k = max(1, min(COST_SWAP_BLOCKS, num_blocks, num_swap_blocks,
                   config.max_swap_blocks_per_step))

    def round_trip(n: int) -> Callable[[], None]:
        pairs = [(i, i) for i in range(n)]
        return lambda: runner.swap_blocks(pairs, pairs)

    one_s = _fastest(round_trip(1), runner.device)
    many_s = _fastest(round_trip(k), runner.device)
    per_block_s = (many_s - one_s) / (k - 1) if k > 1 else one_s
    per_block_s = max(per_block_s, many_s / k / 2)  # timer noise must not make copies free
    fixed_s = max(0.0, (one_s - per_block_s) / 2)
    return PreemptionCosts(prefill_s, per_block_s, fixed_s)


def _fastest(run: Callable[[], object], device: torch.device) -> float:
    """The fastest of `COST_REPEATS` timed runs, after one untimed warm-up run."""
    return min(timed_runs(run, device, COST_REPEATS))


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
    (CUDA): runs `dummy_step` on a runner with just enough KV blocks for it."""
    max_len = model_max_len(loaded.spec, config.max_model_len)
    step = dummy_step(config.max_num_batched_tokens, config.max_num_seqs, config.block_size,
                      min(max_len, PROFILE_CONTEXT_FACTOR * config.max_num_batched_tokens))
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


# The profiled long chunk reads a cached context of at most this many times the step's tokens:
# a later chunk attends over chunk x context, so a context of the model's whole length (128k
# and more) would make the profile itself the largest allocation of all.
PROFILE_CONTEXT_FACTOR = 4


def dummy_step(
    num_tokens: int, max_num_seqs: int, block_size: int, max_len: int
) -> SchedulerOutput:
    """A step of up to `num_tokens` tokens in at most `max_num_seqs` sequences that allocates
    what the most expensive real step does: the longest chunk is the LAST chunk of a `max_len`
    sequence (so it reads a cached context, the path that gathers and masks), chunks go on while
    `max_len` caps them, and every other seat is a decode over a cached block; every sequence
    samples with top-k, top-p and 20 logprobs. No sequence reaches past `max_len` positions."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    num_seats = max(1, min(max_num_seqs, num_tokens))
    # Fewest chunks that carry the tokens the decodes leave: each holds < max_len new tokens.
    num_chunks = 1
    while num_chunks < num_seats and num_tokens - (num_seats - num_chunks) > num_chunks * (
        max_len - 1
    ):
        num_chunks += 1
    chunk_tokens = min(num_tokens - (num_seats - num_chunks), num_chunks * (max_len - 1))
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=20, max_tokens=1)
    sequences: list[ScheduledSequence] = []
    next_block = 0

    def add(num_new: int, context_len: int) -> None:
        nonlocal next_block
        table = list(range(next_block, next_block + cdiv(context_len, block_size)))
        next_block += len(table)
        sequences.append(ScheduledSequence(
            request_id=f"profile-{len(sequences)}", token_ids=[0] * num_new,
            num_computed_tokens=context_len - num_new, block_table=table, sample=True,
            sampling_params=params, num_prompt_tokens=context_len,
        ))

    for _ in range(num_chunks):
        num_new = min(chunk_tokens, max_len - 1)
        add(num_new, max_len)
        chunk_tokens -= num_new
    for _ in range(num_seats - num_chunks):
        add(1, min(max_len, block_size + 1))
    return SchedulerOutput(sequences=sequences)


def model_max_len(spec: ModelSpec, wanted: int | None = None) -> int:
    """The longest sequence the model can run: its positions (`ModelSpec.max_context`),
    capped at `wanted` when given and smaller."""
    model_max = spec.max_context
    return model_max if wanted is None else min(model_max, wanted)


def kv_capacity_tokens(window: KVWindow, num_blocks: int) -> int | None:
    """The longest sequence `num_blocks` blocks hold: all of its tokens, or under a sliding
    window on every layer, any length where the window's blocks fit (None: no limit)."""
    bound = window.max_held_blocks
    if bound is not None and bound <= num_blocks:
        return None
    return num_blocks * window.block_size


def resolve_max_model_len(
    wanted: int | None, spec: ModelSpec, kv_capacity_tokens: int | None,
    knob: str = "kv_cache_memory",
) -> int:
    """`max_model_len`: the model's limit capped by the cache (None: the cache sets no limit),
    or the value asked for if both allow it (`ValueError` naming the knob otherwise; `knob`
    sizes the cache)."""
    model_max = model_max_len(spec)
    if kv_capacity_tokens is None:
        kv_capacity_tokens = model_max
    if wanted is None:
        return min(model_max, kv_capacity_tokens)
    if wanted > model_max:
        raise ValueError(f"max_model_len {wanted} exceeds the model's maximum {model_max}")
    if wanted > kv_capacity_tokens:
        raise ValueError(
            f"max_model_len {wanted} needs more KV cache than {knob} leaves "
            f"({kv_capacity_tokens} tokens); raise {knob} or lower max_model_len"
        )
    return wanted
