"""BERT-family encoders over packed (unpadded) token batches.

A padded batch of sentences costs `count x longest` tokens in every linear layer and attention
needs a mask. Here the batch is one flat row of tokens (the sentences end to end, as text
embedding servers with variable-length attention kernels do): embeddings, projections, layer
norms and the feed-forward run on exactly the real tokens, and attention needs no mask: on a
CPU in float32, one native call per layer (`native.packed_attention`: every sentence and head
a task, keys of a sentence read once per four query rows; 1.3-2.8x the SDPA calls on the
embedded model's batches, `benchmarks/native_many_rows.py`), elsewhere one fused-attention call per group of equally long
sentences.
The weights are the loaded `transformers` model's own tensors (shared, not copied), so the
padded `transformers` forward stays available and both give the same vectors.

Supported: `bert` (absolute positions) and `roberta` / `xlm-roberta` (positions counted from
`pad_token_id + 1`); anything else uses the padded `transformers` forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer import native
from batchinfer.models.linear_kernels import KernelLinear
from batchinfer.native import elementwise

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# model_type -> first position id of a sentence (None: the config's pad_token_id + 1)
_POSITION_START = {"bert": 0, "roberta": None, "xlm-roberta": None}


# `hf_model` below is a `transformers` encoder, read by attribute name (`config.hidden_act`,
# `embeddings.word_embeddings`, `encoder.layer`): its config and submodules carry no static types.


def packed_supported(hf_model: Any) -> bool:
    """Whether `hf_model` (a `transformers` encoder) can run packed."""
    config = hf_model.config
    return (config.model_type in _POSITION_START
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and config.hidden_act in _ACTIVATIONS
            and not getattr(config, "is_decoder", False)
            and hasattr(hf_model, "embeddings") and hasattr(hf_model, "encoder"))


class PackedEncoder(nn.Module):
    """The forward pass of a BERT-family `transformers` model over a packed token row."""

    def __init__(self, hf_model: Any, chunk_tokens: int = 1024,
                 native_attention: bool = True) -> None:
        super().__init__()
        if not packed_supported(hf_model):
            raise ValueError(f"model type {hf_model.config.model_type!r} cannot run packed")
        config = hf_model.config
        self.num_heads = int(config.num_attention_heads)
        self.head_dim = int(config.hidden_size) // self.num_heads
        self.eps = float(config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.exact_gelu = config.hidden_act == "gelu"  # the erf form, which has a native pass
        start = _POSITION_START[config.model_type]
        self.position_start = int(config.pad_token_id) + 1 if start is None else start
        self.chunk_tokens = chunk_tokens
        # The native attention kernel (one call per layer) where it is built; else SDPA.
        self.native = native.library() if native_attention else None
        self.embeddings = hf_model.embeddings
        self.layers = hf_model.encoder.layer

    def _norm(self, x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, self.eps)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   runs: Sequence[tuple[int, int]], lengths: Sequence[int]) -> torch.Tensor:
        """Per-sentence self-attention over packed [T, hidden] q/k/v (rows of one stride);
        sentences come in runs of (count, length) with equal lengths."""
        if self.native is not None and q.dtype == torch.float32 and q.device.type == "cpu":
            # one call for every sentence and head, no grouping by length
            return native.packed_attention(self.native, q, k, v, lengths, self.num_heads)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        start = 0
        for count, length in runs:
            end = start + count * length
            # each [count, heads, length, head_dim]
            q_run, k_run, v_run = (
                t[start:end].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)
                for t in (q, k, v))
            attended = F.scaled_dot_product_attention(q_run, k_run, v_run)
            out[start:end] = attended.transpose(1, 2).reshape(end - start, -1)
            start = end
        return out

    def forward(self, input_ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """input_ids: [T] the sentences end to end, sorted so equal lengths are adjacent;
        lengths: each sentence's token count (sum = T). Returns hidden states [T, hidden]."""
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])
        emb = self.embeddings
        x = (emb.word_embeddings(input_ids) + emb.position_embeddings(positions
                                                                      + self.position_start)
             + emb.token_type_embeddings.weight[0])
        x = self._norm(x, emb.LayerNorm)
        runs = _equal_length_runs(lengths)
        x_next = torch.empty_like(x)
        for layer in self.layers:
            attn = layer.attention
            q, k, v = (proj(x) for proj in (attn.self.query, attn.self.key, attn.self.value))
            attended = self._attention(q, k, v, runs, lengths)
            del q, k, v
            # Everything after attention is per token: run it in cache-sized token chunks, so
            # the [chunk, intermediate] activations stay small and are reused from the heap.
            for start in range(0, x.shape[0], self.chunk_tokens):
                rows = slice(start, start + self.chunk_tokens)
                self._feed_forward(layer, x[rows], attended[rows], x_next[rows])
            x, x_next = x_next, x
        return x

    def _feed_forward(self, layer: Any, x: torch.Tensor, attended: torch.Tensor,
                      out: torch.Tensor) -> None:
        """`out = LN(h + FFN(h))` with `h = LN(x + dense(attended))`: a layer after its
        attention, for a chunk of token rows. On float32 CPU rows each residual add and norm
        is one native pass; an erf GELU runs inside a prepacked product as oneDNN's post-op,
        or in place natively after any other kernel (`native/elementwise.py`)."""
        attn = layer.attention
        projected = attn.output.dense(attended)
        lib = elementwise.library_for(x, projected)
        if lib is None:
            h = self._norm(x + projected, attn.output.LayerNorm)
            out.copy_(self._norm(h + layer.output.dense(self.act(layer.intermediate.dense(h))),
                                 layer.output.LayerNorm))
            return
        norm = attn.output.LayerNorm
        h = elementwise.add_layer_norm(lib, x, projected, norm.weight, norm.bias, self.eps)
        dense = layer.intermediate.dense
        fused = dense.forward_gelu(h) if self.exact_gelu and isinstance(dense, KernelLinear) \
            else None
        if fused is not None:  # the GELU ran as oneDNN's post-op inside the product
            inner = fused
        else:
            inner = dense(h)
            if self.exact_gelu and inner.is_contiguous():
                inner = elementwise.gelu_(lib, inner)
            else:
                inner = self.act(inner)
        norm = layer.output.LayerNorm
        elementwise.add_layer_norm(lib, h, layer.output.dense(inner), norm.weight, norm.bias,
                                   self.eps, out=out)


def _equal_length_runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """[(count, length)] for consecutive equal lengths: [3, 3, 5] -> [(2, 3), (1, 5)]."""
    runs: list[tuple[int, int]] = []
    for n in lengths:
        if runs and runs[-1][1] == n:
            runs[-1] = (runs[-1][0] + 1, n)
        else:
            runs.append((1, n))
    return runs
