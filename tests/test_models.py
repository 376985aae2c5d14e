"""The Llama-family model and the HF-folder loader, against transformers on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from batchinfer.models import LlamaForCausalLM, ModelSpec, load_model
from tests.tiny_models import EOS_TOKEN_ID, DenseCache, dense_attention, make_tiny_llama

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the tiny model's (head_dim 16) slow frequencies really get rescaled.
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "tied-qkv-bias": ("llama", {"tie_word_embeddings": True, "attention_bias": True}),
    "mha-theta": ("llama", {"num_key_value_heads": 4, "rope_theta": 500.0}),
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def hf_logits(folder: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def our_logits(model: LlamaForCausalLM, sequences: list[torch.Tensor]) -> torch.Tensor:
    """Logits of several sequences run as ONE flat batch."""
    boundaries, start = [], 0
    for seq in sequences:
        boundaries.append((start, start + len(seq)))
        start += len(seq)
    input_ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(len(seq)) for seq in sequences])
    with torch.inference_mode():
        hidden = model(input_ids, positions, dense_attention(boundaries))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    folder = make_tiny_llama(tmp_path, arch, **overrides)
    loaded = load_model(str(folder), torch.float32, "cpu")
    prompt = torch.tensor(loaded.tokenizer("The capital of France is").input_ids)
    other = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(1))

    ours = our_logits(loaded.model, [prompt, other])
    assert ours.dtype == torch.float32
    assert ours.shape == (len(prompt) + len(other), loaded.spec.vocab_size)
    expected = torch.cat([hf_logits(folder, prompt), hf_logits(folder, other)])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_decode_match_full_sequence(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, "qwen2", rope_scaling=LLAMA3_ROPE, attention_bias=True)
    model = load_model(str(folder), torch.float32, "cpu").model
    ids = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(2))
    expected = hf_logits(folder, ids)

    cache, chunks = DenseCache(), [(0, 40), (40, 75), *[(i, i + 1) for i in range(75, 90)]]
    with torch.inference_mode():
        for start, end in chunks:
            hidden = model(ids[start:end], torch.arange(start, end), cache)
            torch.testing.assert_close(
                model.compute_logits(hidden), expected[start:end], atol=1e-4, rtol=1e-4
            )


def test_loaded_model_fields(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, "llama")
    loaded = load_model(str(folder), torch.float32, "cpu")
    assert loaded.name == "tiny-llama"
    assert loaded.path == folder
    assert loaded.eos_token_ids == frozenset({EOS_TOKEN_ID, 0})  # config + generation_config
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert loaded.spec == loaded.model.spec
    assert loaded.spec.num_kv_heads == 2 and loaded.spec.head_dim == 16
    # The tokenizer is the folder's tokenizer.json, chat template included.
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "  Hello world!\n<|im_end|> caf\u00e9"
    assert loaded.tokenizer(text).input_ids == raw.encode(text).ids
    chat = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# Our bfloat16 error against float32 may exceed transformers' own bfloat16 error by this factor at
# most. Greedy picks may differ from transformers' where float32's top two are closer than bf16
# noise; what a numerical bug changes is the SIZE of the error (RMSNorm computed in bf16: ~1.2x;
# RoPE angles in bf16: ~9x; docs/architecture.md, "bfloat16 accuracy").
BF16_SLACK = 1.15


@pytest.mark.parametrize("case", ["llama", "qwen2", "tied-qkv-bias", "llama3-rope"])
def test_bfloat16_error_within_transformers_bfloat16(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    folder = make_tiny_llama(tmp_path, arch, num_hidden_layers=4, **overrides)
    loaded = load_model(str(folder), torch.bfloat16, "cpu")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.rope_cos.dtype == torch.float32
    ids = torch.randint(3, 300, (400,), generator=torch.Generator().manual_seed(4))
    reference = hf_logits(folder, ids)
    ours = our_logits(loaded.model, [ids])
    assert ours.dtype == torch.float32

    def error(logits: torch.Tensor) -> float:
        return ((logits - reference).norm() / reference.norm()).item()

    theirs = error(hf_logits(folder, ids, torch.bfloat16))
    assert error(ours) <= BF16_SLACK * theirs, f"bf16 error {error(ours):.4f} vs {theirs:.4f}"


def test_sharded_checkpoint(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, "llama")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((folder / name).read_bytes())
    single = load_model(str(folder), torch.float32, "cpu").model.state_dict()
    shards = load_model(str(sharded), torch.float32, "cpu").model.state_dict()
    assert single.keys() == shards.keys()
    for name in single:
        assert torch.equal(single[name], shards[name]), name


def test_unknown_path() -> None:
    with pytest.raises(ValueError, match="no such file or folder; expected 'default'"):
        load_model("/nonexistent/model", torch.float32, "cpu")


def test_missing_config(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, "llama")
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        load_model(str(folder), torch.float32, "cpu")


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"config\.json: unsupported architecture 'GPT2LMHeadModel'"
    ):
        load_model(str(folder), torch.float32, "cpu")


# A small valid Llama config.json, for tests that change one field.
MINIMAL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "vocab_size": 300,
    "max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rope_parameters", {"rope_type": "proportional", "factor": 4.0},
         "rope_scaling type 'proportional'"),
        ("hidden_act", "gelu", "hidden_act"),
        ("num_key_value_heads", 3, "not a multiple of num_key_value_heads"),
        ("num_hidden_layers", None, "'num_hidden_layers'"),
    ],
)
def test_bad_config_fields(field: str, value: object, message: str) -> None:
    ModelSpec.from_hf_config(MINIMAL_CONFIG)  # the base config is valid
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config({**MINIMAL_CONFIG, field: value}, source="x/config.json")


def test_transformers4_rope_fields() -> None:
    config = {**MINIMAL_CONFIG, "rope_theta": 500000.0,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    spec = ModelSpec.from_hf_config(config)
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_truncated_safetensors(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, "llama")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        load_model(str(folder), torch.float32, "cpu")


def test_garbage_safetensors(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, "llama")
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        load_model(str(folder), torch.float32, "cpu")


def test_missing_tensor(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, "llama")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' is missing"
    ):
        load_model(str(folder), torch.float32, "cpu")


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gate_proj\.weight.*config\.json implies"):
        load_model(str(folder), torch.float32, "cpu")
