"""Phi-3: Llama's decoder, its checkpoint already fused and its RoPE optionally LongRoPE.

The checkpoint stores `qkv_proj` (q, k, v rows in that order) and `gate_up_proj` (gate, then
up): the layout `llama.py` fuses other checkpoints into, so they load as they are. LongRoPE
(`rope_scaling.type: longrope`, with `short_factor` / `long_factor`) is in `rope.py`;
a config's `sliding_window` applies to every layer (runner/attention.py).
"""

from __future__ import annotations

from batchinfer.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: `LlamaForCausalLM` loading its fused projections unchanged."""

    fused_projections: dict[str, tuple[str, ...]] = {}
