"""Pre-packed (oneDNN) linears: same products as dense ones, and the engine's outputs unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchinfer import LLM, SamplingParams
from batchinfer.models.linear_kernels import KernelLinear, WeightForms
from batchinfer.models.prepack import PackedLinear, prepack_linears, prepack_supported
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


def test_a_packed_kernel_applies_gelu_inside_the_product_others_leave_it_to_the_caller():
    """The encoder's intermediate product: with oneDNN's packed kernel, GELU (erf form) runs
    as the product's post-op and gives `F.gelu` of the product; a dense kernel has no fused
    form (None), so the caller applies its own."""
    torch.manual_seed(0)
    dense = nn.Linear(96, 160)
    x = torch.randn(40, 96) * 3
    want = torch.nn.functional.gelu(dense(x))
    with torch.inference_mode():
        packed = KernelLinear(WeightForms(dense.weight, dense.bias), ("packed",) * 4)
        torch.testing.assert_close(packed.forward_gelu(x), want, rtol=1e-5, atol=1e-5)
        plain = KernelLinear(WeightForms(dense.weight, dense.bias), ("dense",) * 4)
        assert plain.forward_gelu(x) is None


def test_prepack_linears_replaces_every_linear_and_nothing_else():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4)))
    assert prepack_linears(model) == 2
    assert [type(m).__name__ for m in model.modules()].count("Linear") == 0
    assert isinstance(model[1][0], nn.LayerNorm)


def test_other_dtypes_keep_dense_weights_and_the_knob_is_validated(tmp_path):
    model_dir = make_tiny_llama(tmp_path)
    bf16 = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=32 << 20)
    o_proj = bf16.engine.worker.loaded.model.layers[0].self_attn.o_proj
    assert o_proj.kernels == ("dense",) * 4  # oneDNN packs float32 only: nothing to measure
    assert bf16.engine.worker.linear_kernels.source == "forced"
    with pytest.raises(ValueError, match="prepack_weights"):
        LLM(str(model_dir), prepack_weights="yes")


def test_encoder_packs_its_linears_and_its_vectors_stay_the_same():
    from batchinfer.models.encoder import Encoder

    packed = Encoder("default", dtype="float32", device="cpu")
    dense = Encoder("default", dtype="float32", device="cpu", prepack_weights=False)
    query = packed.model.encoder.layer[0].attention.self.query
    assert isinstance(query, KernelLinear) and set(query.kernels) <= {"dense", "packed"}
    assert dense.model.encoder.layer[0].intermediate.dense.kernels == ("dense",) * 4
    texts = ["a short one", "a somewhat longer sentence about batching " * 8, "x"]
    cosine = torch.nn.functional.cosine_similarity(packed.encode(texts), dense.encode(texts))
    assert cosine.min().item() > 0.99999
    # The padded `transformers` forward runs on the same packed modules.
    padded = Encoder("default", dtype="float32", device="cpu", packed=False)
    assert isinstance(padded.model.encoder.layer[5].output.dense, KernelLinear)
    torch.testing.assert_close(padded.encode(texts), dense.encode(texts), rtol=1e-4, atol=1e-5)
