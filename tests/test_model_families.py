"""Each model family beyond Llama, on a tiny random model built with transformers' own config
class, against Hugging Face: logits of a flat batch, then `LLM.generate`'s greedy tokens and
top logprobs (whole prompts and chunked prefill), then quantized weights. GGUF round trips are
in test_gguf.py; sliding windows past their end (preemption, prefix caching) in
test_sliding_window_models.py."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchinfer import LLM, SamplingParams
from batchinfer.models import ModelSpec, load_model
from batchinfer.models.linear_kernels import KernelLinear
from batchinfer.runner.native_decode import NativeDecoder
from tests.fresh_cache import fresh_cache
from tests.tiny_models import dense_attention, make_tiny_llama, round_weights_like


@dataclass(frozen=True)
class Case:
    """A tiny model of `family` with these config `overrides`, served with these `LLM`
    keyword arguments, run on prompts of `min_len`..`max_len` tokens."""

    family: str
    overrides: dict[str, Any] = field(default_factory=dict)
    llm: dict[str, Any] = field(default_factory=dict)
    min_len: int = 5
    max_len: int = 60


def longrope(original: int) -> dict[str, Any]:
    """Phi-3's LongRoPE with distinct per-frequency factors (head_dim 16: 8 of each)."""
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 0.9 * i for i in range(8)],
            "original_max_position_embeddings": original}


GEMMA3_LAYERS: dict[str, Any] = {
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 1_000_000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
}
CASES = {
    "qwen3": Case("qwen3"),
    # head_dim set apart from hidden / heads (64 / 4), as Qwen3 checkpoints do
    "qwen3-head32-bias-tied": Case("qwen3", {"head_dim": 32, "attention_bias": True,
                                             "tie_word_embeddings": True}),
    "phi3": Case("phi3"),
    # LongRoPE, served within its original context (64): its short factors, as transformers
    # takes them for sequences of 64 tokens or fewer...
    "phi3-longrope-short": Case("phi3", {"rope_scaling": longrope(64),
                                         "original_max_position_embeddings": 64},
                                llm={"max_model_len": 64}, max_len=50),
    # ... and beyond it (max_model_len 512): its long factors, as transformers takes them for
    # sequences longer than 64 tokens.
    "phi3-longrope-long": Case("phi3", {"rope_scaling": longrope(64),
                                        "original_max_position_embeddings": 64},
                               min_len=70, max_len=120),
    # YaRN (its original context 64 stretched 4x), and dynamic NTK within its context
    "qwen3-yarn": Case("qwen3", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}}),
    "qwen3-dynamic": Case("qwen3", {"rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
                          llm={"max_model_len": 512}),
    # Gemma 2: local (window 12) and global layers, soft-caps small enough to bite
    "gemma2": Case("gemma2", {"sliding_window": 12, "attn_logit_softcapping": 2.0,
                              "final_logit_softcapping": 5.0}),
    "gemma2-tied": Case("gemma2", {"sliding_window": 12, "tie_word_embeddings": True,
                                   "query_pre_attn_scalar": 40}),
    # Gemma 3: q/k norms, local layers on their own RoPE base, global ones linearly scaled
    "gemma3": Case("gemma3", {"sliding_window": 12, **GEMMA3_LAYERS}),
    # Qwen3-MoE: 8 experts, 2 per token; then 3 per token renormalized, layer 0 dense
    "qwen3-moe": Case("qwen3_moe"),
    "qwen3-moe-norm-dense-layer": Case("qwen3_moe", {"norm_topk_prob": True,
                                                     "num_experts_per_tok": 3,
                                                     "mlp_only_layers": [0]}),
}
# Step budgets: whole prompts in one step, and chunked prefill (prompts cut into 16-token
# chunks, batched with other sequences' decodes).
BUDGETS = {"whole": 2048, "chunked": 16}
# One case per family for quantized weights (each is a few engines).
QUANTIZED_CASES = ["qwen3", "phi3-longrope-short", "gemma3", "qwen3-moe"]
NUM_TOP = 5


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make_case(tmp_path: Path, case: str, **extra: Any) -> Path:
    return make_tiny_llama(tmp_path, CASES[case].family, **{**CASES[case].overrides, **extra})


def hf_model(folder: Path) -> Any:
    # eager: transformers' reference attention (the one that has every family's masks)
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens by one full forward per token (no cache: each is the whole sequence's
    own function, whatever the family's cache or mask code)."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(hf_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def random_prompts(n: int, seed: int, case: str) -> list[list[int]]:
    rng, low, high = random.Random(seed), CASES[case].min_len, CASES[case].max_len
    return [[rng.randrange(3, 300) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_of_a_flat_batch_match_transformers(tmp_path: Path, case: str) -> None:
    folder = make_case(tmp_path, case)
    loaded = load_model(str(folder), torch.float32, "cpu")
    loaded.model.fit_context(CASES[case].llm.get("max_model_len", 512))
    sequences = [torch.tensor(p) for p in random_prompts(2, seed=1, case=case)]
    boundaries, start = [], 0
    for seq in sequences:
        boundaries.append((start, start + len(seq)))
        start += len(seq)
    positions = torch.cat([torch.arange(len(seq)) for seq in sequences])
    layers = [loaded.spec.layer_attention(i) for i in range(loaded.spec.num_layers)]
    with torch.inference_mode():
        hidden = loaded.model(torch.cat(sequences), positions, dense_attention(boundaries, layers))
        ours = loaded.model.compute_logits(hidden)
    reference = hf_model(folder)
    expected = torch.cat([hf_logits(reference, seq.tolist()) for seq in sequences])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def check_generate(llm: LLM, reference: Any, prompts: list[list[int]], max_tokens: int,
                   atol: float = 1e-4) -> None:
    """`llm`'s greedy tokens are `reference`'s, and each step's top logprobs its
    log-softmax."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            logprobs=NUM_TOP)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.token_ids == hf_greedy(reference, prompt, max_tokens)
        logprobs = torch.log_softmax(hf_logits(reference, prompt + completion.token_ids), -1)
        assert completion.logprobs is not None
        for i, entry in enumerate(completion.logprobs):
            want = logprobs[len(prompt) - 1 + i]
            top = torch.tensor([lp for _, lp in entry.top])
            ids = [token_id for token_id, _ in entry.top]
            torch.testing.assert_close(top, want[ids], atol=atol, rtol=0)
            torch.testing.assert_close(top, want.topk(NUM_TOP).values, atol=atol, rtol=0)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_transformers(tmp_path: Path, case: str, budget: str) -> None:
    folder = make_case(tmp_path, case)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=32 << 20,
              max_num_batched_tokens=BUDGETS[budget], **CASES[case].llm)
    check_generate(llm, hf_model(folder), random_prompts(4, seed=2, case=case), max_tokens=10)


@pytest.mark.parametrize("quantization", ["q8", "q4"])
def test_quantized_weights_give_the_tokens_of_the_rounded_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str) -> None:
    """`quantization q8 | q4` with the native kernels: tokens and logprobs of a copy of the
    model whose projections were rounded the same way (the kernels round activations to 16
    bits per group of 32: logprobs agree to that rounding)."""
    fresh_cache(monkeypatch, tmp_path)
    for case in QUANTIZED_CASES:
        folder = make_case(tmp_path / case, case, tie_word_embeddings=False)
        rounded = tmp_path / case / "rounded"
        round_weights_like(folder, rounded, quantization)
        llm = LLM(str(folder), dtype="float32", kv_cache_memory=32 << 20,
                  quantization=quantization, linear_kernels=f"{quantization}_native",
                  max_num_batched_tokens=16, **CASES[case].llm)
        linears = {name: module for name, module in llm.engine.worker.model.named_modules()
                   if isinstance(module, KernelLinear) and name != "lm_head"}
        assert all(set(m.kernels) == {f"{quantization}_native"} for m in linears.values())
        assert ("layers.1.mlp.experts.7.down_proj" in linears) == ("moe" in case)
        check_generate(llm, hf_model(rounded), random_prompts(3, seed=3, case=case),
                       max_tokens=8, atol=2e-2)


@pytest.mark.parametrize(("case", "why"), [
    ("qwen3", "Qwen3ForCausalLM's layers are not the Llama layer"),
    ("gemma2", "Gemma2ForCausalLM's layers are not the Llama layer"),
])
def test_native_decode_steps_refuse_layers_they_do_not_compute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, why: str) -> None:
    fresh_cache(monkeypatch, tmp_path)
    llm = LLM(str(make_case(tmp_path, case)), dtype="float32", kv_cache_memory=16 << 20,
              quantization="q4", linear_kernels="q4_native", native_decode=True)
    worker = llm.engine.worker
    assert worker.runner.native_decode is None
    decoder, reason = NativeDecoder.build(worker.loaded.model, worker.runner.attention)
    assert decoder is None and why in reason


def test_native_decode_steps_refuse_sliding_windows(tmp_path: Path) -> None:
    from batchinfer.models import load_model as load
    from batchinfer.runner.native_decode import unsupported_layers

    folder = make_tiny_llama(tmp_path, "mistral", sliding_window=8)
    loaded = load(str(folder), torch.float32, "cpu")
    assert unsupported_layers(loaded.model) == "sliding-window attention is not in the native step"


def test_unknown_architecture_names_it_and_lists_the_supported(tmp_path: Path) -> None:
    folder = make_case(tmp_path, "qwen3")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture 'DeepseekV3ForCausalLM'; "
                                         r"supported: LlamaForCausalLM, .*Qwen3MoeForCausalLM"):
        load_model(str(folder), torch.float32, "cpu")


def test_qwen3_spec_reads_its_config(tmp_path: Path) -> None:
    folder = make_case(tmp_path, "qwen3-head32-bias-tied")
    spec = ModelSpec.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert spec.architecture == "Qwen3ForCausalLM"
    assert (spec.head_dim, spec.attention_bias, spec.attention_out_bias) == (32, True, True)
    assert spec.sliding_window is None  # use_sliding_window is false


def test_phi3_loads_its_fused_checkpoint_as_it_is(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder = make_case(tmp_path, "phi3")
    stored = load_file(folder / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in stored
    assert not any("q_proj" in name or "gate_proj" in name for name in stored)
    state = load_model(str(folder), torch.float32, "cpu").model.state_dict()
    for name in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
        assert torch.equal(state[f"layers.1.{name}"], stored[f"model.layers.1.{name}"])


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
     r"rope_scaling \(longrope\) lacks short_factor"),  # Phi-3 reads yarn as LongRoPE
    ({"rope_type": "proportional", "factor": 2.0},
     "unsupported rope_scaling type 'proportional'"),
    ({**longrope(64), "short_factor": [1.0] * 3}, "short_factor must be a list of"),
])
def test_rope_scalings_not_served_are_refused_by_name(rope: dict[str, Any],
                                                     message: str) -> None:
    config = {"architectures": ["Phi3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 300,
              "max_position_embeddings": 512, "rope_scaling": rope}
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(config, source="x/config.json")


GEMMA_CONFIG = {"num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "vocab_size": 300, "max_position_embeddings": 512, "sliding_window": 8}


def test_gemma_specs_read_their_configs_as_transformers_does() -> None:
    # Gemma 3 as transformers 4 wrote it: the global layers' rope_theta and rope_scaling, the
    # local ones' rope_local_base_freq, the layer types from sliding_window_pattern.
    spec = ModelSpec.from_hf_config({
        **GEMMA_CONFIG, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 3})
    assert (spec.rope_theta, spec.local_rope_theta) == (1e6, 1e4)
    assert spec.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert spec.full_attention_layers == {2, 5} and spec.kv_window is None
    assert (spec.query_pre_attn_scalar, spec.attn_logit_softcapping) == (256, None)
    assert spec.hidden_act == "gelu_pytorch_tanh"
    # Gemma 2 without its optional fields: transformers' defaults, local and global in turn.
    spec = ModelSpec.from_hf_config({**GEMMA_CONFIG, "architectures": ["Gemma2ForCausalLM"]})
    assert spec.full_attention_layers == {1, 3, 5}
    assert (spec.attn_logit_softcapping, spec.final_logit_softcapping) == (50.0, 30.0)
    assert spec.layer_attention(0).window == 8 and spec.layer_attention(1).window is None
    assert spec.layer_attention(0).scale == 256**-0.5 and spec.layer_attention(0).softcap == 50


@pytest.mark.parametrize(("fields", "message"), [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding_attention: only the default RoPE"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
])
def test_gemma_fields_not_served_are_refused_by_name(fields: dict[str, Any],
                                                     message: str) -> None:
    config = {**GEMMA_CONFIG, "architectures": ["Gemma3ForCausalLM"], **fields}
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(config, source="x/config.json")


def test_dynamic_ntk_past_its_context_rotates_as_transformers_at_the_served_length(
        tmp_path: Path) -> None:
    """Past `max_position_embeddings` (64), dynamic NTK stretches its base for the context
    served; transformers stretches it for each forward pass's length: at a sequence as long
    as the served context (100) both are the same function."""
    folder = make_tiny_llama(tmp_path, "qwen3", max_position_embeddings=64, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    loaded = load_model(str(folder), torch.float32, "cpu")
    assert loaded.spec.max_context == 128
    loaded.model.fit_context(100)
    ids = [(7 * i) % 290 + 5 for i in range(100)]
    layers = [loaded.spec.layer_attention(i) for i in range(loaded.spec.num_layers)]
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(100),
                              dense_attention([(0, 100)], layers))
        ours = loaded.model.compute_logits(hidden)
    torch.testing.assert_close(ours, hf_logits(hf_model(folder), ids), atol=1e-4, rtol=1e-4)
