"""Pre-packed (oneDNN) linears: same products as dense ones, and the engine's outputs unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchinfer import LLM, SamplingParams
from batchinfer.models.prepack import PackedLinear, prepack_linears, prepack_supported
from tests.test_engine import hf_greedy, random_prompts
from tests.tiny_models import make_tiny_llama

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_prepack_applies_to_cpu_float32_only() -> None:
    # Fails (rather than skipping the file) on a torch without oneDNN: the engine and the
    # encoder would then silently run every CPU float32 model dense.
    assert prepack_supported(torch.device("cpu"), torch.float32)
    assert not prepack_supported(torch.device("cpu"), torch.bfloat16)
    assert not prepack_supported(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_dense_for_every_row_count_and_layout(bias):
    torch.manual_seed(0)
    dense = nn.Linear(96, 80, bias=bias)
    packed = PackedLinear.from_linear(dense)
    with torch.inference_mode():
        for rows in (1, 3, 32, 257):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(packed(x), dense(x), rtol=1e-5, atol=1e-5)
        wide = torch.randn(7, 192)
        strided = wide[:, :96]  # the gate half of a fused gate/up output, as the MLP passes it
        torch.testing.assert_close(packed(strided), dense(strided), rtol=1e-5, atol=1e-5)
        batched = torch.randn(2, 5, 96)
        torch.testing.assert_close(packed(batched), dense(batched), rtol=1e-5, atol=1e-5)
    assert "packed_weight" not in packed.state_dict()


def test_prepack_linears_replaces_every_linear_and_nothing_else():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4)))
    assert prepack_linears(model) == 2
    assert [type(m).__name__ for m in model.modules()].count("Linear") == 0
    assert isinstance(model[1][0], nn.LayerNorm)


@pytest.mark.parametrize("tied", [False, True])
def test_engine_packs_its_model_and_greedy_tokens_stay_hugging_faces(tmp_path, tied):
    model_dir = make_tiny_llama(tmp_path, tie_word_embeddings=tied)
    packed = LLM(str(model_dir), dtype="float32", kv_cache_memory=32 << 20)
    dense = LLM(str(model_dir), dtype="float32", kv_cache_memory=32 << 20, prepack_weights=False)
    net = packed.engine.worker.loaded.model
    assert isinstance(net.lm_head, PackedLinear)
    assert isinstance(net.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(net.layers[1].mlp.down_proj, PackedLinear)
    assert isinstance(dense.engine.worker.loaded.model.layers[0].mlp.gate_up_proj, nn.Linear)
    assert (dense.engine.worker.loaded.model.lm_head is None) == tied
    prompts = random_prompts(6, packed.engine.worker.vocab_size, seed=5, high=60)
    ours = [o.outputs[0].token_ids for o in packed.generate(prompts, GREEDY, use_tqdm=False)]
    assert ours == [o.outputs[0].token_ids for o in dense.generate(prompts, GREEDY, use_tqdm=False)]
    assert ours == hf_greedy(model_dir, prompts, GREEDY.max_tokens)


def test_other_dtypes_keep_dense_weights_and_the_knob_is_validated(tmp_path):
    model_dir = make_tiny_llama(tmp_path)
    bf16 = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=32 << 20)
    assert isinstance(bf16.engine.worker.loaded.model.layers[0].self_attn.o_proj, nn.Linear)
    with pytest.raises(ValueError, match="prepack_weights"):
        LLM(str(model_dir), prepack_weights="yes")


def test_encoder_packs_its_linears_and_its_vectors_stay_the_same():
    from batchinfer.models.encoder import Encoder

    packed = Encoder("default", dtype="float32", device="cpu")
    dense = Encoder("default", dtype="float32", device="cpu", prepack_weights=False)
    assert isinstance(packed.model.encoder.layer[0].attention.self.query, PackedLinear)
    assert isinstance(dense.model.encoder.layer[0].intermediate.dense, nn.Linear)
    texts = ["a short one", "a somewhat longer sentence about batching " * 8, "x"]
    cosine = torch.nn.functional.cosine_similarity(packed.encode(texts), dense.encode(texts))
    assert cosine.min().item() > 0.99999
    # The padded `transformers` forward runs on the same packed modules.
    padded = Encoder("default", dtype="float32", device="cpu", packed=False)
    assert isinstance(padded.model.encoder.layer[5].output.dense, PackedLinear)
    torch.testing.assert_close(padded.encode(texts), dense.encode(texts), rtol=1e-4, atol=1e-5)
