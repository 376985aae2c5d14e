"""`ModelSpec`: the shape of a decoder-only model, read from a Hugging Face `config.json`.

One spec covers every family served (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2 and 3): the
fields all of them have, then the few that only some families set (a sliding window, an
activation other than SiLU, Gemma's soft-capping, query scale and local RoPE base). Which
module computes the model is
chosen by `architecture` (`models/families.py`); the spec says only what the config says.
Every bad or unsupported field is a `ValueError` naming the field and the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The `architectures[0]` values served, in the order the docs list them.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
_GEMMAS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# transformers' defaults for Gemma's fields, where a config leaves one out.
_GEMMA_DEFAULTS: dict[str, dict[str, float | None]] = {
    "Gemma2ForCausalLM": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": None,
                          "final_logit_softcapping": None},
}
# The MLP activations served (`hidden_act`, Gemma's `hidden_activation`).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# rope_scaling type -> the keys it needs ("default" means no scaling).
ROPE_SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "dynamic": ("factor", "max_position_embeddings"),
}
# Families whose config's `sliding_window` applies only with `use_sliding_window: true`.
_OPT_IN_WINDOWS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Families whose every layer takes the config's `sliding_window` (`layer_types` ignored, as
# transformers ignores it for them).
_EVERY_LAYER_WINDOWS = ("MistralForCausalLM", "Phi3ForCausalLM")
_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True, slots=True)
class MoESpec:
    """A mixture of experts in place of the MLP of `layers`: `num_experts` MLPs of
    `intermediate_size`, `num_experts_per_tok` of them per token, weighted by the softmax of
    the router's scores over all experts (renormalized over the chosen ones where
    `norm_topk_prob`)."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: frozenset[int]


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer's attention reads its context, which the attention backend applies:
    the softmax `scale`, the `window` (a query at position `p` sees keys `p - window + 1 .. p`;
    None: all of them) and the `softcap` (scores become `softcap * tanh(score / softcap)`
    before the softmax; None: left as they are)."""

    scale: float
    window: int | None = None
    softcap: float | None = None


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only model, read from a Hugging Face `config.json`.

    `attention_bias` is the q/k/v bias (Qwen2 always, Llama and Qwen3 when configured);
    `attention_out_bias` the o_proj bias (Llama's `attention_bias` covers it too, Qwen2 has
    none). `sliding_window`: the window of the layers that have one (a query at position `p`
    sees keys at positions `p - sliding_window + 1 .. p`), None for full attention everywhere;
    `full_attention_layers` are the layers that see the whole context even so (Gemma 2's global
    layers, Qwen2's first `max_window_layers`). `query_pre_attn_scalar`: the softmax scale is
    its inverse square root instead of `head_dim`'s (Gemma). `attn_logit_softcapping` and
    `final_logit_softcapping`: scores and logits pass through `cap * tanh(x / cap)` (Gemma 2).
    `local_rope_theta`: the RoPE base of the sliding-window layers, where it is not
    `rope_theta` (Gemma 3's `rope_local_base_freq`; `rope_scaling` is the global layers').
    `moe`: the mixture of experts of the layers that have one (Qwen3-MoE), None for a dense
    model.
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
    full_attention_layers: frozenset[int] = frozenset()
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    moe: MoESpec | None = field(default=None, hash=False)

    def layer_window(self, layer_idx: int) -> int | None:
        """The attention window of layer `layer_idx` in tokens, or None for full attention."""
        if self.sliding_window is None or layer_idx in self.full_attention_layers:
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """The softmax scale: `1 / sqrt(query_pre_attn_scalar or head_dim)`."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def max_context(self) -> int:
        """The longest sequence the model serves: `max_position_embeddings`, or the context
        YaRN or dynamic NTK scaling stretches it to (`factor` times the original, as vLLM
        takes it)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "yarn":
            stretched = int(scaling["factor"] * scaling["original_max_position_embeddings"])
            return max(self.max_position_embeddings, stretched)
        if scaling.get("rope_type") == "dynamic":
            return max(self.max_position_embeddings,
                       int(scaling["factor"] * self.max_position_embeddings))
        return self.max_position_embeddings

    def layer_attention(self, layer_idx: int) -> LayerAttention:
        """How layer `layer_idx` attends (scale, window, soft-capping)."""
        return LayerAttention(self.attention_scale, self.layer_window(layer_idx),
                              self.attn_logit_softcapping)

    @property
    def kv_window(self) -> int | None:
        """Where every layer has a window: its size, the most recent tokens any layer reads
        (the KV of older ones may be dropped); None where some layer reads the whole context."""
        if self.sliding_window is None or self.full_attention_layers:
            return None
        return self.sliding_window

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
        num_layers = integer("num_hidden_layers")
        rope_config, local_rope_theta = _gemma3_rope(config, architecture, source)
        rope_theta, rope_scaling = _rope_fields(rope_config, source, head_dim)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        llama_bias = bool(config.get("attention_bias", False)) and not is_qwen2
        window, full_layers = _sliding_window(config, architecture, num_layers, source)
        return cls(
            architecture=architecture,
            num_layers=num_layers,
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
            sliding_window=window,
            full_attention_layers=full_layers,
            hidden_act=_activation(config, architecture, source),
            local_rope_theta=local_rope_theta,
            moe=_moe(config, architecture, num_layers, source),
            **_gemma_fields(config, architecture, source),
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
    if config.get("mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor "
                         f"{config['partial_rotary_factor']} (partial RoPE) is not supported")
    return architecture


def _activation(config: dict[str, Any], architecture: str, source: str) -> str:
    # Gemma names it `hidden_activation` (transformers reads only that one for Gemma 2 and 3).
    name = "hidden_activation" if architecture in _GEMMAS else "hidden_act"
    default = "gelu_pytorch_tanh" if architecture in _GEMMAS else "silu"
    activation = config.get(name) or default
    if activation not in ACTIVATIONS:
        raise ValueError(f"{source}: unsupported {name} {activation!r}; "
                         f"supported: {', '.join(ACTIVATIONS)}")
    return str(activation)


def _moe(config: dict[str, Any], architecture: str, num_layers: int, source: str
         ) -> MoESpec | None:
    """Qwen3-MoE's experts: `num_experts` (transformers 5: `num_local_experts`) of
    `moe_intermediate_size`, in every `decoder_sparse_step`-th layer but `mlp_only_layers`."""
    if architecture != "Qwen3MoeForCausalLM":
        return None

    def positive(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{source}: field {name!r} must be a positive integer")
        return value

    num_experts = positive("num_experts",
                           config.get("num_experts") or config.get("num_local_experts"))
    per_token = positive("num_experts_per_tok", config.get("num_experts_per_tok"))
    if per_token > num_experts:
        raise ValueError(f"{source}: num_experts_per_tok ({per_token}) exceeds num_experts "
                         f"({num_experts})")
    step = positive("decoder_sparse_step", config.get("decoder_sparse_step", 1))
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"{source}: field 'mlp_only_layers' must list layer numbers")
    layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoESpec(num_experts, per_token,
                   positive("moe_intermediate_size", config.get("moe_intermediate_size")),
                   bool(config.get("norm_topk_prob", False)), layers)


def _gemma_fields(config: dict[str, Any], architecture: str, source: str) -> dict[str, Any]:
    """Gemma's query scale and soft-capping (empty for other families)."""
    if architecture not in _GEMMAS:
        return {}
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention (an encoder) is not supported")
    fields: dict[str, Any] = {}
    for name, default in _GEMMA_DEFAULTS[architecture].items():
        value = config.get(name, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or value <= 0):
            raise ValueError(f"{source}: field {name!r} must be a positive number or null")
        fields[name] = None if value is None else float(value)
    return fields


def _gemma3_rope(config: dict[str, Any], architecture: str, source: str
                 ) -> tuple[dict[str, Any], float | None]:
    """Gemma 3's two RoPEs: (the config with the global layers' RoPE fields, the local layers'
    base), from transformers 5's `rope_parameters` per layer type or transformers 4's
    `rope_theta` / `rope_scaling` (global) and `rope_local_base_freq` (local)."""
    if architecture != "Gemma3ForCausalLM":
        return config, None
    params = config.get("rope_parameters") or {}
    if "full_attention" not in params and "sliding_attention" not in params:
        return config, float(config.get("rope_local_base_freq", 10000.0))
    local = dict(params.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_parameters.sliding_attention: only the default RoPE "
                         f"is supported for the local layers, got {local['rope_type']!r}")
    glob = {"rope_theta": 1_000_000.0, **(params.get("full_attention") or {})}
    return ({**config, "rope_parameters": glob},
            float(local.get("rope_theta", config.get("rope_local_base_freq", 10000.0))))


def _rope_fields(
    config: dict[str, Any], source: str, head_dim: int
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from either config generation; scaling keeps `rope_type`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # checked (== 1) with the architecture
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type in ("su", "yarn") and config.get("architectures", [None])[0] == "Phi3ForCausalLM":
        rope_type = "longrope"  # Phi-3's old names for it, as transformers reads them
    if rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(f"{source}: unsupported rope_scaling type {rope_type!r}; "
                         f"supported: {', '.join(ROPE_SCALING_KEYS)}")
    if rope_type == "default":
        return theta, None
    if rope_type in ("longrope", "yarn"):  # Phi-3 keeps it beside rope_scaling, at the top
        params.setdefault("original_max_position_embeddings",  # level; YaRN's default is the
                          config.get("original_max_position_embeddings")  # model's context
                          or (config.get("max_position_embeddings") if rope_type == "yarn"
                              else None))
    if rope_type in ("longrope", "dynamic"):
        params.setdefault("max_position_embeddings", config.get("max_position_embeddings"))
    missing = [name for name in ROPE_SCALING_KEYS[rope_type] if params.get(name) is None]
    if missing:
        raise ValueError(f"{source}: rope_scaling ({rope_type}) lacks {', '.join(missing)}")
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = params[name]
            if not isinstance(factors, list) or len(factors) != head_dim // 2:
                raise ValueError(f"{source}: rope_scaling {name} must be a list of "
                                 f"head_dim / 2 = {head_dim // 2} numbers")
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(
    config: dict[str, Any], architecture: str, num_layers: int, source: str
) -> tuple[int | None, frozenset[int]]:
    """(the window, the layers without one) as transformers applies the config's fields."""
    if architecture in _OPT_IN_WINDOWS and not config.get("use_sliding_window", False):
        return None, frozenset()
    window = config.get("sliding_window")
    if window is None or architecture == "LlamaForCausalLM":
        return None, frozenset()
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"{source}: field 'sliding_window' must be a positive integer or null")
    if architecture in _EVERY_LAYER_WINDOWS:
        return window, frozenset()
    layer_types = config.get("layer_types")
    if layer_types is None:  # transformers' defaults when the config does not list them
        if architecture in _GEMMAS:  # Gemma 2: local, global, ...; Gemma 3: 5 local, 1 global
            pattern = 2 if architecture == "Gemma2ForCausalLM" else int(
                config.get("sliding_window_pattern", 6))
            layer_types = [_LAYER_TYPES[int((i + 1) % pattern == 0)] for i in range(num_layers)]
        else:
            first = int(config.get("max_window_layers", 0) or 0)
            layer_types = [_LAYER_TYPES[int(i < first)] for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or any(t not in _LAYER_TYPES for t in layer_types)):
        raise ValueError(f"{source}: field 'layer_types' must list one of "
                         f"{', '.join(_LAYER_TYPES)} per layer ({num_layers})")
    full = frozenset(i for i, t in enumerate(layer_types) if t == "full_attention")
    return (window, full) if len(full) < num_layers else (None, frozenset())
