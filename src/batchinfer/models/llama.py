"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2) as one readable module, and the
layers the other families (`qwen3.py`, `phi3.py`, `gemma.py`) build on.

The model never does attention itself: `forward` takes an `attention(layer_idx, q, k, v)`
callable from the runner, which owns the paged KV cache, the masks, the softmax scale and any
sliding window or soft-capping (per layer, from the spec: `runner/attention.py`). Inputs are a
FLAT batch: the tokens of many sequences concatenated, no padding, each with its own position;
sequence boundaries are known only to the callable.

Weights follow Hugging Face's layout and RoPE convention ("rotate_half": a head's first and
second halves are the two coordinates of each rotated pair), with two fusions made at load
time so each layer does fewer, larger matmuls: q/k/v in one `qkv_proj`, gate/up in one
`gate_up_proj`. `checkpoint_names()` says which checkpoint tensors make each parameter.

A family differs from Llama by a few overridable parts: `Attention.qkv_heads` (what becomes
of the projected heads before RoPE), `DecoderLayer.forward` (where the norms sit),
`LlamaForCausalLM.embed` and `compute_logits` (scaling the input and output), the norm class,
and which checkpoint tensors are already fused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.models.linear_kernels import KernelLinear, KernelPlan, apply_kernels
from batchinfer.models.rope import Rotary, apply_rope, rope_inverse_frequencies, rope_tables
from batchinfer.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec
from batchinfer.native import elementwise

__all__ = [
    "SUPPORTED_ARCHITECTURES", "AttentionFn", "ModelSpec", "LlamaForCausalLM", "Rotary",
    "apply_rope", "rope_inverse_frequencies",
]

# (layer_idx, q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim], v same)
#   -> [num_tokens, num_heads, head_dim]. q and k already have RoPE applied.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Our fused parameter -> the checkpoint projections concatenated (along dim 0) to make it.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def add_linear_(residual: torch.Tensor, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`residual += linear(x)` in place, inside the product's epilogue where its kernel can
    (`KernelLinear.add_into`); returns `residual`."""
    if isinstance(linear, KernelLinear):
        linear.add_into(residual, x)
    else:
        residual.add_(linear(x))
    return residual



class RMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def scale(self) -> torch.Tensor:
        """The factor each normalized value is multiplied by: the weight itself."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (the float32 residual stream, or `[n, heads, head_dim]` heads) -> normalized, in
        the weights' dtype.

        Written out (`x * rsqrt(mean(x^2) + eps) * weight`, Hugging Face's formula, in float32)
        rather than `F.rms_norm`, which on CPU runs 8x slower at 512 rows (0.91 ms against
        0.12 ms for a 576-wide chunk here): 61 norms a step. On float32 CPU rows, one native
        pass instead of six (`native/elementwise.py`)."""
        scale = self.scale()
        lib = elementwise.library_for(x, scale)
        if lib is not None and x.dim() == 2:
            return elementwise.rms_norm(lib, x, scale, self.eps)
        x = x.float()
        inverse = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x * inverse).mul_(scale.float()).to(self.weight.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        qkv_size = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, qkv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(
            spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.attention_out_bias
        )

    def qkv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x `[n, hidden]` -> q, k and v heads side by side, `[n, h + 2kv, d]`, before RoPE."""
        return self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)

    def attend(self, x: torch.Tensor, rotary: Rotary, attention: AttentionFn) -> torch.Tensor:
        """x `[n, hidden]` -> the heads' attention outputs `[n, h * d]`, before `o_proj`."""
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_heads(x)  # [n, h+2kv, d]
        qk = rotary.rotated(qkv, h + kv)  # [n, h+kv, d]: q and k rotated at once
        q, k = qk[:, :h], qk[:, h:]  # [n, h, d], [n, kv, d]: strided views of qk
        v = qkv[:, h + kv :]  # [n, kv, d], a strided view of qkv
        out = attention(self.layer_idx, q, k, v)  # [n, h, d]
        return out.reshape(x.shape[0], h * self.head_dim)

    def forward(
        self, x: torch.Tensor, rotary: Rotary, attention: AttentionFn, residual: torch.Tensor
    ) -> torch.Tensor:
        """`residual += o_proj(attention(x))` in place; returns `residual`."""
        return add_linear_(residual, self.o_proj, self.attend(x, rotary, attention))


class MLP(nn.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))`: SwiGLU (`silu`) or GeGLU
    (`gelu_pytorch_tanh`), as `spec.hidden_act` says."""

    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or spec.intermediate_size  # an expert's, in a MoE
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, spec.hidden_size, bias=False)
        self.activation = spec.hidden_act

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x `[n, hidden]` -> `act(gate) * up`, `[n, intermediate]` (maybe a strided view)."""
        gate_up = self.gate_up_proj(x)  # [n, 2 * intermediate]
        lib = elementwise.library_for(gate_up)
        if (self.activation == "silu" and lib is not None and gate_up.dim() == 2
                and gate_up.is_contiguous()):
            # one pass into a new contiguous tensor, as the native product reads it
            return elementwise.silu_mul(lib, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [n, intermediate] each
        if self.activation == "silu":  # in place in the projection's output (no new
            # [n, intermediate] tensors); down_proj reads the strided gate half directly
            return F.silu(gate, inplace=True).mul_(up)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual += down_proj(act(gate) * up)` in place; returns `residual`."""
        return add_linear_(residual, self.down_proj, self.hidden(x))


class DecoderLayer(nn.Module):
    """Pre-norm: `x += attn(norm(x))`, then `x += mlp(norm(x))`."""

    attention_class: type[Attention] = Attention
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = self.norm_class(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = self.attention_class(spec, layer_idx)
        self.post_attention_layernorm = self.norm_class(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, rotary: Rotary, attention: AttentionFn) -> torch.Tensor:
        """Updates the residual stream `x` `[n, hidden]` (float32) IN PLACE and returns it."""
        self.self_attn(self.input_layernorm(x), rotary, attention, x)
        return self.mlp(self.post_attention_layernorm(x), x)


class LlamaForCausalLM(nn.Module):
    """Token ids and positions of a flat batch -> final hidden states; logits on request.

    Build it on the meta device and load weights with `assign=True` (see `loader.py`); the
    RoPE tables are always made on CPU in float32 and follow `.to(device)`. Do not cast the
    module with `.to(dtype)`: that would cast the tables too.
    """

    layer_class: type[DecoderLayer] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm
    # Our fused parameter -> the checkpoint tensors it is made of (a family whose checkpoint
    # is fused already maps none).
    fused_projections: dict[str, tuple[str, ...]] = FUSED_PROJECTIONS

    rope_cos: torch.Tensor  # [spec.max_context, head_dim // 2] float32, a buffer
    rope_sin: torch.Tensor  # same shape

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(spec, i) for i in range(spec.num_layers))
        self.norm = self.norm_class(spec.hidden_size, spec.rms_norm_eps)
        # None: tied to the embedding (until `choose_linear_kernels` gives it its kernels).
        self.lm_head: nn.Module | None = (
            None
            if spec.tie_word_embeddings
            else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        )
        cos, sin = rope_tables(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                               spec.max_context, spec.max_context)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def fit_context(self, max_model_len: int) -> None:
        """Make the RoPE tables those of a server of sequences up to `max_model_len` tokens:
        LongRoPE (Phi-3) takes its short factors within its original context, else its long
        ones, and dynamic NTK stretches its base past it (`rope.py`); other RoPE does not
        depend on it."""
        spec = self.spec
        if spec.rope_scaling is None or spec.rope_scaling["rope_type"] not in ("longrope",
                                                                               "dynamic"):
            return
        cos, sin = rope_tables(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                               spec.max_context, max_model_len)
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids `[n]` -> the residual stream `[n, hidden]`, float32, a new tensor."""
        # The residual stream stays float32 whatever the weights' dtype: in bfloat16 each of
        # the 2 * num_layers additions would round it to 8 mantissa bits, a large share of
        # bfloat16's error against float32 and enough to flip near-tied greedy picks
        # (docs/architecture.md, "bfloat16 accuracy").
        x = self.embed_tokens(input_ids)  # a new tensor: layers update it in place
        return x.float()

    def rotaries(self, positions: torch.Tensor) -> list[Rotary]:
        """Each layer's RoPE for a step at `positions` (here one, shared by every layer)."""
        dtype = self.embed_tokens.weight.dtype
        return [Rotary(self.rope_cos, self.rope_sin, positions, dtype)] * len(self.layers)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden]."""
        x = self.embed(input_ids)
        for layer, rotary in zip(self.layers, self.rotaries(positions), strict=True):
            x = layer(x, rotary, attention)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 (the matmul runs in the weights' dtype)."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def checkpoint_names(self, param_name: str) -> tuple[str, ...]:
        """The Hugging Face checkpoint tensors that, concatenated on dim 0, make `param_name`.

        `layers.3.self_attn.qkv_proj.weight` -> `model.layers.3.self_attn.{q,k,v}_proj.weight`;
        `lm_head.weight` -> itself; anything else gets the `model.` prefix.
        """
        if param_name.startswith("lm_head."):
            return (param_name,)
        *module_path, fused, kind = param_name.split(".")
        parts = self.fused_projections.get(fused, (fused,))
        return tuple(".".join(["model", *module_path, part, kind]) for part in parts)

    def choose_linear_kernels(
        self, quantization: str, kernels: str, device: torch.device, dtype: torch.dtype,
        cache_dir: Path | None, allow_packed: bool = True, native_decode: bool = False,
    ) -> KernelPlan:
        """Give every linear (and the LM head) its weight form and kernels (see
        `linear_kernels.py`). `quantization` applies to the decoder layers; the LM head is never
        4-bit, as in GPTQ and AWQ checkpoints: its rounding moves every logit at once, and on
        the embedded model a 4-bit head alone turns 95 % greedy agreement with float32 into
        38 % (docs/architecture.md). It keeps float weights, or with quantized layers 8-bit
        groups of 32 where those measure faster (`q8_native`; the embedded model's table is
        Q8_0, which they hold exactly). A tied LM head reads the embedding table itself where
        its kernel is dense, else its own copy (the table stays for the lookup).
        `native_decode` keeps native forms for whole native decode steps as well
        (`apply_kernels`).
        """
        extra: dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None = None
        if self.lm_head is None:
            extra = {"lm_head": (self.embed_tokens.weight, None)}
        return apply_kernels(self, quantization, kernels, device, dtype, cache_dir,
                             allow_packed, extra, heads=("lm_head",),
                             native_decode=native_decode)

