"""Gemma 2 and Gemma 3 (text): Llama's decoder with Gemma's norms, scalings and layer types.

    x_0     = embed(ids) * sqrt(hidden)                        (the factor in the weights' dtype)
    x      += post_attention_norm(attn(input_norm(x)))          (norms on both sides of each
    x      += post_feedforward_norm(mlp(pre_feedforward_norm(x)))    sublayer)
    logits  = cap * tanh(lm_head(norm(x)) / cap)                (Gemma 2's final soft-cap)

with every RMSNorm scaling by `1 + weight` (the checkpoint stores the weight less one), the MLP
a GeGLU (`gelu_pytorch_tanh(gate) * up`), and the attention's softmax scale
`1 / sqrt(query_pre_attn_scalar)`. Layers alternate local (a sliding window) and global (the
whole context): Gemma 2 one of each, Gemma 3 five local then one global. Gemma 2 soft-caps the
scores (`attn_logit_softcapping`); Gemma 3 normalizes each query and key head before RoPE (as
Qwen3 does, with Gemma's norm) and rotates its local layers with a RoPE of their own base
(`rope_local_base_freq`), its global ones with `rope_theta` and `rope_scaling`. The window,
scale and soft-cap of each layer are applied by the attention backend (`ModelSpec.
layer_attention`); the rest is here.
"""

from __future__ import annotations

import torch

from batchinfer.models.llama import AttentionFn, DecoderLayer, LlamaForCausalLM, RMSNorm, Rotary
from batchinfer.models.qwen3 import Qwen3Attention
from batchinfer.models.rope import rope_tables
from batchinfer.models.spec import ModelSpec


class GemmaRMSNorm(RMSNorm):
    """`x * rsqrt(mean(x^2) + eps) * (1 + weight)`, in float32 (as transformers computes it)."""

    def scale(self) -> torch.Tensor:
        return self.weight.float() + 1.0


class GemmaDecoderLayer(DecoderLayer):
    """Pre- and post-norms around both sublayers (Gemma 2 and 3)."""

    norm_class = GemmaRMSNorm

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__(spec, layer_idx)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: Rotary, attention: AttentionFn) -> torch.Tensor:
        """Updates the residual stream `x` `[n, hidden]` (float32) IN PLACE and returns it."""
        attn, mlp = self.self_attn, self.mlp
        attended = attn.o_proj(attn.attend(self.input_layernorm(x), rotary, attention))
        x.add_(self.post_attention_layernorm(attended))  # [n, hidden]
        hidden = mlp.down_proj(mlp.hidden(self.pre_feedforward_layernorm(x)))
        return x.add_(self.post_feedforward_layernorm(hidden))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: scaled embeddings, Gemma's layers and norms, soft-capped logits."""

    layer_class: type[DecoderLayer] = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids `[n]` -> `embedding * sqrt(hidden)`, `[n, hidden]` float32."""
        weight = self.embed_tokens.weight
        normalizer = torch.tensor(self.spec.hidden_size**0.5, dtype=weight.dtype)
        return (self.embed_tokens(input_ids) * normalizer).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32, soft-capped where the config says so."""
        logits = super().compute_logits(hidden)
        cap = self.spec.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits


class Gemma3Attention(Qwen3Attention):
    """Per-head q/k norms before RoPE, with Gemma's `1 + weight` scaling."""

    norm_class = GemmaRMSNorm


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_class = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2's model with q/k norms and a RoPE of their own for the local
    (sliding-window) layers."""

    layer_class = Gemma3DecoderLayer

    local_rope_cos: torch.Tensor  # [spec.max_context, head_dim // 2], a buffer
    local_rope_sin: torch.Tensor

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        theta = spec.local_rope_theta if spec.local_rope_theta is not None else spec.rope_theta
        cos, sin = rope_tables(spec.head_dim, theta, None, spec.max_context, spec.max_context)
        self.register_buffer("local_rope_cos", cos, persistent=False)
        self.register_buffer("local_rope_sin", sin, persistent=False)

    def rotaries(self, positions: torch.Tensor) -> list[Rotary]:
        """The global layers' RoPE, and the local layers' own."""
        dtype = self.embed_tokens.weight.dtype
        rotary = Rotary(self.rope_cos, self.rope_sin, positions, dtype)
        local = Rotary(self.local_rope_cos, self.local_rope_sin, positions, dtype)
        return [rotary if self.spec.layer_window(i) is None else local
                for i in range(len(self.layers))]
