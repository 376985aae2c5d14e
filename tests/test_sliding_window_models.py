"""Sliding-window models served past their window, against transformers: Mistral and Phi-3
(a window on every layer), Qwen2 with `use_sliding_window` (on every layer, and on all but its
first `max_window_layers`), Gemma 2 and 3 (local and global layers; Gemma 3 with local layers
only). Greedy tokens and top logprobs through `LLM.generate` with
generations longer than the window, whole and chunked prefill, under preemption (a cache too
small for the sequences unless the blocks before the window are dropped), prefix caching, and
through the triton backend (interpreted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from batchinfer import LLM
from tests.test_model_families import GEMMA3_LAYERS, check_generate, hf_model
from tests.tiny_models import make_tiny_llama

WINDOW = 12
# family, its config overrides, whether every layer has the window (blocks may be dropped)
MODELS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "mistral": ("mistral", {"sliding_window": WINDOW}, True),
    "phi3": ("phi3", {"sliding_window": WINDOW}, True),
    "qwen2-all-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                                   "max_window_layers": 0}, True),
    "qwen2-mixed": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                              "max_window_layers": 1}, False),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "attn_logit_softcapping": 2.0,
                          "final_logit_softcapping": 5.0}, False),
    "gemma3": ("gemma3", {"sliding_window": WINDOW, **GEMMA3_LAYERS}, False),
    "gemma3-all-local": ("gemma3", {"sliding_window": WINDOW,
                                    "layer_types": ["sliding_attention"] * 2}, True),
}
# Prompts of 3-30 tokens and 24 new tokens each: every sequence goes past the window.
PROMPTS = [[(11 * i + 7 * j) % 290 + 5 for j in range(n)] for i, n in enumerate([3, 9, 17, 30])]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make_model(tmp_path: Path, name: str) -> Path:
    family, overrides, _ = MODELS[name]
    return make_tiny_llama(tmp_path, family, **overrides)


@pytest.mark.parametrize("budget", [2048, 5], ids=["whole", "chunked"])
@pytest.mark.parametrize("name", list(MODELS))
def test_generation_past_the_window_matches_transformers(tmp_path: Path, name: str,
                                                         budget: int) -> None:
    folder = make_model(tmp_path, name)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=4 << 20, block_size=4,
              max_num_batched_tokens=budget, enable_prefix_caching=True)
    spec = llm.engine.worker.spec
    assert spec.kv_window == (WINDOW if MODELS[name][2] else None)
    assert llm.engine.max_model_len == spec.max_position_embeddings  # not capped at the window
    check_generate(llm, hf_model(folder), PROMPTS, max_tokens=24)


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3-all-local"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_dropped_blocks_keep_transformers_tokens(tmp_path: Path, mode: str,
                                                                name: str) -> None:
    """16 blocks of 4 tokens: each sequence reaches 27-54 tokens, the four together 170, and a
    windowed one holds at most 8 blocks: they run (dropping the blocks before the window where
    every layer has one) and preempt one another."""
    folder = make_model(tmp_path, name)
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 heads of 16 floats
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=16 * block_bytes, block_size=4,
              max_num_batched_tokens=16, preemption_mode=mode, swap_space=64 * block_bytes)
    assert llm.engine.worker.num_blocks == 16
    check_generate(llm, hf_model(folder), PROMPTS, max_tokens=24)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions_total > 0
    if mode == "swap":
        assert scheduler.swapped_out_blocks > 0


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3-all-local"])
def test_prefix_cache_hits_past_the_window(tmp_path: Path, name: str) -> None:
    """Prompts sharing 40 tokens (more than three windows): the copies take the shared blocks
    from the prefix cache (those before their window dropped at once where every layer is
    windowed) and still give transformers' tokens."""
    folder = make_model(tmp_path, name)
    common = [(13 * j) % 280 + 9 for j in range(40)]
    prompts = [common + [5 + i, 70 + i] for i in range(3)]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=4 << 20, block_size=4,
              max_num_batched_tokens=16, enable_prefix_caching=True)
    check_generate(llm, hf_model(folder), prompts, max_tokens=16)
    assert llm.engine.core.scheduler.prefix_cache_hits >= 2 * 40


def test_a_windowed_model_serves_sequences_longer_than_its_cache(tmp_path: Path) -> None:
    folder = make_model(tmp_path, "mistral")
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=10 * block_bytes, block_size=4,
              max_num_batched_tokens=8)
    assert llm.engine.max_model_len == 512  # 10 blocks hold 40 tokens
    check_generate(llm, hf_model(folder), PROMPTS[3:], max_tokens=40)


@pytest.mark.slow
def test_triton_backend_past_the_window(tmp_path: Path) -> None:
    """The triton kernels under the interpreter, a window on every layer, chunked."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
    folder = make_model(tmp_path, "mistral")
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=1 << 20, block_size=4,
              max_num_batched_tokens=8, attention_backend="triton")
    check_generate(llm, hf_model(folder), PROMPTS[1:3], max_tokens=16)


@pytest.mark.parametrize("name", ["mistral", "gemma3-all-local"])
@pytest.mark.parametrize("method", ["ngram", "self-q4"])
def test_speculation_past_the_window_keeps_transformers_tokens(tmp_path: Path, name: str,
                                                              method: str) -> None:
    """Proposed tokens verified (and the rejected ones rolled back) while the blocks before the
    window are dropped and the sequences preempt one another: transformers' tokens still."""
    folder = make_model(tmp_path, name)
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4
    knobs = ({"speculative_method": "ngram", "prompt_lookup_min": 1} if method == "ngram"
             else {"speculative_method": "draft", "speculative_model": "self-q4"})
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=16 * block_bytes, block_size=4,
              max_num_batched_tokens=16, speculative_depth=3, **knobs)
    check_generate(llm, hf_model(folder), PROMPTS, max_tokens=24)
    scheduler = llm.engine.core.scheduler
    assert scheduler.speculation.stats.num_draft_tokens > 0
    assert scheduler.num_preemptions_total > 0
