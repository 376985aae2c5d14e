"""Generative models and their loaders: the Llama-family module, HF folders, GGUF files."""

from batchinfer.models.hardware import resolve_device, resolve_dtype
from batchinfer.models.llama import AttentionFn, LlamaForCausalLM, ModelSpec
from batchinfer.models.loader import LoadedModel, load_model

__all__ = [
    "AttentionFn",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelSpec",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]
