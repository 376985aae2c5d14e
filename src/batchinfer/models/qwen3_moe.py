"""Qwen3-MoE: Qwen3's decoder with a mixture of experts in place of the MLP.

    p       = softmax(x W_router^T)                  [n, E], over every expert (float32)
    top     = the k largest of p per token           (renormalized to sum 1: norm_topk_prob)
    mlp(x)  = sum over the chosen e of p_e * expert_e(x),   expert_e a SwiGLU MLP

The experts are a batching problem. Computed token by token, every (token, chosen expert)
pair reads an expert's whole weight: a decode step of 32 sequences with 8 experts each reads
256 expert weights per layer. Here a step's pairs are sorted by expert (`group_by_expert`), so
each expert that any token chose runs ONE product over all the rows routed to it and its weight
is read once per step, however many tokens chose it (`MoE.forward`). Each expert is a
`llama.MLP`, whose linears take the model's weight-only quantization and kernels like every
other linear (`linear_kernels.apply_kernels`); the router stays float (`Router` is no
`nn.Linear`), as quantized checkpoints keep it. The experts' kernels are chosen among those
without oneDNN's packed layout: an expert's row count changes from step to step, and oneDNN
makes (and caches, a bounded number) one primitive per weight and row count, which with
hundreds of expert weights costs more than the packed product saves. Some layers may keep a
dense MLP (`mlp_only_layers`, `decoder_sparse_step`: `ModelSpec.moe.layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.models.linear_kernels import KernelPlan, apply_kernels
from batchinfer.models.llama import MLP
from batchinfer.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
from batchinfer.models.spec import ModelSpec, MoESpec


class Router(nn.Module):
    """Each token's experts and their weights, from `softmax(x W^T)` over all experts."""

    def __init__(self, spec: ModelSpec, moe: MoESpec) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, spec.hidden_size))
        self.top_k = moe.num_experts_per_tok
        self.normalize = moe.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[n, hidden]` -> (weights `[n, k]` in x's dtype, expert ids `[n, k]` int64)."""
        probs = F.linear(x, self.weight).float().softmax(dim=-1)  # [n, E]
        weights, experts = probs.topk(self.top_k, dim=-1)  # [n, k] each
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


@dataclass(slots=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert: pair `i` of the sorted order is token
    `token_ids[i]`'s choice, with weight `weights[i]`; expert `e`'s pairs are rows
    `[starts[e], starts[e + 1])` (host ints: one device sync per layer)."""

    token_ids: torch.Tensor  # [n * k]
    weights: torch.Tensor  # [n * k]
    starts: list[int]  # [E + 1]


def group_by_expert(weights: torch.Tensor, experts: torch.Tensor,
                    num_experts: int) -> ExpertGroups:
    """Sort the pairs of `weights`, `experts` (`[n, k]` each) by expert (stable: within an
    expert, by token)."""
    flat = experts.flatten()  # [n * k]
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = [0, *torch.cumsum(counts, 0).tolist()]
    return ExpertGroups(order // experts.shape[1], weights.flatten()[order], starts)


class MoE(nn.Module):
    """The sparse MLP: a router and `num_experts` SwiGLU experts, run grouped by expert."""

    def __init__(self, spec: ModelSpec, moe: MoESpec) -> None:
        super().__init__()
        self.gate = Router(spec, moe)
        self.experts = nn.ModuleList(MLP(spec, moe.intermediate_size)
                                     for _ in range(moe.num_experts))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual += sum_k w_k expert_k(x)` in place; returns `residual`. x `[n, hidden]`
        (normalized, weights' dtype), residual `[n, hidden]` float32."""
        weights, experts = self.gate(x)
        groups = group_by_expert(weights, experts, len(self.experts))
        rows = x[groups.token_ids]  # [n * k, hidden]: the tokens, in expert order
        out = torch.empty_like(rows)
        starts = groups.starts
        for expert, mlp in enumerate(self.experts):
            start, end = starts[expert], starts[expert + 1]
            if start < end:  # one product per chosen expert, over all its rows
                assert isinstance(mlp, MLP)
                out[start:end] = mlp.down_proj(mlp.hidden(rows[start:end]))
        out *= groups.weights[:, None]
        return residual.index_add_(0, groups.token_ids, out.to(residual.dtype))


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's layer; a `MoE` in place of the MLP where the spec puts one."""

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__(spec, layer_idx)
        if spec.moe is not None and layer_idx in spec.moe.layers:
            self.mlp = MoE(spec, spec.moe)  # type: ignore[assignment]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: `Qwen3ForCausalLM` with `Qwen3MoeDecoderLayer`s."""

    layer_class = Qwen3MoeDecoderLayer

    def choose_linear_kernels(
        self, quantization: str, kernels: str, device: torch.device, dtype: torch.dtype,
        cache_dir: Path | None, allow_packed: bool = True, native_decode: bool = False,
    ) -> KernelPlan:
        """The experts' kernels first, without oneDNN's packed layout (module docstring), then
        every other linear's as `LlamaForCausalLM` chooses them."""
        experts = nn.ModuleDict({str(i): layer.mlp.experts for i, layer in enumerate(self.layers)
                                 if isinstance(layer.mlp, MoE)})
        plan = apply_kernels(experts, quantization, kernels, device, dtype, cache_dir,
                             allow_packed=False)
        rest = super().choose_linear_kernels(quantization, kernels, device, dtype, cache_dir,
                                             allow_packed, native_decode)
        return KernelPlan({**plan.choice, **rest.choice}, f"{plan.source}+{rest.source}")
