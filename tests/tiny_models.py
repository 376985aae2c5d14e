"""Tiny random Hugging Face models (and a matching tokenizer) saved into a folder, for tests.

`make_tiny_llama(tmp_path)` writes config.json, model.safetensors, generation_config.json,
tokenizer.json and tokenizer_config.json (with a ChatML chat template and eos token), so that
`transformers.AutoModelForCausalLM.from_pretrained(path)`, `AutoTokenizer.from_pretrained(path)`
and `batchinfer.models.load_model(str(path), ...)` all load it. `make_tiny_gguf` writes the same kind
of model as a llama.cpp-style GGUF file (Q/K rows permuted, one tensor kind quantized). Weights are drawn with a wide
spread (std 0.2, norm weights in [0.5, 1.5], random biases) so attention is sharp and a wrong
mapping, permutation or RoPE changes the logits well beyond float32 noise.

`dense_attention` and `DenseCache` are reference `AttentionFn`s (plain SDPA, no paging) to run
`LlamaForCausalLM.forward` without the runner.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from batchinfer.models import AttentionFn
from batchinfer.models.spec import LayerAttention

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "the quick brown fox jumps over the lazy dog, then the dog sleeps",
    "Hello world! How are you today? I am fine, thank you.",
    "batching many requests at once makes the hardware do one large job",
    "attention is all you need; rotary position embeddings rotate pairs",
] * 4

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
            "qwen3": Qwen3Config, "phi3": Phi3Config, "gemma2": Gemma2Config,
            "gemma3": Gemma3TextConfig, "qwen3_moe": Qwen3MoeConfig}


def make_tiny_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences: every byte encodes, specials are 0..2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_llama(tmp_path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random `arch` (a key of `_CONFIGS`: "llama", "qwen2", "qwen3", ...) model,
    built with transformers' own config class; returns its folder.

    Defaults: 2 layers, hidden 64, 4 heads, 2 KV heads (head_dim 16), intermediate 128,
    vocab 300, max_position_embeddings 512. `overrides` go into the transformers config
    (e.g. `tie_word_embeddings=True`, `rope_scaling={...}`, `attention_bias=True`).
    """
    if arch not in _CONFIGS:
        raise ValueError(f"arch {arch!r}: expected one of {', '.join(_CONFIGS)}")
    folder = tmp_path / f"tiny-{arch}"
    folder.mkdir(parents=True, exist_ok=True)
    params: dict[str, Any] = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "tie_word_embeddings": False,
    }
    if arch == "mistral":
        params["sliding_window"] = None
    if arch == "phi3":
        params["pad_token_id"] = 0
    if arch in ("gemma2", "gemma3"):  # Gemma's defaults are a real model's: made tiny here
        params.update(head_dim=16, query_pre_attn_scalar=24, sliding_window=4096, pad_token_id=0)
    if arch == "qwen3_moe":  # 8 experts of 32, two per token
        params.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    params.update(overrides)
    config = _CONFIGS[arch](**params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model)
    model.save_pretrained(folder)
    # A list eos in generation_config.json, as Llama 3 ships: <|endoftext|> also stops.
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_TOKEN_ID, "eos_token_id": [EOS_TOKEN_ID, 0]})
    )
    make_tiny_tokenizer(config.vocab_size).save_pretrained(folder, save_jinja_files=False)
    return folder


def round_weights_like(model_dir: Path, rounded_dir: Path, quantization: str) -> None:
    """Copy `model_dir` into `rounded_dir` with the decoder layers' projections rounded as
    `quantization` ("q8" | "q4") stores them, the reference its kernels must match. The LM
    head is first put on Q8_0's grid in BOTH folders, so every form a head may take holds it
    exactly (as the embedded GGUF's head is)."""
    from batchinfer.models.linear_kernels import dequantize_q4, quantize_q4
    from batchinfer.native.linear import quantize_q8

    def q8(tensor: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_q8(tensor.float())
        return (q.float() * scale[..., None]).flatten(1)

    rounded = {"q8": q8, "q4": lambda t: dequantize_q4(*quantize_q4(t.float()))}[quantization]
    rounded_dir.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            (rounded_dir / path.name).write_bytes(path.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    tensors["lm_head.weight"] = q8(tensors["lm_head.weight"])
    save_file(tensors, model_dir / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):  # the decoder layers'
            tensors[name] = rounded(tensor).to(tensor.dtype)
    save_file(tensors, rounded_dir / "model.safetensors")


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.5, 1.5)
        else:
            param.normal_(0.0, 0.2)


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# What llama.cpp's converter names differently per family (the HF family of make_tiny_llama),
# and its GGUF architecture name.
_GGUF_FAMILY_NAMES = {
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "gemma2": {"post_attention_layernorm": "attn_post_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "qwen3_moe": {"mlp.gate": "ffn_gate_inp"},
}
_GGUF_FAMILY_NAMES["gemma3"] = _GGUF_FAMILY_NAMES["gemma2"]
_GGUF_ARCH = {"qwen3_moe": "qwen3moe"}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The Q/K row permutation of llama.cpp's `convert_hf_to_gguf.py` (LlamaModel.permute)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def make_tiny_gguf(
    tmp_path: Path, seed: int = 0, rope_freqs: np.ndarray | None = None, arch: str = "llama",
    **overrides: Any
) -> tuple[Path, Path]:
    """A tiny `arch` (a family of `make_tiny_llama`) model written as a GGUF the way
    llama.cpp's converter does; (gguf, HF folder).

    Tensors are float32 except `blk.*.ffn_down` (and a MoE's `ffn_down_exps`), stored as Q8_0
    (so those differ from the HF folder by the Q8_0 rounding); a Llama's Q/K rows are permuted
    as llama.cpp permutes them, Gemma's norm weights stored plus one, a MoE layer's experts
    stacked into one 3-D tensor per projection. The tokenizer is stored as llama.cpp's "gpt2"
    BPE metadata, with the ChatML chat template. `rope_freqs` adds llama.cpp's Llama-3
    `rope_freqs.weight`.
    """
    folder = make_tiny_llama(tmp_path, arch, seed=seed, **overrides)
    config = json.loads((folder / "config.json").read_text())
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    path = tmp_path / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(path, arch=_GGUF_ARCH.get(arch, arch))
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _add_family_keys(writer, arch, config)
    _add_tokenizer(writer, tokenizer_json)
    tensors = load_file(folder / "model.safetensors")
    for name, tensor in _stack_experts(tensors).items():
        weight = tensor.numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            weight = weight + 1.0  # as llama.cpp's Gemma converter stores the norms
        _add_tensor(writer, name, weight, config, permute=arch == "llama",
                    names={**_GGUF_LAYER_NAMES, **_GGUF_FAMILY_NAMES.get(arch, {})})
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, folder


def _add_family_keys(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    """The keys llama.cpp's converter writes for this family alone."""
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])
    if arch.startswith("gemma"):  # Gemma's GGUFs name an unknown token (its tokenizer needs one)
        writer.add_unk_token_id(0)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    scaling = config.get("rope_parameters") or {}
    if arch == "phi3" and scaling.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 does
        original = config["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(
            1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        for name in ("long", "short"):
            writer.add_tensor(f"rope_factors_{name}.weight",
                              np.array(scaling[f"{name}_factor"], dtype=np.float32))
    if arch == "qwen3_moe":
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A MoE layer's `mlp.experts.E.{gate,up,down}_proj.weight` stacked into one
    `[experts, out, in]` tensor each, named `mlp.experts.{gate,up,down}_exps.weight`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if "experts" in parts:
            at = parts.index("experts")
            stacked = ".".join([*parts[:at], "experts", parts[at + 2].replace("proj", "exps"),
                                parts[-1]])
            experts.setdefault(stacked, []).append((int(parts[at + 1]), tensor))
        else:
            out[name] = tensor
    for name, members in experts.items():
        out[name] = torch.stack([t for _, t in sorted(members, key=lambda m: m[0])])
    return out


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer_json: dict[str, Any]) -> None:
    vocab = tokenizer_json["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    special = set(SPECIAL_TOKENS)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([" ".join(pair) for pair in tokenizer_json["model"]["merges"]])
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add_tensor(
    writer: gguf.GGUFWriter, hf_name: str, weight: np.ndarray, config: dict[str, Any],
    permute: bool, names: dict[str, str] = _GGUF_LAYER_NAMES,
) -> None:
    if hf_name == "model.embed_tokens.weight":
        name = "token_embd.weight"
    elif hf_name == "model.norm.weight":
        name = "output_norm.weight"
    elif hf_name == "lm_head.weight":
        name = "output.weight"
    else:
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        short = ("ffn_" + module.rpartition(".")[2] if module.startswith("mlp.experts.")
                 else names[module])
        name = f"blk.{layer}.{short}.{kind}"
    if permute and ".attn_q." in name:
        weight = llama_cpp_permute(weight, config["num_attention_heads"])
    elif permute and ".attn_k." in name:
        weight = llama_cpp_permute(weight, config["num_key_value_heads"])
    if ".ffn_down." in name or ".ffn_down_exps." in name:
        qtype = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, np.ascontiguousarray(weight, dtype=np.float32))


# Reference attention callables for LlamaForCausalLM.forward (no paging, plain SDPA).


def dense_attention(boundaries: list[tuple[int, int]],
                    layers: Sequence[LayerAttention] = ()) -> AttentionFn:
    """Causal attention within each [start, end) of the flat batch; no attention across them.
    `layers` (one per layer) gives each its scale, window and soft-cap (default: plain)."""

    def attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        group = q.shape[1] // k.shape[1]
        layer = layers[layer_idx] if layers else LayerAttention(q.shape[-1] ** -0.5)
        out = torch.empty_like(q)
        for start, end in boundaries:
            qs = q[start:end].transpose(0, 1)  # [heads, len, d]
            ks = k[start:end].repeat_interleave(group, dim=1).transpose(0, 1)
            vs = v[start:end].repeat_interleave(group, dim=1).transpose(0, 1)
            scores = qs @ ks.transpose(1, 2) * layer.scale  # [heads, len, len]
            if layer.softcap is not None:
                scores = torch.tanh(scores / layer.softcap) * layer.softcap
            positions = torch.arange(end - start)
            hidden = positions[None, :] > positions[:, None]
            if layer.window is not None:
                hidden |= positions[None, :] <= positions[:, None] - layer.window
            probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
            out[start:end] = (probs @ vs).transpose(0, 1)
        return out

    return attention


class DenseCache:
    """One sequence's K/V kept per layer, so it can be fed in chunks (prefill, then decode)."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if layer_idx in self.keys:
            k = torch.cat([self.keys[layer_idx], k])
            v = torch.cat([self.values[layer_idx], v])
        self.keys[layer_idx], self.values[layer_idx] = k, v
        num_new, num_ctx, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
        query_positions = torch.arange(num_ctx - num_new, num_ctx)[:, None]
        mask = torch.arange(num_ctx)[None, :] <= query_positions  # [new, ctx]
        ks = k.repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v.repeat_interleave(group, dim=1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), ks, vs, attn_mask=mask)
        return out.transpose(0, 1)
