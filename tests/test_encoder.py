"""The encoder against sentence-transformers `encode()` on the real embedded model, padding
invariance, token-id input, length limits, and pooling configs on a tiny random BERT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchinfer.models.encoder import Encoder, PoolingConfig, default_encoder_path

TEXTS = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun for hours.",
    "Hi",
    "Dynamic batching groups concurrent requests so one forward pass serves many callers, "
    "while each caller's latency stays inside its budget. " * 3,
    "批量推理",
    "short one",
]


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder("default", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(default_encoder_path()), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True, batch_size=32).float()


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def test_default_model_config(encoder: Encoder) -> None:
    assert encoder.name == "all-MiniLM-L6-v2" and encoder.dim == 384
    assert encoder.max_length == 256 and encoder.dtype == torch.float32
    assert encoder.pooling == PoolingConfig(("mean",), normalize=True)


def test_matches_sentence_transformers_alone_and_in_mixed_batches(
        encoder: Encoder, reference: torch.Tensor) -> None:
    ids = encoder.tokenize(TEXTS)
    batched = encoder.encode_ids(ids)  # one batch, padded to the longest
    alone = torch.cat([encoder.encode_ids([x]) for x in ids])
    assert cosine(batched, reference).min() >= 0.9999
    assert cosine(alone, reference).min() >= 0.9999
    assert (batched - alone).abs().max() <= 1e-5  # padding never changes a result
    mixed = encoder.encode_ids([ids[3], ids[2], ids[0], ids[3]])
    assert (mixed[1] - alone[2]).abs().max() <= 1e-5
    assert (mixed[0] - mixed[3]).abs().max() <= 1e-6
    assert torch.allclose(batched.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_token_id_input_equals_text_input(encoder: Encoder) -> None:
    raw = encoder.tokenizer("A man is eating food.", add_special_tokens=False)["input_ids"]
    with_special = encoder.add_special_tokens([raw])
    assert with_special == encoder.tokenize(["A man is eating food."])
    with pytest.raises(ValueError, match=r"input\[0\]: token id"):
        encoder.add_special_tokens([[1, 10**9]])


def test_too_long_input_needs_truncate(encoder: Encoder, reference: torch.Tensor) -> None:
    long_text = "word " * 400
    with pytest.raises(ValueError, match=r"input\[1\] has \d+ tokens, more than max_length=256"):
        encoder.tokenize(["ok", long_text])
    (ids,) = encoder.tokenize([long_text], truncate=True)
    assert len(ids) == 256 and ids[-1] == encoder.tokenizer.sep_token_id
    with pytest.raises(ValueError, match="max_length"):
        encoder.add_special_tokens([[2000] * 300])
    assert len(encoder.add_special_tokens([[2000] * 300], truncate=True)[0]) == 256


def test_encode_keeps_input_order(encoder: Encoder, reference: torch.Tensor) -> None:
    out = encoder.encode(TEXTS, batch_size=2)
    assert cosine(out, reference).min() >= 0.9999


def test_bad_model_argument() -> None:
    with pytest.raises(ValueError, match="model must be"):
        Encoder("/no/such/folder")
    with pytest.raises(ValueError, match="max_length"):
        Encoder("default", max_length=100_000)


@pytest.mark.parametrize("modes,normalize", [(("cls",), False), (("max", "mean"), True),
                                             (("lasttoken",), False)])
def test_pooling_configs_match_sentence_transformers_on_a_tiny_bert(
        tmp_path: Path, modes: tuple[str, ...], normalize: bool) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path / "tiny"
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    BertModel(config).eval().save_pretrained(folder)
    BertTokenizerFast.from_pretrained(default_encoder_path()).save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    (folder / "1_Pooling").mkdir()
    legacy_keys = {"cls": "cls_token", "max": "max_tokens", "mean": "mean_tokens",
                   "lasttoken": "lasttoken"}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32,
         **{f"pooling_mode_{key}": mode in modes for mode, key in legacy_keys.items()}}))
    texts = ["one", "a much longer sentence than the first", "two words"]
    ours = Encoder(str(folder), dtype="float32", device="cpu")
    assert ours.pooling == PoolingConfig(modes, normalize) and ours.max_length == 48
    got = ours.encode_ids(ours.tokenize(texts))
    want = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5


def test_int8_weights_kept_when_probe_vectors_stay_close(encoder: Encoder) -> None:
    quantized = Encoder("default", dtype="float32", device="cpu", quantization="int8",
                        min_quantized_cosine=0.99)
    assert quantized.quantization == "int8"
    assert 0.99 <= quantized.quantization_cosine < 1.0
    kernels = {k for bucket in quantized.linear_kernels.choice.values() for k in bucket}
    assert kernels and all(k.startswith("int8") for k in kernels)
    ours, base = quantized.encode(TEXTS), encoder.encode(TEXTS)
    assert cosine(ours, base).min() > 0.99
    assert (ours - base).abs().max() > 1e-5  # the int8 weights really run


def test_q8_weights_keep_the_default_cosine_bound_where_per_channel_int8_may_not(
        encoder: Encoder, caplog: pytest.LogCaptureFixture) -> None:
    """8-bit weights in groups of 32 (the native kernels): kept on the embedded model at the
    default bound 0.999, and what runs is the q8 kernel, not the float weights. Where those
    kernels cannot run (bfloat16 activations, as `dtype=auto` picks on CPUs with fast bf16),
    the float weights stay, with a warning."""
    from batchinfer import native

    with caplog.at_level("WARNING", logger="batchinfer.models.encoder"):
        bf16 = Encoder("default", dtype="bfloat16", device="cpu", quantization="q8")
    assert bf16.quantization == "none" and "float weights kept" in caplog.text

    if native.library() is None:  # where they cannot run: float weights, as a refusal keeps
        assert Encoder("default", dtype="float32", device="cpu",
                       quantization="q8").quantization == "none"
        return
    quantized = Encoder("default", dtype="float32", device="cpu", quantization="q8")
    assert quantized.quantization == "q8"
    assert 0.999 <= quantized.quantization_cosine < 1.0
    kernels = {k for bucket in quantized.linear_kernels.choice.values() for k in bucket}
    # the native kernel at few rows; at an encoder's large batches, whichever of it and the
    # dequantize + float32 GEMM form measured faster
    assert "q8_native" in kernels and kernels <= {"q8_native", "q8_dense"}
    ours, base = quantized.encode(TEXTS), encoder.encode(TEXTS)
    assert cosine(ours, base).min() > 0.999
    assert (ours - base).abs().max() > 1e-5  # the 8-bit weights really run


def test_int8_weights_refused_below_the_cosine_bound(encoder: Encoder,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="batchinfer.models.encoder"):
        refused = Encoder("default", dtype="float32", device="cpu", quantization="int8",
                          min_quantized_cosine=0.999999)
    assert refused.quantization == "none"
    assert refused.quantization_cosine < 0.999999
    assert "int8 weights refused" in caplog.text
    assert (refused.encode(TEXTS) - encoder.encode(TEXTS)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="quantization"):
        Encoder("default", quantization="q4")
