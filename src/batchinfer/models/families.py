"""Which module computes each supported architecture (`config.json`'s `architectures[0]`)."""

from __future__ import annotations

from batchinfer.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from batchinfer.models.llama import LlamaForCausalLM
from batchinfer.models.phi3 import Phi3ForCausalLM
from batchinfer.models.qwen3 import Qwen3ForCausalLM
from batchinfer.models.qwen3_moe import Qwen3MoeForCausalLM
from batchinfer.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM]:
    """The module for `spec.architecture`; `ValueError` listing the supported ones."""
    cls = MODEL_CLASSES.get(spec.architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {spec.architecture!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return cls
