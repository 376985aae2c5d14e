"""Generative models and their loaders: the decoder families, HF folders, GGUF files."""

from batchinfer.models.hardware import resolve_device, resolve_dtype
from batchinfer.models.llama import AttentionFn, LlamaForCausalLM
from batchinfer.models.loader import LoadedModel, load_model
from batchinfer.models.spec import ModelSpec

__all__ = [
    "AttentionFn",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelSpec",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]
