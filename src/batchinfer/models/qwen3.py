"""Qwen3 (dense): Llama's decoder with each query and key head RMS-normalized before RoPE.

    q_h = rope(rms_norm(W_q x)_h * q_norm),  k_h = rope(rms_norm(W_k x)_h * k_norm)

over each head's `head_dim` values (one weight per value, shared by the heads), then the
attention, MLP and norms of `llama.py`. `head_dim` comes from the config (Qwen3 sets it
independently of `hidden_size / num_heads`); q/k/v carry no bias unless `attention_bias`.
"""

from __future__ import annotations

import torch

from batchinfer.models.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from batchinfer.models.spec import ModelSpec


class Qwen3Attention(Attention):
    norm_class: type[RMSNorm] = RMSNorm  # of the per-head q/k norms

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__(spec, layer_idx)
        self.q_norm = self.norm_class(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = self.norm_class(spec.head_dim, spec.rms_norm_eps)

    def qkv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The projected heads `[n, h + 2kv, d]` with q and k normalized per head, in place."""
        qkv = super().qkv_heads(x)
        h, kv = self.num_heads, self.num_kv_heads
        qkv[:, :h] = self.q_norm(qkv[:, :h])  # [n, h, d]
        qkv[:, h : h + kv] = self.k_norm(qkv[:, h : h + kv])  # [n, kv, d]
        return qkv


class Qwen3DecoderLayer(DecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: `LlamaForCausalLM` with `Qwen3Attention` in every layer."""

    layer_class = Qwen3DecoderLayer
