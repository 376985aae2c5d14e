"""What each GGUF architecture llama.cpp writes means for the Hugging Face folder it converts
back to (`models/gguf.py`): the HF architecture, the tensor names, what llama.cpp's converter
changed in the values, and the `config.json` fields only that family has.

- `llama`: Q/K rows permuted (undone by `gguf.unpermute_rows`);
- `qwen2`, `qwen3`: as stored (`qwen3`: per-head `attn_q_norm` / `attn_k_norm`);
- `phi3`: q/k/v fused in `attn_qkv` and gate/up in `ffn_up`, Phi-3's own layout; LongRoPE's
  factors as the `rope_factors_long` / `rope_factors_short` tensors;
- `gemma2`, `gemma3`: every norm weight stored plus one (Gemma scales by `1 + weight`; the
  converter adds the one), norms after the attention (`attn_post_norm`) and around the MLP
  (`ffn_norm` before it, `post_ffw_norm` after); the softmax scale is not stored: llama.cpp
  takes `1 / sqrt(head_dim)`, or for the 27B models `1 / sqrt(hidden / heads)`, and so do we;
  Gemma 3's local layers rotate with base 10000 and every sixth layer is global (llama.cpp's
  fixed values);
- `qwen3moe`: each layer's experts as three 3-D tensors (`ffn_{gate,up,down}_exps`, one
  matrix per expert) and the router as `ffn_gate_inp`; the top-k weights renormalized unless
  `expert_weights_norm` says otherwise (llama.cpp's Qwen3-MoE always renormalizes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

# GGUF layer tensor -> HF module under `model.layers.N.`, for the Llama-like families.
LLAMA_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head q/k norms
    "attn_k_norm": "self_attn.k_norm",
}
_PHI3_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate and up, fused as Phi-3 stores them
}
_GEMMA_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    "attn_post_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_MOE_LAYER_TENSORS = {**LLAMA_LAYER_TENSORS, "ffn_gate_inp": "mlp.gate"}
# A layer's experts, one 3-D tensor each: GGUF name -> the projection of every expert.
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                  "ffn_down_exps": "down_proj"}
# Gemma's 27B models: llama.cpp recognises them by their depth and scales by hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

Reader = gguf.GGUFReader
ConfigFields = Callable[[Reader, str, Path, dict[str, Any]], dict[str, Any]]


def field_value(reader: Reader, key: str, default: Any = None) -> Any:
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def required(reader: Reader, key: str, gguf_path: Path) -> Any:
    value = field_value(reader, key)
    if value is None:
        raise ValueError(f"{gguf_path}: metadata key {key!r} is missing")
    return value


def _gemma_config(reader: Reader, arch: str, gguf_path: Path,
                  config: dict[str, Any]) -> dict[str, Any]:
    depth = config["num_hidden_layers"]
    scalar = (config["hidden_size"] // config["num_attention_heads"]
              if depth == _GEMMA_27B_LAYERS[arch] else config["head_dim"])
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
        "sliding_window": field_value(reader, f"{arch}.attention.sliding_window"),
    }
    pattern = field_value(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, int):  # every `pattern`-th layer global
        fields["sliding_window_pattern"] = pattern
    elif isinstance(pattern, list):  # per layer: True = a sliding window
        fields["layer_types"] = ["sliding_attention" if local else "full_attention"
                                 for local in pattern]
    if arch == "gemma2":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            fields[name] = field_value(reader, f"{arch}.{name}")
    else:
        fields["rope_local_base_freq"] = 10000.0
    return fields


def _moe_config(reader: Reader, arch: str, gguf_path: Path,
                config: dict[str, Any]) -> dict[str, Any]:
    moe_size = required(reader, f"{arch}.expert_feed_forward_length", gguf_path)
    return {
        "num_experts": required(reader, f"{arch}.expert_count", gguf_path),
        "num_experts_per_tok": required(reader, f"{arch}.expert_used_count", gguf_path),
        "moe_intermediate_size": moe_size,
        "intermediate_size": field_value(reader, f"{arch}.feed_forward_length", moe_size),
        "norm_topk_prob": bool(field_value(reader, f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    }


def _phi3_config(reader: Reader, arch: str, gguf_path: Path,
                 config: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"sliding_window": field_value(reader,
                                                            f"{arch}.attention.sliding_window")}
    tensors = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in tensors:  # LongRoPE
        factors = {name: [float(v) for v in tensors[f"rope_factors_{name}.weight"].data]
                   for name in ("long", "short")}
        fields["original_max_position_embeddings"] = required(
            reader, f"{arch}.rope.scaling.original_context_length", gguf_path)
        fields["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors["long"],
                                  "short_factor": factors["short"]}
        attention_factor = field_value(reader, f"{arch}.rope.scaling.attn_factor")
        if attention_factor is not None:
            fields["rope_scaling"]["attention_factor"] = attention_factor
    return fields


@dataclass(frozen=True)
class GGUFArch:
    """One GGUF architecture: the HF `architecture` and `model_type` it converts to, whether
    llama.cpp permuted its Q/K rows, its layer tensor names, what the converter added to its
    norm weights, the tensors that are not weights (`skipped`), its own config fields."""

    architecture: str
    model_type: str
    permuted: bool = False
    layer_tensors: dict[str, str] = field(default_factory=lambda: LLAMA_LAYER_TENSORS)
    norm_offset: float = 0.0
    skipped: tuple[str, ...] = ()
    config: ConfigFields | None = None


ARCHITECTURES = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", permuted=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3"),
    "phi3": GGUFArch("Phi3ForCausalLM", "phi3", layer_tensors=_PHI3_LAYER_TENSORS,
                     skipped=("rope_factors_long.weight", "rope_factors_short.weight"),
                     config=_phi3_config),
    "gemma2": GGUFArch("Gemma2ForCausalLM", "gemma2", layer_tensors=_GEMMA_LAYER_TENSORS,
                       norm_offset=1.0, config=_gemma_config),
    "gemma3": GGUFArch("Gemma3ForCausalLM", "gemma3_text", layer_tensors=_GEMMA_LAYER_TENSORS,
                       norm_offset=1.0, config=_gemma_config),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", "qwen3_moe", layer_tensors=_MOE_LAYER_TENSORS,
                         config=_moe_config),
}
