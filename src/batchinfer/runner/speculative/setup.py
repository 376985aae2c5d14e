"""Start-up of speculative decoding: the draft model's weights, and the runner's steps handed to
`SpeculativeSteps` with the step costs `speculative_depth auto` needs."""

from __future__ import annotations

import logging
from dataclasses import astuple
from typing import Any

import torch

from batchinfer.core.config import SELF_Q4, EngineConfig
from batchinfer.core.paths import default_cache_dir
from batchinfer.core.scheduling.spec_depth import StepCosts
from batchinfer.models.linear_kernels import KernelPlan
from batchinfer.models.loader import Checkpoint, LoadedModel, load_checkpoint, load_model
from batchinfer.models.spec import ModelSpec
from batchinfer.runner.model_runner import ModelRunner
from batchinfer.runner.speculative import SpeculativeSteps
from batchinfer.runner.speculative.costs import step_costs
from batchinfer.runner.speculative.draft import DraftModel

logger = logging.getLogger(__name__)

# The most rows a probe step of the start-up measurement has.
MAX_PROBE_ROWS = 256


def load_draft(config: EngineConfig, target: LoadedModel, quantization: str,
               device: torch.device, dtype: torch.dtype) -> tuple[LoadedModel, KernelPlan]:
    """The draft model of `speculative_method draft`, its linears' kernels chosen: `self-q4`
    loads the served checkpoint again with 4-bit weights; a path loads that model (4-bit
    weights too where `quantization` is q4, else as stored at `dtype`). `ValueError` names
    `speculative_model` when its vocabulary differs from the model's, or when self-q4 would
    draft with the very weights it verifies."""
    name = config.speculative_model
    if name == SELF_Q4:
        if quantization == "q4":
            raise ValueError("speculative_model self-q4: the served weights are q4 already, so "
                             "the draft would be the model itself; serve float weights "
                             "(--quantization none) or use speculative_method ngram")
        draft = load_checkpoint(Checkpoint(target.path, target.name, target.stored), dtype,
                                device)  # the folder the target was loaded from
        form = "q4"
    else:
        assert name is not None  # EngineConfig: speculative_method draft names a model
        draft = load_model(name, dtype, device)
        form = "q4" if quantization == "q4" else "none"
    if draft.spec.vocab_size != target.spec.vocab_size:
        raise ValueError(f"speculative_model {name!r} has a vocabulary of "
                         f"{draft.spec.vocab_size} tokens; the model's has "
                         f"{target.spec.vocab_size}")
    kernels = draft.model.choose_linear_kernels(
        form, "auto", device, dtype, default_cache_dir(), config.prepack_weights,
        config.native_decode)
    logger.info("speculative decoding: draft model %s (weights %s): %s", name, form,
                kernels.describe())
    return draft, kernels


def enable_speculation(config: EngineConfig, runner: ModelRunner,
                       draft_runner: ModelRunner | None, max_model_len: int,
                       identity: dict[str, Any]) -> StepCosts | None:
    """Hand `runner`'s steps to speculative decoding (proposals of `draft_runner` for the
    draft method); returns the step costs for `speculative_depth auto` (cached under the
    cache folder by `identity` and the probes; None for a fixed depth)."""
    draft = (DraftModel(draft_runner, config.max_num_batched_tokens)
             if draft_runner is not None else None)
    costs = None
    if config.speculative_depth == "auto":
        max_rows = min(MAX_PROBE_ROWS, config.max_num_batched_tokens,
                       config.max_num_seqs * (config.num_speculative_tokens + 1))
        costs = step_costs(runner, draft_runner, max_rows, max_model_len, identity,
                           default_cache_dir())
        logger.info("speculative decoding step costs: %s", describe(costs))
    runner.speculative = SpeculativeSteps(runner, draft)
    return costs


def runner_identity(runner: ModelRunner, spec: ModelSpec, kernels: KernelPlan | None
                    ) -> dict[str, Any]:
    """What a runner's step speed depends on besides machine, torch and threads."""
    native_decode = runner.native_decode
    return {"spec": [str(v) for v in astuple(spec)],
            "kernels": kernels.as_json() if kernels is not None else None,
            "backend": runner.attention.name, "kv_dtype": str(runner.kv_cache.dtype),
            "block_size": runner.block_size, "device": str(runner.device),
            "native_decode": native_decode.describe() if native_decode is not None else None}


def describe(costs: StepCosts) -> str:
    """One line of the measured costs, for the start-up log."""
    parts = [f"{rows} rows {1000 * s:.1f} ms" for rows, s in zip(costs.rows, costs.decode_s,
                                                                 strict=True)]
    text = ", ".join(parts) + f"; prefill {1000 * costs.prefill_token_s:.2f} ms/token"
    if costs.draft_s is not None:
        text += "; draft " + ", ".join(f"{rows} rows {1000 * s:.1f} ms" for rows, s in
                                       zip(costs.rows, costs.draft_s, strict=True))
    return text
