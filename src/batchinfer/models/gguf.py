"""GGUF -> Hugging Face folder, converted once into a cache; every load then reads the folder.

A GGUF file holds (often quantized) tensors under llama.cpp's names and the config and
tokenizer as metadata. `convert_gguf` dequantizes every tensor to float32, renames it to the
Hugging Face name, undoes what llama.cpp's converter changed for each architecture
(`gguf_arch.py`: the Q/K row permutation of Llama, the one added to Gemma's norms, a MoE
layer's experts stacked in one tensor), rebuilds `config.json` from the `{arch}.*` keys and
the tokenizer (with its chat template) through transformers' GGUF tokenizer converter, and
writes it all as a plain folder. The folder is keyed by the file's name, size and mtime and appears atomically (written
to a temporary folder, then renamed), so a crash never leaves half a model in the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from batchinfer.models.files import write_cache_json
from batchinfer.models.gguf_arch import (
    ARCHITECTURES,
    EXPERT_TENSORS,
    GGUFArch,
    field_value,
    required,
)
from batchinfer.models.rope import rope_inverse_frequencies

logger = logging.getLogger(__name__)

# Bump when the folder layout changes, so older cache entries are not reused.
CONVERTER_VERSION = 1
SHARD_BYTES = 2 * 1024**3
# The converted folder's record of how the GGUF stored its matrices (`weight_format`).
STORED_FORMAT = "gguf_weight_format.json"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SPECIAL_TOKEN_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
# Llama 3.x GGUFs store their RoPE scaling as per-frequency divisors, not parameters.
_ROPE_FREQS = "rope_freqs.weight"


def cache_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """The folder this GGUF converts to: `cache_dir/gguf/<stem>-<hash of name, size, mtime>`."""
    stat = gguf_path.stat()
    key = f"{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}:v{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir / "gguf" / f"{gguf_path.stem}-{digest}"


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Return the Hugging Face folder for `gguf_path`, converting it on first use.

    `ValueError` naming the file for a corrupt or unsupported GGUF.
    """
    target = cache_folder(gguf_path, cache_dir)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        logger.info("converting %s into %s (once)", gguf_path, target)
        write_hf_folder(gguf_path, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process finished the same conversion first; its folder is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# The weight form (`--quantization`) that holds a GGUF tensor type: Q4_1 and Q8_0 exactly (the
# same grids: a block's integers come back unchanged), the other 1-4-bit types on q4's grid and
# the 5-8-bit ones on q8's (re-rounded: each block's values to the nearest point of the grid),
# floats as they are.
_EXACT_FORMS = {"Q4_1": "q4", "Q8_0": "q8"}
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_EIGHT_BIT_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_1", "Q8_K", "I8")


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """What a GGUF's decoder-layer matrices are stored as, and the form that holds them."""

    stored_type: str  # GGUF: the most common type of the `blk.*` matrices, e.g. "Q4_1"
    form: str  # "none", "q8" or "q4"
    exact: bool  # the form holds the stored values unchanged

    def describe(self) -> str:
        how = "exactly" if self.exact else "re-rounded to its grid"
        return f"{self.stored_type} ({self.form}, {how})" if self.form != "none" else self.stored_type


# A Hugging Face folder's matrices: floats (its own dtype), run as float weights.
FLOAT_WEIGHTS = WeightFormat("float", "none", True)


def weight_format(gguf_path: Path, folder: Path | None = None) -> WeightFormat:
    """The stored form of the decoder layers' matrices (their most common GGML type); read
    from `folder`'s `STORED_FORMAT` file, which the conversion wrote, where it has one
    (reading a GGUF's tensor index takes seconds), else written there once read."""
    if folder is not None:
        try:
            return WeightFormat(**json.loads((folder / STORED_FORMAT).read_text()))
        except (OSError, ValueError, TypeError):
            pass  # converted by an older version: read the GGUF
    stored = _weight_format(_open(gguf_path))
    if folder is not None:
        _write_weight_format(folder, stored)
    return stored


def _write_weight_format(folder: Path, stored: WeightFormat) -> None:
    write_cache_json(folder / STORED_FORMAT, {"stored_type": stored.stored_type,
                                              "form": stored.form, "exact": stored.exact},
                     "the weight format")


def _weight_format(reader: gguf.GGUFReader) -> WeightFormat:
    counts = Counter(tensor.tensor_type.name for tensor in reader.tensors
                     if tensor.name.startswith("blk.") and len(tensor.shape) >= 2)
    if not counts:
        return WeightFormat("F32", "none", True)
    ggml_type = counts.most_common(1)[0][0]
    if ggml_type in _EXACT_FORMS:
        return WeightFormat(ggml_type, _EXACT_FORMS[ggml_type], True)
    if ggml_type in _FLOAT_TYPES:
        return WeightFormat(ggml_type, "none", True)
    return WeightFormat(ggml_type, "q8" if ggml_type in _EIGHT_BIT_TYPES else "q4", False)


def write_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Write config, weights, tokenizer and generation config of `gguf_path` into `out_dir`."""
    reader = _open(gguf_path)
    config = _hf_config(reader, gguf_path)
    _write_weights(out_dir, _hf_tensors(reader, gguf_path, config))
    _write_tokenizer(gguf_path, out_dir)
    _write_weight_format(out_dir, _weight_format(reader))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if key in config
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _open(gguf_path: Path) -> gguf.GGUFReader:
    # The reader fails in many ways on a bad file (magic, version, truncation: ValueError,
    # IndexError, OSError, numpy errors), all meaning "not a readable GGUF".
    try:
        return gguf.GGUFReader(gguf_path)
    except Exception as exc:
        raise ValueError(f"{gguf_path}: not a valid GGUF file ({exc})") from exc


_field, _required = field_value, required


def _hf_config(reader: gguf.GGUFReader, gguf_path: Path) -> dict[str, Any]:
    """`config.json` contents from the GGUF's `{arch}.*` and `tokenizer.ggml.*` keys."""
    arch, family = _architecture(reader, gguf_path)
    hidden_size = _required(reader, f"{arch}.embedding_length", gguf_path)
    num_heads = _required(reader, f"{arch}.attention.head_count", gguf_path)
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv", num_heads)
    if not isinstance(num_kv_heads, int):
        raise ValueError(f"{gguf_path}: per-layer {arch}.attention.head_count_kv is unsupported")
    head_dim = _field(reader, f"{arch}.attention.key_length", hidden_size // num_heads)
    if _field(reader, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{gguf_path}: partial RoPE ({arch}.rope.dimension_count) is unsupported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    tensor_names = {tensor.name for tensor in reader.tensors}
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "num_hidden_layers": _required(reader, f"{arch}.block_count", gguf_path),
        "hidden_size": hidden_size,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _required(reader, f"{arch}.context_length", gguf_path),
        "vocab_size": len(tokens) if tokens else _required(reader, f"{arch}.vocab_size", gguf_path),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in _SPECIAL_TOKEN_KEYS.items():
        value = _field(reader, gguf_key)
        if value is not None:
            config[hf_key] = value
    if family.config is not None:
        config.update(family.config(reader, arch, gguf_path, config))
    if config["intermediate_size"] is None:
        raise ValueError(f"{gguf_path}: metadata key '{arch}.feed_forward_length' is missing")
    if "rope_scaling" not in config:
        rope_scaling = _rope_scaling(reader, gguf_path, arch, config)
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
    return config


def _architecture(reader: gguf.GGUFReader, gguf_path: Path) -> tuple[str, GGUFArch]:
    arch = _required(reader, "general.architecture", gguf_path)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return arch, ARCHITECTURES[arch]


def _rope_scaling(
    reader: gguf.GGUFReader, gguf_path: Path, arch: str, config: dict[str, Any]
) -> dict[str, Any] | None:
    """Linear or YaRN scaling from metadata, or Llama-3 scaling recognised from
    `rope_freqs`."""
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type in ("linear", "yarn"):
        factor = _required(reader, f"{arch}.rope.scaling.factor", gguf_path)
        scaling = {"rope_type": scaling_type, "factor": float(factor)}
        if scaling_type == "yarn":
            scaling["original_max_position_embeddings"] = _required(
                reader, f"{arch}.rope.scaling.original_context_length", gguf_path)
        return scaling
    if scaling_type != "none":
        raise ValueError(f"{gguf_path}: unsupported RoPE scaling type {scaling_type!r}")
    rope_freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if rope_freqs is None:
        return None
    divisors = torch.tensor(gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type))
    head_dim, theta = config["head_dim"], config["rope_theta"]
    plain = rope_inverse_frequencies(head_dim, theta, None)
    # The values Meta published for Llama 3.1 (factor 8) and 3.2 (factor 32).
    for factor in (8.0, 32.0, 16.0, 4.0):
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        scaled = rope_inverse_frequencies(head_dim, theta, scaling)
        if torch.allclose(plain / scaled, divisors.flatten(), rtol=1e-3):
            return scaling
    raise ValueError(f"{gguf_path}: {_ROPE_FREQS} matches no known Llama-3 RoPE scaling")


def _hf_tensors(
    reader: gguf.GGUFReader, gguf_path: Path, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight, dequantized, un-permuted, norms back to
    the checkpoint's values, experts one tensor each."""
    _, family = _architecture(reader, gguf_path)
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS or tensor.name in family.skipped:
            continue
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ValueError(f"{gguf_path}: cannot dequantize {tensor.name!r} ({exc})") from exc
        # F32 tensors come back as read-only views of the file; everything else is new.
        weight = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
        match = _LAYER_TENSOR_NAME.fullmatch(tensor.name)
        if match is not None and match[2] in EXPERT_TENSORS:  # [experts, out, in]
            for expert, matrix in enumerate(weight):
                yield (f"model.layers.{match[1]}.mlp.experts.{expert}."
                       f"{EXPERT_TENSORS[match[2]]}.{match[3]}", matrix)
            continue
        hf_name = _hf_name(tensor.name, gguf_path, family)
        if family.permuted and ".attn_q." in tensor.name:
            weight = unpermute_rows(weight, config["num_attention_heads"])
        elif family.permuted and ".attn_k." in tensor.name:
            weight = unpermute_rows(weight, config["num_key_value_heads"])
        if family.norm_offset and hf_name.endswith("norm.weight"):
            weight -= family.norm_offset
        yield hf_name, weight


def _hf_name(gguf_name: str, gguf_path: Path, family: GGUFArch) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in family.layer_tensors:
        raise ValueError(f"{gguf_path}: unexpected tensor {gguf_name!r}")
    return f"model.layers.{match[1]}.{family.layer_tensors[match[2]]}.{match[3]}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation, back to Hugging Face's "rotate_half" row order.

    llama.cpp interleaves each head's rows (pairs (i, i + d/2) become adjacent, rows 2i and
    2i+1); this puts them back in halves. Works on weights [rows, cols] and biases [rows].
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    heads = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return heads.transpose(1, 2).reshape(weight.shape).contiguous()


def _write_weights(out_dir: Path, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Save as `model.safetensors`, or as shards of ~SHARD_BYTES plus an index when larger."""
    shard_names: list[list[str]] = []  # tensor names of each shard written so far
    shard: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > SHARD_BYTES:
            _save_shard(out_dir, shard, len(shard_names))
            shard_names.append(list(shard))
            shard = {}
        shard[name] = tensor
    _save_shard(out_dir, shard, len(shard_names))
    shard_names.append(list(shard))
    num_shards = len(shard_names)
    if num_shards == 1:
        (out_dir / "shard-0.safetensors").rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shard_names):
        final = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        (out_dir / f"shard-{i}.safetensors").rename(out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save_shard(out_dir: Path, tensors: dict[str, torch.Tensor], number: int) -> None:
    save_file(tensors, os.fspath(out_dir / f"shard-{number}.safetensors"), {"format": "pt"})


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) via transformers."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            os.fspath(gguf_path.parent), gguf_file=gguf_path.name
        )
    except Exception as exc:
        raise ValueError(f"{gguf_path}: cannot build its tokenizer ({exc})") from exc
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(os.fspath(out_dir), save_jinja_files=False)
