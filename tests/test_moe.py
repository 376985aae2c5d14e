"""The mixture of experts run grouped by expert: the grouping itself, one product per chosen
expert per step (counted through the engine), and the grouped block equal to the per-token
sum it replaces. Tokens against transformers are in tests/test_model_families.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from batchinfer import LLM, SamplingParams
from batchinfer.models.qwen3_moe import MoE, group_by_expert
from tests.tiny_models import make_tiny_llama


def test_group_by_expert_sorts_pairs_and_keeps_each_tokens_weights() -> None:
    generator = torch.Generator().manual_seed(0)
    experts = torch.stack([torch.randperm(6, generator=generator)[:3] for _ in range(10)])
    weights = torch.rand(10, 3, generator=generator)
    groups = group_by_expert(weights, experts, num_experts=6)
    assert groups.starts[0] == 0 and groups.starts[-1] == 30 and len(groups.starts) == 7
    for expert in range(6):
        start, end = groups.starts[expert], groups.starts[expert + 1]
        tokens = groups.token_ids[start:end].tolist()
        assert tokens == sorted(tokens)  # stable: by token within an expert
        assert tokens == [t for t in range(10) if expert in experts[t].tolist()]
        for token, weight in zip(tokens, groups.weights[start:end].tolist(), strict=True):
            k = experts[token].tolist().index(expert)
            assert weight == weights[token, k].item()


def test_each_chosen_expert_runs_once_per_step(tmp_path: Path) -> None:
    """Six sequences decoding together choose 12 (token, expert) pairs a layer among 8
    experts; every expert's product runs at most once per layer and step, over all the rows
    routed to it (counted on its down projection), and some step gives an expert several."""
    llm = LLM(str(make_tiny_llama(tmp_path, "qwen3_moe")), dtype="float32",
              kv_cache_memory=8 << 20)
    calls: Counter[int] = Counter()
    most_calls, most_rows = 0, 0

    def count(expert: int):  # noqa: ANN202
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            nonlocal most_rows
            calls[expert] += 1
            most_rows = max(most_rows, inputs[0].shape[0])
        return hook

    def reset(module: torch.nn.Module, inputs: object) -> None:
        calls.clear()

    def check(module: torch.nn.Module, inputs: object, output: object) -> None:
        nonlocal most_calls
        most_calls = max(most_calls, *calls.values())

    for layer in llm.engine.worker.model.layers:
        moe = layer.mlp
        assert isinstance(moe, MoE)
        moe.register_forward_pre_hook(reset)
        moe.register_forward_hook(check)
        for expert, mlp in enumerate(moe.experts):
            mlp.down_proj.register_forward_pre_hook(count(expert))
    prompts = [[(5 * i + j) % 290 + 3 for j in range(4 + i)] for i in range(6)]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert most_calls == 1
    assert most_rows > 1


def test_grouped_block_equals_the_per_token_sum(tmp_path: Path) -> None:
    llm = LLM(str(make_tiny_llama(tmp_path, "qwen3_moe", norm_topk_prob=True)),
              dtype="float32", kv_cache_memory=8 << 20)
    moe = llm.engine.worker.model.layers[1].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        grouped = moe(x, torch.zeros(20, 64))
        weights, experts = moe.gate(x)
        expected = torch.zeros(20, 64)
        for token in range(20):
            for weight, expert in zip(weights[token], experts[token].tolist(), strict=True):
                mlp = moe.experts[expert]
                expected[token] += weight * mlp.down_proj(mlp.hidden(x[token : token + 1]))[0]
    assert torch.allclose(weights.sum(-1), torch.ones(20))  # renormalized
    torch.testing.assert_close(grouped, expected, atol=1e-5, rtol=1e-5)
