"""Each model family beyond Llama, on a tiny random model built with transformers' own config
class, against Hugging Face: logits of a flat batch, then `LLM.generate`'s greedy tokens and
top logprobs (whole prompts and chunked prefill), then quantized weights."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchinfer import LLM, SamplingParams
from batchinfer.models import ModelSpec, load_model
from batchinfer.runner.native_decode import NativeDecoder
from tests.tiny_models import dense_attention, make_tiny_llama, round_weights_like

# case -> (family, transformers config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    # head_dim set apart from hidden / heads (64 / 4), as Qwen3 checkpoints do
    "qwen3-head32-bias-tied": ("qwen3", {"head_dim": 32, "attention_bias": True,
                                         "tie_word_embeddings": True}),
}
# Step budgets: whole prompts in one step, and chunked prefill (prompts cut into 16-token
# chunks, batched with other sequences' decodes).
BUDGETS = {"whole": 2048, "chunked": 16}
NUM_TOP = 5


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make_case(tmp_path: Path, case: str, **extra: Any) -> Path:
    family, overrides = CASES[case]
    return make_tiny_llama(tmp_path, family, **{**overrides, **extra})


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


def random_prompts(n: int, seed: int, low: int = 5, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_of_a_flat_batch_match_transformers(tmp_path: Path, case: str) -> None:
    folder = make_case(tmp_path, case)
    loaded = load_model(str(folder), torch.float32, "cpu")
    sequences = [torch.tensor(p) for p in random_prompts(2, seed=1, low=40, high=150)]
    boundaries, start = [], 0
    for seq in sequences:
        boundaries.append((start, start + len(seq)))
        start += len(seq)
    positions = torch.cat([torch.arange(len(seq)) for seq in sequences])
    with torch.inference_mode():
        hidden = loaded.model(torch.cat(sequences), positions, dense_attention(boundaries))
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
              max_num_batched_tokens=BUDGETS[budget])
    check_generate(llm, hf_model(folder), random_prompts(4, seed=2), max_tokens=10)


@pytest.mark.parametrize("quantization", ["q8", "q4"])
def test_quantized_weights_give_the_tokens_of_the_rounded_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str) -> None:
    """`quantization q8 | q4` with the native kernels: tokens and logprobs of a copy of the
    model whose projections were rounded the same way (the kernels round activations to 16
    bits per group of 32: logprobs agree to that rounding)."""
    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "cache"))
    for case in CASES:
        folder = make_case(tmp_path / case, case, tie_word_embeddings=False)
        rounded = tmp_path / case / "rounded"
        round_weights_like(folder, rounded, quantization)
        llm = LLM(str(folder), dtype="float32", kv_cache_memory=32 << 20,
                  quantization=quantization, linear_kernels=f"{quantization}_native",
                  max_num_batched_tokens=16)
        layer = llm.engine.worker.loaded.model.layers[0].self_attn.qkv_proj
        assert set(layer.kernels) == {f"{quantization}_native"}
        check_generate(llm, hf_model(rounded), random_prompts(3, seed=3), max_tokens=8,
                       atol=2e-2)


def test_native_decode_steps_refuse_qwen3_layers(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(make_case(tmp_path, "qwen3")), dtype="float32", kv_cache_memory=16 << 20,
              quantization="q4", linear_kernels="q4_native", native_decode=True)
    worker = llm.engine.worker
    assert worker.runner.native_decode is None
    decoder, why = NativeDecoder.build(worker.loaded.model, worker.runner.attention)
    assert decoder is None and "Qwen3ForCausalLM's layers are not the Llama layer" in why


def test_unknown_architecture_names_it_and_lists_the_supported(tmp_path: Path) -> None:
    folder = make_case(tmp_path, "qwen3")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture 'Qwen3MoeForCausalLM'; "
                                         r"supported: LlamaForCausalLM, .*Qwen3ForCausalLM"):
        load_model(str(folder), torch.float32, "cpu")


def test_qwen3_spec_reads_its_config(tmp_path: Path) -> None:
    folder = make_case(tmp_path, "qwen3-head32-bias-tied")
    spec = ModelSpec.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert spec.architecture == "Qwen3ForCausalLM"
    assert (spec.head_dim, spec.attention_bias, spec.attention_out_bias) == (32, True, True)
    assert spec.sliding_window is None  # use_sliding_window is false
