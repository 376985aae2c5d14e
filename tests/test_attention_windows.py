"""Sliding windows and soft-capped scores in every attention backend, against float64 dense
attention: decodes, first chunks longer than the window, chunks after a cached prefix, and
sequences whose blocks before the window were dropped (filled with NaN here: a backend that
read one would answer NaN). The triton backend runs under Triton's interpreter
(`TRITON_INTERPRET=1`, set by tests/conftest.py without a GPU), where triton is installed."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from batchinfer.core.outputs import ScheduledSequence
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.models.spec import LayerAttention
from batchinfer.runner.attention import select_attention_backend
from batchinfer.runner.backends.triton import supports_triton
from tests.test_runner_attention import CPU, Case, Spec, _step, make_case

# (num_computed_tokens, num_new_tokens): decodes short of, at and far past the window, first
# chunks shorter and longer than it, later chunks whose window starts inside the cached prefix.
SHAPES = [(0, 1), (3, 1), (10, 1), (11, 1), (40, 1), (73, 1), (0, 6), (0, 30), (5, 9),
          (33, 20), (60, 3)]
WINDOW = 11
BLOCK_SIZE = 4
SCALE = 0.3
LAYERS = {
    "window": LayerAttention(SCALE, WINDOW),
    "softcap": LayerAttention(SCALE, None, 1.5),
    "window-softcap": LayerAttention(SCALE, WINDOW, 1.5),
}


def dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int,
          layer: LayerAttention) -> torch.Tensor:
    """Float64 attention of queries at positions `first..` over `keys`/`values` `[ctx, kv, d]`
    as `layer` attends: scale, window, soft-capping (transformers' formulas)."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * layer.scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    query_pos = torch.arange(q.shape[0])[:, None] + first
    key_pos = torch.arange(keys.shape[0])
    hidden = key_pos > query_pos
    if layer.window is not None:
        hidden |= key_pos <= query_pos - layer.window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, -math.inf).softmax(-1),
                        values)


def num_dropped(num_computed: int, window: int | None) -> int:
    """Leading blocks wholly before the window of a chunk's first query."""
    return 0 if window is None else max(0, num_computed - window + 1) // BLOCK_SIZE


def run_windowed(name: str, case: Case, layer: LayerAttention, dtype: torch.dtype,
                 drop: bool) -> list[torch.Tensor]:
    """Outputs per sequence of `case` at layer 1 attending as `layer`; with `drop`, the step
    runs with the blocks before each window dropped from its table and filled with NaN."""
    head_dim, num_kv_heads = case.keys[0].shape[-1], case.keys[0].shape[1]
    backend = select_attention_backend(CPU, dtype, name)
    backend.allocate_kv_cache(Spec(2, num_kv_heads, head_dim), case.num_blocks, case.block_size)
    backend.set_layers([LayerAttention(head_dim**-0.5), layer])
    backend.kv_cache.normal_()
    prefixes = [ScheduledSequence(s.request_id, [1] * s.num_computed_tokens, 0, s.block_table,
                                  True, SamplingParams(), s.num_computed_tokens)
                for s in case.sequences if s.num_computed_tokens > 0]
    sequences = case.sequences
    with torch.inference_mode():
        if prefixes:
            _step(backend, case, prefixes, 1, CPU)
        if drop:
            sequences = []
            for seq in case.sequences:
                dropped = num_dropped(seq.num_computed_tokens, layer.window)
                _poison(backend, name, seq.block_table[:dropped])
                sequences.append(dataclasses.replace(
                    seq, block_table=seq.block_table[dropped:], num_dropped_blocks=dropped))
        return _step(backend, case, sequences, 1, CPU)


def _poison(backend: object, name: str, blocks: list[int]) -> None:
    cache = backend.kv_cache  # type: ignore[attr-defined]
    for block in blocks:  # layer 1's K and V of the block, in the backend's layout
        if name in ("sdpa", "triton"):
            cache[1, :, block] = math.nan
        else:
            cache[1, block] = math.nan


def backends() -> list[object]:
    names: list[object] = ["sdpa", "gather", "cpu_sparse"]
    if supports_triton(CPU):  # the interpreter is slow: one case in the default run
        names.append(pytest.param("triton", marks=pytest.mark.slow))
    return names


def test_triton_window_and_softcap_with_dropped_blocks() -> None:
    if not supports_triton(CPU):
        pytest.skip("triton is not installed")
    test_windowed_and_capped_attention_equals_dense("triton", "window-softcap", True)


@pytest.mark.parametrize("drop", [False, True], ids=["kept", "dropped"])
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("backend", backends())
def test_windowed_and_capped_attention_equals_dense(backend: str, layer: str,
                                                    drop: bool) -> None:
    if drop and LAYERS[layer].window is None:
        pytest.skip("nothing lies outside a window")
    case = make_case(SHAPES, 31, torch.float32, 6, 2, 16, BLOCK_SIZE)
    outputs = run_windowed(backend, case, LAYERS[layer], torch.float32, drop)
    for i, (seq, out) in enumerate(zip(case.sequences, outputs, strict=True)):
        first, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_tokens
        expected = dense(case.queries[i][first:end], case.keys[i][:end], case.values[i][:end],
                         first, LAYERS[layer])
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0,
                                   msg=lambda m, i=i: f"sequence {i}: {m}")


@pytest.mark.parametrize("backend", ["sdpa", "gather"])
def test_windowed_attention_over_a_bfloat16_cache(backend: str) -> None:
    case = make_case(SHAPES, 32, torch.bfloat16, 6, 2, 16, BLOCK_SIZE)
    layer = LAYERS["window-softcap"]
    outputs = run_windowed(backend, case, layer, torch.bfloat16, drop=True)
    for i, (seq, out) in enumerate(zip(case.sequences, outputs, strict=True)):
        first, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_tokens
        expected = dense(case.queries[i][first:end], case.keys[i][:end], case.values[i][:end],
                         first, layer)
        torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=0)


def test_the_window_changes_the_output() -> None:
    """The comparison is not vacuous: the window hides keys that would change the answer."""
    case = make_case(SHAPES, 33, torch.float32, 6, 2, 16, BLOCK_SIZE)
    windowed = run_windowed("sdpa", case, LAYERS["window"], torch.float32, drop=False)
    full = run_windowed("sdpa", case, LayerAttention(SCALE), torch.float32, drop=False)
    far = [i for i, s in enumerate(case.sequences)
           if s.num_computed_tokens + s.num_tokens > WINDOW]
    assert far and all(not torch.allclose(windowed[i], full[i], atol=1e-3) for i in far)


@pytest.mark.skipif(os.environ.get("BATCHINFER_NATIVE") == "0", reason="native kernels off")
def test_native_first_chunks_leave_windows_longer_chunks_to_the_loop() -> None:
    """The native first-chunk call computes plain causal attention: it takes no chunk longer
    than the window, and nothing soft-capped, and the answer stays exact either way."""
    from batchinfer.runner.backends.prefill import _native_first_chunks, build_chunks
    from batchinfer.runner.input_batch import prepare_inputs

    case = make_case([(0, 6), (0, 30)], 34, torch.float32, 6, 2, 16, BLOCK_SIZE)
    metadata = prepare_inputs(case.sequences, BLOCK_SIZE, CPU).attention
    chunks = build_chunks(metadata, 0)
    q, k = torch.randn(36, 6, 16), torch.randn(36, 2, 16)
    out = torch.empty_like(q)
    assert not _native_first_chunks(out, q, k, k, chunks, LAYERS["window"])
    assert not _native_first_chunks(out, q, k, k, chunks[:1], LAYERS["softcap"])
    short = LayerAttention(SCALE, 30)
    from batchinfer import native
    assert _native_first_chunks(out, q, k, k, chunks, short) == (native.library() is not None)
