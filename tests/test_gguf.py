"""GGUF -> HF folder conversion: a tiny llama.cpp-style GGUF of each family (quick) and the
embedded default."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from batchinfer import LLM, SamplingParams
from batchinfer.models import ModelSpec, load_model
from batchinfer.models import gguf as gguf_module
from batchinfer.models.registry import default_gguf_path
from batchinfer.models.rope import rope_tables
from tests.fresh_cache import fresh_cache
from tests.tiny_models import CHAT_TEMPLATE, EOS_TOKEN_ID, dense_attention, make_tiny_gguf


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def transformers_gguf_tensors(gguf_path: Path, hf_folder: Path) -> dict[str, torch.Tensor]:
    """The weights as transformers' own GGUF reader (its Llama Q/K un-permutation) gives them.

    `hf_folder` supplies the config for the parameter names only. (`from_pretrained(...,
    gguf_file=...)` would do the same but needs `accelerate`, which we do not install.)
    """
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_folder))
    parsed = load_gguf_checkpoint(os.fspath(gguf_path), return_tensors=True, model_to_load=skeleton)
    return parsed["tensors"]


def _expected_hf_tensors(gguf_path: Path, hf_folder: Path) -> dict[str, torch.Tensor]:
    """The original HF weights, with ffn_down rounded through Q8_0 as the GGUF stores it."""
    expected = load_file(hf_folder / "model.safetensors")
    reader = gguf.GGUFReader(gguf_path)
    for tensor in reader.tensors:
        if ".ffn_down." in tensor.name:
            layer = tensor.name.split(".")[1]
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            expected[f"model.layers.{layer}.mlp.down_proj.weight"] = torch.from_numpy(values)
    return expected


def test_tiny_gguf_converts_to_the_original_weights(tmp_path: Path) -> None:
    gguf_path, hf_folder = make_tiny_gguf(tmp_path)
    loaded = load_model(str(gguf_path), torch.float32, "cpu", cache_dir=tmp_path / "cache")
    assert loaded.name == "tiny-llama"
    assert loaded.path.parent == tmp_path / "cache" / "gguf"

    converted = load_file(loaded.path / "model.safetensors")
    expected = _expected_hf_tensors(gguf_path, hf_folder)
    assert converted.keys() == expected.keys()
    for name, tensor in expected.items():
        # Exact: Q/K rows un-permuted back to HF order, everything else renamed.
        assert torch.equal(converted[name], tensor), name

    original = json.loads((hf_folder / "config.json").read_text())
    spec = loaded.spec
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size) == (2, 64, 128)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (4, 2, 16, 300)
    assert spec.rope_theta == original["rope_parameters"]["rope_theta"]
    assert spec.rms_norm_eps == pytest.approx(original["rms_norm_eps"])
    assert spec.max_position_embeddings == original["max_position_embeddings"]
    assert not spec.tie_word_embeddings
    assert EOS_TOKEN_ID in loaded.eos_token_ids

    # The tokenizer rebuilt from GGUF metadata encodes like the original tokenizer.json.
    raw = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    for text in ["The capital of France is", "  Hello world!\n<|im_end|> caf\u00e9 ", "x"]:
        assert loaded.tokenizer(text).input_ids == raw.encode(text).ids, text
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    config = json.loads((loaded.path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["eos_token"] == "<|im_end|>"


def test_tiny_gguf_matches_transformers_gguf_loader(tmp_path: Path) -> None:
    """transformers' own GGUF loader is an independent check of the Q/K un-permutation."""
    gguf_path, _ = make_tiny_gguf(tmp_path)
    loaded = load_model(str(gguf_path), torch.float32, "cpu", cache_dir=tmp_path / "cache")
    reference = transformers_gguf_tensors(gguf_path, loaded.path)
    converted = load_file(loaded.path / "model.safetensors")
    assert converted.keys() == reference.keys()
    for name, tensor in converted.items():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0, msg=name)

    ids = torch.tensor(loaded.tokenizer("The capital of France is").input_ids)
    with torch.inference_mode():
        hidden = loaded.model(ids, torch.arange(len(ids)), dense_attention([(0, len(ids))]))
        ours = loaded.model.compute_logits(hidden)
    expected = AutoModelForCausalLM.from_pretrained(loaded.path).eval()(ids[None]).logits[0]
    torch.testing.assert_close(ours, expected.detach(), atol=1e-4, rtol=1e-4)


def test_tiny_qwen3_gguf_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 GGUF (arch `qwen3`: Q/K rows as they are, the per-head `attn_q_norm` /
    `attn_k_norm`) converts back to the HF folder's weights (ffn_down: its Q8_0 rounding) and
    generates Hugging Face's greedy tokens on the converted folder."""
    fresh_cache(monkeypatch, tmp_path)
    gguf_path, hf_folder = make_tiny_gguf(tmp_path, arch="qwen3", head_dim=32)
    loaded = load_model(str(gguf_path), torch.float32, "cpu")
    assert loaded.spec.architecture == "Qwen3ForCausalLM" and loaded.spec.head_dim == 32
    converted = load_file(loaded.path / "model.safetensors")
    expected = _expected_hf_tensors(gguf_path, hf_folder)
    assert converted.keys() == expected.keys()
    assert "model.layers.1.self_attn.k_norm.weight" in converted
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name

    llm = LLM(str(gguf_path), dtype="float32", kv_cache_memory="16M")
    prompt = loaded.tokenizer("The capital of France is").input_ids
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    reference = AutoModelForCausalLM.from_pretrained(loaded.path).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()


def llama_cpp_rope_factors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """`rope_freqs.weight` as llama.cpp's converter writes it for Llama 3.1 (its own loop)."""
    low_freq_factor, high_freq_factor, old_context_len = 1.0, 4.0, 8192
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_context_len / high_freq_factor:
            factors.append(1.0)
        elif wavelen > old_context_len / low_freq_factor:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    # head_dim 16, theta 10000: wavelengths up to ~19900, so some pairs are scaled, one smoothed.
    factors = llama_cpp_rope_factors(16, 10000.0, factor=32.0)
    assert 1.0 < factors[-2] < 32.0 and factors[-1] == 32.0
    gguf_path, _ = make_tiny_gguf(tmp_path, rope_freqs=factors)
    loaded = load_model(str(gguf_path), torch.float32, "cpu", cache_dir=tmp_path / "cache")
    assert loaded.spec.rope_scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_unknown_rope_freqs(tmp_path: Path) -> None:
    gguf_path, _ = make_tiny_gguf(tmp_path, rope_freqs=np.linspace(1.0, 3.0, 8))
    with pytest.raises(ValueError, match=r"tiny-llama\.gguf: rope_freqs\.weight matches no known"):
        load_model(str(gguf_path), torch.float32, "cpu", cache_dir=tmp_path / "cache")


def test_second_load_reuses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path, _ = make_tiny_gguf(tmp_path)
    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "env-cache"))
    first = load_model(str(gguf_path), torch.float32, "cpu")
    assert first.path.parent == tmp_path / "env-cache" / "gguf"
    # Only the finished folder is left: the temporary one was renamed into place.
    assert os.listdir(first.path.parent) == [first.path.name]
    config_mtime = (first.path / "config.json").stat().st_mtime_ns

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_module, "write_hf_folder", no_conversion)
    second = load_model(str(gguf_path), torch.float32, "cpu")
    assert second.path == first.path
    assert (second.path / "config.json").stat().st_mtime_ns == config_mtime
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)

    # A changed file (new mtime) is a different cache entry.
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(AssertionError, match="converted again"):
        load_model(str(gguf_path), torch.float32, "cpu")


def test_failed_conversion_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path, _ = make_tiny_gguf(tmp_path)

    def broken_tokenizer(*args: object) -> None:
        raise ValueError("tokenizer exploded")

    monkeypatch.setattr(gguf_module, "_write_tokenizer", broken_tokenizer)
    with pytest.raises(ValueError, match="tokenizer exploded"):
        load_model(str(gguf_path), torch.float32, "cpu", cache_dir=tmp_path / "cache")
    assert os.listdir(tmp_path / "cache" / "gguf") == []


def test_garbage_gguf(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"this is not a gguf file" * 50)
    with pytest.raises(ValueError, match=r"broken\.gguf: not a valid GGUF file"):
        load_model(str(path), torch.float32, "cpu", cache_dir=tmp_path / "cache")


def test_truncated_gguf(tmp_path: Path) -> None:
    gguf_path, _ = make_tiny_gguf(tmp_path)
    data = gguf_path.read_bytes()
    gguf_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"tiny-llama\.gguf: not a valid GGUF file"):
        load_model(str(gguf_path), torch.float32, "cpu", cache_dir=tmp_path / "cache")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, arch="gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_model(str(path), torch.float32, "cpu", cache_dir=tmp_path / "cache")


def test_unpermute_inverts_llama_cpp_permute() -> None:
    from tests.tiny_models import llama_cpp_permute

    weight = torch.arange(8 * 16 * 3).reshape(8 * 16, 3).float()
    for num_heads in (1, 2, 8):
        permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), num_heads))
        assert not torch.equal(permuted, weight)
        assert torch.equal(gguf_module.unpermute_rows(permuted, num_heads), weight)


# The embedded SmolLM2-135M-Instruct (Q4_1). Converting it takes 15-40 s on a small CPU box, so
# every test of it is `slow` (`make test-slow`); the tiny GGUFs above cover conversion quickly.


@pytest.fixture(scope="module")
def default_model(tmp_path_factory: pytest.TempPathFactory):
    cache_dir = tmp_path_factory.mktemp("cache")
    return load_model("default", torch.float32, "cpu", cache_dir=cache_dir)


@pytest.mark.slow
def test_default_model_converts(default_model) -> None:
    spec = default_model.spec
    assert default_model.name == "SmolLM2-135M-Instruct"
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert (spec.head_dim, spec.intermediate_size, spec.vocab_size) == (64, 1536, 49152)
    assert spec.rope_theta == 100000.0 and spec.tie_word_embeddings
    assert 2 in default_model.eos_token_ids  # <|im_end|>
    chat = default_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(default_model) -> None:
    gguf_path = default_gguf_path()
    reference = transformers_gguf_tensors(gguf_path, default_model.path)
    converted = load_file(default_model.path / "model.safetensors")
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{layer}.self_attn.{proj}.weight"
        for layer in (0, 29)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    for name in names:
        torch.testing.assert_close(converted[name], reference[name], atol=1e-6, rtol=0, msg=name)

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in ["The capital of France is", "<|im_start|>user\nBonjour, \u00e7a va?<|im_end|>"]:
        assert default_model.tokenizer(text).input_ids == tokenizer(text).input_ids


@pytest.mark.slow
def test_default_model_greedy_decode_matches_transformers(default_model) -> None:
    """The engine (paged KV cache, continuous batching, three prompts in one batch) against
    Hugging Face `generate` one prompt at a time, on the converted embedded model."""
    prompts = ["The capital of France is", "def fibonacci(n):",
               "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]
    reference = AutoModelForCausalLM.from_pretrained(default_model.path, dtype=torch.float32)
    expected = []
    for prompt in prompts:
        ids = default_model.tokenizer(prompt).input_ids
        out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids)))
        expected.append(out[0, len(ids):].tolist())

    llm = LLM(str(default_model.path), dtype="float32", kv_cache_memory="64M")
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "Paris" in outs[0].outputs[0].text


# family -> make_tiny_llama overrides: each family's own tensors and keys in play (Gemma 3 has
# six layers so that its sixth, llama.cpp's fixed pattern, is global).
FAMILY_GGUFS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("qwen2", {}),
    "phi3": ("phi3", {"sliding_window": 12}),
    "phi3-longrope": ("phi3", {"original_max_position_embeddings": 64, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.0 + 0.9 * i for i in range(8)]}}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16, "sliding_window": 12,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0}),
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16, "sliding_window": 12,
                          "num_hidden_layers": 6, "rope_parameters": {
                              "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 10_000.0}}}),
    "qwen3-moe": ("qwen3_moe", {"norm_topk_prob": True}),
}


def _gguf_dequantized(gguf_path: Path, expected: dict[str, torch.Tensor]) -> None:
    """Replace in `expected` (HF names) the tensors the GGUF stores quantized by their
    dequantized values: the 2-D `ffn_down` and each expert of a `ffn_down_exps`."""
    for tensor in gguf.GGUFReader(gguf_path).tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        layer = tensor.name.split(".")[1]
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        if ".ffn_down_exps." in tensor.name:
            for expert, matrix in enumerate(values):
                expected[f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"] = matrix
        else:
            expected[f"model.layers.{layer}.mlp.down_proj.weight"] = values


@pytest.mark.parametrize("case", list(FAMILY_GGUFS))
def test_family_gguf_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 case: str) -> None:
    """A GGUF written as llama.cpp writes each family (its arch name, tensor names and keys;
    Gemma's norms plus one, a MoE's stacked experts) converts back to the HF folder's weights
    (the Q8_0 ones: their rounding) and config, and generates transformers' greedy tokens."""
    fresh_cache(monkeypatch, tmp_path)
    family, overrides = FAMILY_GGUFS[case]
    gguf_path, hf_folder = make_tiny_gguf(tmp_path, arch=family, **overrides)
    loaded = load_model(str(gguf_path), torch.float32, "cpu")
    original = ModelSpec.from_hf_config(json.loads((hf_folder / "config.json").read_text()))
    # GGUF keeps floats in float32: the epsilon, and the RoPE its tables are made of.
    assert loaded.spec.rms_norm_eps == pytest.approx(original.rms_norm_eps)
    for served in (64, 512):
        ours, theirs = (rope_tables(s.head_dim, s.rope_theta, s.rope_scaling, 512, served)
                        for s in (loaded.spec, original))
        for table, want in zip(ours, theirs, strict=True):
            torch.testing.assert_close(table, want, atol=1e-6, rtol=1e-6)
    assert dataclasses.replace(loaded.spec, rms_norm_eps=original.rms_norm_eps,
                               rope_scaling=original.rope_scaling) == original
    converted = load_file(loaded.path / "model.safetensors")
    expected = load_file(hf_folder / "model.safetensors")
    _gguf_dequantized(gguf_path, expected)
    assert converted.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(converted[name], tensor, atol=1e-6, rtol=0, msg=name)

    # LongRoPE takes its short factors for a server within its original context, as
    # transformers takes them for these short sequences.
    within = {"max_model_len": 64} if "longrope" in case else {}
    llm = LLM(str(gguf_path), dtype="float32", kv_cache_memory="16M", **within)
    prompt = loaded.tokenizer("The capital of France is a city").input_ids
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    reference = AutoModelForCausalLM.from_pretrained(loaded.path,
                                                     attn_implementation="eager").eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    assert ours == tokens[len(prompt):]
