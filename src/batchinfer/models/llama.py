"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2) as one readable module.

The model never does attention itself: `forward` takes an `attention(layer_idx, q, k, v)`
callable from the runner, which owns the paged KV cache, the masks and the softmax scale
`1 / sqrt(head_dim)`. Inputs are a FLAT batch: the tokens of many sequences concatenated, no
padding, each with its own position; sequence boundaries are known only to the callable.

Weights follow Hugging Face's layout and RoPE convention ("rotate_half": a head's first and
second halves are the two coordinates of each rotated pair), with two fusions made at load
time so each layer does fewer, larger matmuls: q/k/v in one `qkv_proj`, gate/up in one
`gate_up_proj`. `checkpoint_names()` says which checkpoint tensors make each parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.models.linear_kernels import KernelLinear, KernelPlan, apply_kernels
from batchinfer.native import elementwise

# (layer_idx, q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim], v same)
#   -> [num_tokens, num_heads, head_dim]. q and k already have RoPE applied.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# rope_scaling type -> the keys it needs ("default" means no scaling).
_ROPE_SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# Our fused parameter -> the checkpoint projections concatenated (along dim 0) to make it.
_FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family model, read from a Hugging Face `config.json`.

    `attention_bias` is the q/k/v bias (Qwen2 always, Llama when configured);
    `attention_out_bias` the o_proj bias (Llama's `attention_bias` covers it too, Qwen2 has
    none). `sliding_window` is Mistral's window, or None for full attention: the model does
    not apply it, the attention callable (or a `max_model_len` within it) must.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(hash=False)
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    attention_out_bias: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelSpec:
        """Build a spec from a `config.json` dict; `ValueError` naming the field and `source`.

        Reads both the transformers 4 RoPE fields (`rope_theta`, `rope_scaling`) and the
        transformers 5 one (`rope_parameters`).
        """
        architecture = _supported_architecture(config, source)

        def integer(name: str, default: int | None = None) -> int:
            value = config.get(name) or default
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{source}: field {name!r} must be a positive integer")
            return value

        num_heads = integer("num_attention_heads")
        hidden_size = integer("hidden_size")
        num_kv_heads = integer("num_key_value_heads", default=num_heads)
        head_dim = integer("head_dim", default=hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        if head_dim % 2:
            raise ValueError(f"{source}: field 'head_dim' must be even, got {head_dim}")
        rope_theta, rope_scaling = _rope_fields(config, source)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        llama_bias = bool(config.get("attention_bias", False)) and not is_qwen2
        return cls(
            architecture=architecture,
            num_layers=integer("num_hidden_layers"),
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=integer("intermediate_size"),
            vocab_size=integer("vocab_size"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            max_position_embeddings=integer("max_position_embeddings"),
            attention_out_bias=llama_bias,
            sliding_window=_sliding_window(config, is_qwen2),
        )


def _supported_architecture(config: dict[str, Any], source: str) -> str:
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise ValueError(f"{source}: field 'architectures' is missing or empty")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: unsupported hidden_act {config['hidden_act']!r}")
    if config.get("mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    return architecture


def _rope_fields(config: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from either config generation; scaling keeps `rope_type`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(f"{source}: unsupported rope_scaling type {rope_type!r}")
    if rope_type == "default":
        return theta, None
    missing = [name for name in _ROPE_SCALING_KEYS[rope_type] if name not in params]
    if missing:
        raise ValueError(f"{source}: rope_scaling ({rope_type}) lacks {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(config: dict[str, Any], is_qwen2: bool) -> int | None:
    # Qwen2 configs carry a `sliding_window` that only applies with `use_sliding_window`.
    if is_qwen2 and not config.get("use_sliding_window", False):
        return None
    window = config.get("sliding_window")
    return window if isinstance(window, int) and window > 0 else None


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """`[head_dim // 2]` float32 rotation speeds, with linear or Llama-3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3: slow (long-wavelength) pairs are slowed by `factor`, fast ones kept, and the
    # band between interpolated smoothly (same arithmetic as transformers).
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / scaling["low_freq_factor"]
    high_freq_wavelen = old_context_len / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + d/2]) pair of every head by its position's angle.

    x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim // 2]. Equal to HF's
    `x * cos + rotate_half(x) * sin` with half-size tables. Returns a new contiguous tensor.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Rotary:
    """One step's RoPE: every token's angles, by its position, for all layers.

    On float32 CPU activations the heads rotate in place in one native pass that reads the
    tables by position (`native/elementwise.py`); elsewhere each token's `cos`/`sin` rows are
    gathered once a step and `apply_rope` makes new rotated heads.
    """

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.lib = elementwise.library_for_dtype(dtype, positions.device)
        if self.lib is not None and positions.numel():
            low, high = (int(p) for p in positions.aminmax())
            if low < 0 or high >= cos_table.shape[0]:  # the table lookup below would raise
                raise IndexError(f"positions must lie in [0, {cos_table.shape[0]}), "
                                 f"got {low}..{high}")
        if self.lib is not None:
            self.positions = positions.contiguous()
            self.cos, self.sin = cos_table, sin_table
        else:  # [n, 1, head_dim // 2]
            self.cos = cos_table[positions].unsqueeze(1).to(dtype)
            self.sin = sin_table[positions].unsqueeze(1).to(dtype)

    def rotated(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """The first `heads` heads of `x` `[n, all_heads, head_dim]` (heads side by side in a
        row, as a view of the fused projection has them) rotated: in place and returned as a
        view where native, else as a new tensor (`x` unchanged)."""
        if self.lib is not None:
            elementwise.rotate_(self.lib, x, heads, self.positions, self.cos, self.sin)
            return x[:, :heads]
        return apply_rope(x[:, :heads], self.cos, self.sin)


def add_linear_(residual: torch.Tensor, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`residual += linear(x)` in place, inside the product's epilogue where its kernel can
    (`KernelLinear.add_into`); returns `residual`."""
    if isinstance(linear, KernelLinear):
        linear.add_into(residual, x)
    else:
        residual.add_(linear(x))
    return residual


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (the float32 residual stream) -> normalized, in the weights' dtype.

        Written out (`x * rsqrt(mean(x^2) + eps) * weight`, Hugging Face's formula) rather than
        `F.rms_norm`, which on CPU runs 8x slower at 512 rows (0.91 ms against 0.12 ms for a
        576-wide chunk here): 61 norms a step. On float32 CPU rows, one native pass instead
        of six (`native/elementwise.py`)."""
        lib = elementwise.library_for(x, self.weight)
        if lib is not None and x.dim() == 2:
            return elementwise.rms_norm(lib, x, self.weight, self.eps)
        inverse = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x * inverse).mul_(self.weight.to(x.dtype)).to(self.weight.dtype)


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

    def forward(
        self, x: torch.Tensor, rotary: Rotary, attention: AttentionFn, residual: torch.Tensor
    ) -> torch.Tensor:
        """`residual += o_proj(attention(x))` in place; returns `residual`."""
        num_tokens = x.shape[0]
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(num_tokens, h + 2 * kv, self.head_dim)  # [n, h+2kv, d]
        qk = rotary.rotated(qkv, h + kv)  # [n, h+kv, d]: q and k rotated at once
        q, k = qk[:, :h], qk[:, h:]  # [n, h, d], [n, kv, d]: strided views of qk
        v = qkv[:, h + kv :]  # [n, kv, d], a strided view of qkv
        out = attention(self.layer_idx, q, k, v)  # [n, h, d]
        return add_linear_(residual, self.o_proj, out.reshape(num_tokens, h * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual += down_proj(silu(gate) * up)` in place; returns `residual`."""
        gate_up = self.gate_up_proj(x)  # [n, 2 * intermediate]
        lib = elementwise.library_for(gate_up)
        if lib is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            # one pass into a new contiguous tensor, as the native product reads it
            return add_linear_(residual, self.down_proj, elementwise.silu_mul(lib, gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [n, intermediate] each
        # SwiGLU in place in the projection's output (no new [n, intermediate] tensors);
        # down_proj reads the strided gate half directly.
        return add_linear_(residual, self.down_proj, F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
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

    rope_cos: torch.Tensor  # [max_position_embeddings, head_dim // 2] float32, a buffer
    rope_sin: torch.Tensor  # same shape

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # None: tied to the embedding (until `choose_linear_kernels` gives it its kernels).
        self.lm_head: nn.Module | None = (
            None
            if spec.tie_word_embeddings
            else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        )
        positions = torch.arange(spec.max_position_embeddings, device="cpu").float()
        inv_freq = rope_inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        angles = torch.outer(positions, inv_freq)  # [max_pos, head_dim // 2]
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)  # [n, hidden], a new tensor: layers update it in place
        rotary = Rotary(self.rope_cos, self.rope_sin, positions, x.dtype)  # shared by layers
        # The residual stream stays float32 whatever the weights' dtype: in bfloat16 each of
        # the 2 * num_layers additions would round it to 8 mantissa bits, a large share of
        # bfloat16's error against float32 and enough to flip near-tied greedy picks
        # (docs/architecture.md, "bfloat16 accuracy").
        x = x.float()
        for layer in self.layers:
            x = layer(x, rotary, attention)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 (the matmul runs in the weights' dtype)."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

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


def checkpoint_names(param_name: str) -> tuple[str, ...]:
    """The Hugging Face checkpoint tensors that, concatenated on dim 0, make `param_name`.

    `layers.3.self_attn.qkv_proj.weight` -> `model.layers.3.self_attn.{q,k,v}_proj.weight`;
    `lm_head.weight` -> itself; anything else gets the `model.` prefix.
    """
    if param_name.startswith("lm_head."):
        return (param_name,)
    *module_path, fused, kind = param_name.split(".")
    parts = _FUSED_PROJECTIONS.get(fused, (fused,))
    return tuple(".".join(["model", *module_path, part, kind]) for part in parts)
