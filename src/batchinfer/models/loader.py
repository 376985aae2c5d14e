"""`load_model`: a `--model` string -> model in eval mode + spec + tokenizer + stop tokens.

Every source ends up as a Hugging Face folder (a GGUF is converted into one, once, in the
cache), and the folder path is the only loading path: `config.json` -> `ModelSpec`, safetensors
(single file or sharded) -> fused parameters built on the meta device and assigned in place, so
no random initialisation and no second copy of the weights is ever made.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from batchinfer.core.paths import default_cache_dir
from batchinfer.models.families import model_class
from batchinfer.models.files import read_json
from batchinfer.models.gguf import FLOAT_WEIGHTS, WeightFormat, convert_gguf, weight_format
from batchinfer.models.hub import resolve_source
from batchinfer.models.llama import LlamaForCausalLM
from batchinfer.models.registry import SourceKind
from batchinfer.models.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready to run: `model` is in eval mode with `requires_grad=False` everywhere."""

    model: LlamaForCausalLM
    spec: ModelSpec
    tokenizer: PreTrainedTokenizerFast
    eos_token_ids: frozenset[int]
    path: Path  # the Hugging Face folder actually loaded (the cache folder for a GGUF)
    name: str  # the model id to show
    # How the checkpoint stores its decoder layers' matrices (`--quantization auto` keeps a
    # quantized one in its own form where that measures faster); a folder's are floats.
    stored: WeightFormat = FLOAT_WEIGHTS


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Where a model's weights are, before loading: the Hugging Face folder to load (a GGUF's
    conversion), the name to show, and how its decoder layers' matrices are stored."""

    folder: Path
    name: str
    stored: WeightFormat


def locate_checkpoint(model: str, cache_dir: Path | None = None, *,
                      revision: str | None = None, gguf_file: str | None = None) -> Checkpoint:
    """`"default"`, a Hugging Face folder, a `.gguf` file or a hub id (`org/name`, at
    `revision`; `gguf_file`: one `.gguf` in the repo) made ready to load; `ValueError` on bad
    input. A hub id is fetched into the Hugging Face cache first (`models.hub`). A GGUF is
    converted into `cache_dir` (default `default_cache_dir()`) once; later calls reuse that
    folder."""
    source = resolve_source(model, revision, gguf_file)
    if source.kind is not SourceKind.GGUF:
        return Checkpoint(source.path, source.name, FLOAT_WEIGHTS)
    folder = convert_gguf(source.path, cache_dir or default_cache_dir())
    return Checkpoint(folder, source.name, weight_format(source.path, folder))


def load_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device | str,
    cache_dir: Path | None = None,
    *,
    revision: str | None = None,
    gguf_file: str | None = None,
) -> LoadedModel:
    """Load `model` (as `locate_checkpoint` takes it): weights cast to `dtype` and placed on
    `device`."""
    return load_checkpoint(locate_checkpoint(model, cache_dir, revision=revision,
                                             gguf_file=gguf_file), dtype, device)


def load_checkpoint(checkpoint: Checkpoint, dtype: torch.dtype,
                    device: torch.device | str) -> LoadedModel:
    """Load a located checkpoint: weights cast to `dtype` and placed on `device`."""
    folder = checkpoint.folder
    config = read_json(folder / "config.json")
    spec = ModelSpec.from_hf_config(config, source=os.fspath(folder / "config.json"))
    net = load_weights(folder, spec, dtype, torch.device(device))
    tokenizer = load_tokenizer(folder)
    generation_config = read_json(folder / "generation_config.json", required=False)
    eos_token_ids = _eos_token_ids(config, generation_config, tokenizer)
    return LoadedModel(net, spec, tokenizer, eos_token_ids, folder, checkpoint.name,
                       checkpoint.stored)


def load_weights(
    folder: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """Build the model (the module `spec.architecture` names) on the meta device and assign
    the (fused, cast, moved) checkpoint."""
    with torch.device("meta"):
        model = model_class(spec)(spec)
    tensor_files = _tensor_files(folder)
    state: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def read(hf_name: str) -> torch.Tensor:
            file = tensor_files.get(hf_name)
            if file is None:
                raise ValueError(f"{folder}: tensor {hf_name!r} is missing from the checkpoint")
            if file not in handles:
                handles[file] = stack.enter_context(_open_safetensors(file))
            try:
                return handles[file].get_tensor(hf_name)
            except SafetensorError as exc:
                raise ValueError(f"{file}: cannot read tensor {hf_name!r} ({exc})") from exc

        for name, param in model.named_parameters():
            parts = [read(hf_name) for hf_name in model.checkpoint_names(name)]
            # Always a fresh tensor on `device` (`cat` makes one, `copy=True` the other): a tensor
            # read as is would keep the file's memory map (and every page of it the process
            # touched) resident while it lives.
            tensor = (
                torch.cat([part.to(device=device, dtype=dtype) for part in parts])
                if len(parts) > 1
                else parts[0].to(device=device, dtype=dtype, copy=True)
            )
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{folder}: tensor(s) {', '.join(model.checkpoint_names(name))} have shape "
                    f"{tuple(tensor.shape)}, config.json implies {tuple(param.shape)}"
                )
            state[name] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # the RoPE tables, built on CPU
    model.requires_grad_(False)
    return model.eval()


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (one file or sharded)."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: field 'weight_map' is missing")
        files = {name: folder / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise ValueError(f"{index_path}: shard {file.name} does not exist")
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(
            f"{folder}: no model.safetensors or model.safetensors.index.json "
            "(only safetensors weights are supported)"
        )
    with _open_safetensors(single) as handle:
        return dict.fromkeys(handle.keys(), single)


def _open_safetensors(file: Path) -> Any:
    # safe_open validates the header against the file size, so truncation is caught here.
    try:
        return safe_open(os.fspath(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{file}: not a valid safetensors file ({exc})") from exc


def load_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """The folder's fast tokenizer (and chat template); `ValueError` naming the folder."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(folder))
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
        raise ValueError(f"{folder}: cannot load the tokenizer ({exc})") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{folder}: tokenizer is not a fast (tokenizer.json) tokenizer")
    # The engine encodes on worker threads while the event loop decodes. With truncation or
    # padding set in tokenizer.json, each encode would reset them on the shared Rust tokenizer
    # (a mutable borrow) and a concurrent decode fails with "Already borrowed": turn them off
    # once, here. Prompts are never truncated or padded anyway.
    tokenizer.backend_tokenizer.no_truncation()
    tokenizer.backend_tokenizer.no_padding()
    return tokenizer


def _eos_token_ids(
    config: dict[str, Any], generation_config: dict[str, Any], tokenizer: PreTrainedTokenizerFast
) -> frozenset[int]:
    """Union of the eos ids in generation_config.json, config.json (int or list) and tokenizer."""
    ids: set[int] = set()
    for value in (generation_config.get("eos_token_id"), config.get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
