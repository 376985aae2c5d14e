"""The packed (unpadded) encoder forward against the padded `transformers` forward on tiny
random BERT-family models, and the packed and padded `Encoder` paths on the embedded model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, BertConfig, RobertaConfig, XLMRobertaConfig

from batchinfer.models.encoder import Encoder
from batchinfer.models.packed_encoder import PackedEncoder, packed_supported

LENGTHS = [7, 3, 7, 12, 1, 3, 3]

CONFIGS = {
    "bert": BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=64,
                       max_position_embeddings=64),
    "roberta-gelu-new": RobertaConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=64, pad_token_id=1,
                                      hidden_act="gelu_new"),
    "xlm-roberta-relu": XLMRobertaConfig(vocab_size=120, hidden_size=48, num_hidden_layers=3,
                                         num_attention_heads=3, intermediate_size=96,
                                         max_position_embeddings=64, pad_token_id=1,
                                         hidden_act="relu"),
    # head sizes 32 and 64: the native attention's vectorized paths
    "bert-head32": BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=1,
                              num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=128),
    "bert-head64": BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=1,
                              num_attention_heads=1, intermediate_size=64,
                              max_position_embeddings=128),
}
# Sentences longer than one block of 64 keys, and a partial one, for the wider models.
LONG_LENGTHS = [70, 5, 128, 1, 66, 17]


@pytest.mark.parametrize("native_attention", [True, False], ids=["native", "sdpa"])
@pytest.mark.parametrize("name", CONFIGS)
def test_packed_hidden_states_equal_the_padded_transformers_forward(
        name: str, native_attention: bool) -> None:
    """Both attention paths of the packed forward (the native kernel where it is built,
    per-length SDPA calls) give the padded forward's states."""
    torch.manual_seed(0)
    hf = AutoModel.from_config(CONFIGS[name], attn_implementation="sdpa").eval()
    assert packed_supported(hf)
    packed = PackedEncoder(hf, chunk_tokens=8,  # several token chunks per layer
                           native_attention=native_attention)
    if native_attention and packed.native is None:
        pytest.skip("the native kernels cannot be built here")
    lengths = LONG_LENGTHS if name.startswith("bert-head") else LENGTHS
    rows = [torch.randint(2, 120, (n,)) for n in lengths]  # no pad ids inside a sentence
    longest = max(lengths)
    ids = torch.full((len(rows), longest), hf.config.pad_token_id or 0)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
    order = sorted(range(len(rows)), key=lambda i: lengths[i])
    with torch.inference_mode():
        want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        got = packed(torch.cat([rows[i] for i in order]), [lengths[i] for i in order])
    for chunk, i in zip(got.split([lengths[i] for i in order]), order, strict=True):
        assert (chunk - want[i, :lengths[i]]).abs().max() <= 1e-5, (name, i)


def test_unsupported_models_keep_the_padded_path() -> None:
    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=64,
                        position_embedding_type="relative_key")
    hf = AutoModel.from_config(config).eval()
    assert not packed_supported(hf)
    with pytest.raises(ValueError, match="cannot run packed"):
        PackedEncoder(hf)


def test_packed_and_padded_encoder_paths_agree_on_the_embedded_model() -> None:
    packed = Encoder("default", dtype="float32", device="cpu")
    padded = Encoder("default", dtype="float32", device="cpu", packed=False)
    assert packed.packed is not None and padded.packed is None
    ids = packed.tokenize(["short", "a somewhat longer sentence about batching", "two words",
                           "short", "x " * 40])
    got = packed.encode_ids(ids)
    assert (got - padded.encode_ids(ids)).abs().max() <= 1e-5
    assert (got[0] - got[3]).abs().max() <= 1e-6  # same text, same vector
    assert (got[1] - packed.encode_ids([ids[1]])[0]).abs().max() <= 1e-5
