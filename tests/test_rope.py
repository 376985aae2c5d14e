"""Every RoPE scaling served, against transformers' own rope init functions
(`ROPE_INIT_FUNCTIONS`): the rotation speeds and the cos/sin factor, read through
`ModelSpec.from_hf_config` from a config transformers wrote. End to end (tokens and logprobs
through `LLM.generate`) for YaRN and dynamic NTK is in tests/test_model_families.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchinfer.models.rope import rope_attention_factor, rope_inverse_frequencies, rope_tables
from batchinfer.models.spec import ModelSpec

HEAD_DIM = 32
MAX_POSITIONS = 1024


def llama3() -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


def longrope() -> dict[str, Any]:
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(16)],
            "long_factor": [1.0 + 0.7 * i for i in range(16)],
            "original_max_position_embeddings": 256}


# (name, rope_parameters, contexts served)
SCALINGS = [
    ("linear", {"rope_type": "linear", "factor": 4.0}, [MAX_POSITIONS]),
    ("llama3", llama3(), [MAX_POSITIONS]),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
     [MAX_POSITIONS]),
    ("yarn-betas-mscale", {"rope_type": "yarn", "factor": 8.0,
                           "original_max_position_embeddings": 128, "beta_fast": 16,
                           "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 0.6,
                           "truncate": False}, [MAX_POSITIONS]),
    ("yarn-attention-factor", {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3},
     [MAX_POSITIONS]),
    # within its context, and stretched to 1.5x and 2x (what `max_model_len` asks)
    ("dynamic", {"rope_type": "dynamic", "factor": 2.0}, [512, 1536, 2048]),
    ("longrope", longrope(), [200, 256, 257, MAX_POSITIONS]),
]


def hf_config(parameters: dict[str, Any]) -> Any:
    phi3 = parameters["rope_type"] == "longrope"
    return (Phi3Config if phi3 else LlamaConfig)(
        hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM, num_hidden_layers=1,
        intermediate_size=64, vocab_size=100, max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_theta": 10000.0, **parameters},
        architectures=["Phi3ForCausalLM" if phi3 else "LlamaForCausalLM"])


@pytest.mark.parametrize(("name", "parameters", "contexts"), SCALINGS,
                         ids=[case[0] for case in SCALINGS])
def test_rope_scaling_matches_transformers(name: str, parameters: dict[str, Any],
                                           contexts: list[int]) -> None:
    config = hf_config(dict(parameters))
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == parameters["rope_type"]
    for context in contexts:
        expected, factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, "cpu",
                                                                        seq_len=context)
        ours = rope_inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                                        context)
        torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0,
                                   msg=lambda m, c=context: f"context {c}: {m}")
        assert rope_attention_factor(spec.rope_scaling) == pytest.approx(factor, rel=1e-12)
    plain = rope_inverse_frequencies(spec.head_dim, spec.rope_theta, None)
    if name != "dynamic":  # (dynamic is plain within its context: checked above)
        assert not torch.allclose(ours, plain)


def test_tables_carry_the_attention_factor() -> None:
    scaling = ModelSpec.from_hf_config(hf_config(SCALINGS[2][1]).to_dict()).rope_scaling
    cos, sin = rope_tables(HEAD_DIM, 10000.0, scaling, 8, MAX_POSITIONS)
    factor = rope_attention_factor(scaling)
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    torch.testing.assert_close(cos[0], torch.full((HEAD_DIM // 2,), factor))
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, factor**2))


def test_yarn_and_dynamic_stretch_the_served_context() -> None:
    """`max_context` (what `max_model_len` may reach) is `factor` times the original context
    for YaRN and dynamic NTK, as vLLM takes it; other scalings keep the config's positions."""
    def spec_of(parameters: dict[str, Any]) -> ModelSpec:
        return ModelSpec.from_hf_config(hf_config(parameters).to_dict())

    assert spec_of(SCALINGS[2][1]).max_context == MAX_POSITIONS  # 4 x 256
    assert spec_of(SCALINGS[3][1]).max_context == MAX_POSITIONS  # 8 x 128
    assert spec_of({"rope_type": "yarn", "factor": 4.0}).max_context == 4 * MAX_POSITIONS
    assert spec_of({"rope_type": "dynamic", "factor": 2.0}).max_context == 2 * MAX_POSITIONS
    assert spec_of(llama3()).max_context == MAX_POSITIONS
