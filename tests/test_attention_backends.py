"""Every attention backend agrees with the `sdpa` reference on the same mixed steps.

The steps mix decodes of very different context lengths (so the grouping backends cut several
decode groups and pad shorter contexts inside a group), first prefill chunks and chunks after a
cached prefix, under GQA, MHA and MQA head shapes, with float32 and bfloat16 caches. Also the
backend contract: cache size, selection by name, errors.
"""

from __future__ import annotations

import random

import pytest
import torch

from batchinfer.runner.attention import ATTENTION_BACKENDS, select_attention_backend
from batchinfer.runner.backends.paged_rows import PagedRowsBackend, group_decodes
from batchinfer.runner.input_batch import prepare_inputs
from batchinfer.runner.kv_cache import bytes_per_block
from tests.test_runner_attention import CPU, Case, Spec, make_case, run_backend


def _mixed_shapes(seed: int) -> list[tuple[int, int]]:
    """(num_computed_tokens, num_new_tokens) of a step, shuffled.

    Decodes: short contexts across block boundaries (one a one-token prompt), a cluster of 24
    at 200-330 tokens, two far longer ones. Prefill chunks: first chunks of 20, 5 and 2 tokens;
    chunks after cached prefixes of 19, 7, 100 and 500 tokens.
    """
    rng = random.Random(seed)
    shapes = (
        [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (8, 1), (15, 1), (16, 1)]
        + [(rng.randint(200, 330), 1) for _ in range(24)]
        + [(600, 1), (1000, 1)]
        + [(0, 20), (19, 17), (0, 5), (7, 33), (100, 3), (0, 2), (500, 64)]
    )
    rng.shuffle(shapes)
    return shapes


MIXED_SHAPES = _mixed_shapes(7)
# (num_heads, num_kv_heads, head_dim, block_size): grouped-query, multi-head, multi-query.
HEAD_SHAPES = [(6, 2, 16, 4), (6, 2, 16, 16), (4, 4, 16, 8), (8, 1, 32, 16)]
FAST_CASES = [
    ("gather", torch.float32),
    ("gather", torch.bfloat16),
    ("cpu_sparse", torch.float32),
]


def _tolerance(dtype: torch.dtype) -> float:
    """atol and rtol: float32 rounding, or a few bf16 ulps of outputs of magnitude <= 1."""
    return 2e-5 if dtype == torch.float32 else 2e-2


def _assert_all_close(
    outputs: list[torch.Tensor], expected: list[torch.Tensor], tolerance: float
) -> None:
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        try:
            torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)
        except AssertionError as error:
            raise AssertionError(f"sequence {i}: {error}") from None


def _check_grouping_is_exercised(backend_name: str, case: Case, dtype: torch.dtype) -> None:
    """The case must make `backend_name` cut several decode groups, some padded."""
    head_dim, num_kv_heads = case.keys[0].shape[-1], case.keys[0].shape[1]
    backend = select_attention_backend(CPU, dtype, backend_name)
    if not isinstance(backend, PagedRowsBackend):
        raise AssertionError(f"{backend_name} does not group decodes")
    backend.allocate_kv_cache(Spec(1, num_kv_heads, head_dim), 1, case.block_size)
    metadata = prepare_inputs(case.sequences, case.block_size, CPU).attention
    lens = metadata.context_lens[: metadata.num_decodes]
    groups = group_decodes(lens, case.block_size, backend.decode_grouping())
    num_blocks = [-(-n // case.block_size) for n in lens]
    padded = [(start, end) for start, end in groups if num_blocks[start] < num_blocks[end - 1]]
    assert len(groups) >= 3 and padded, groups


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), HEAD_SHAPES)
@pytest.mark.parametrize(("backend", "dtype"), FAST_CASES)
def test_backend_matches_sdpa_reference(
    backend: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int,
) -> None:
    case = make_case(MIXED_SHAPES, 11, dtype, num_heads, num_kv_heads, head_dim, block_size)
    _check_grouping_is_exercised(backend, case, dtype)
    expected = run_backend("sdpa", case, dtype)
    _assert_all_close(run_backend(backend, case, dtype), expected, _tolerance(dtype))


@pytest.mark.parametrize("backend", ["sdpa", "gather"])
def test_float32_model_over_bfloat16_cache(backend: str) -> None:
    """q/k/v in float32, cache in bfloat16: each backend stays within cache rounding of float32."""
    case = make_case(MIXED_SHAPES, 12, torch.float32, block_size=8)
    expected = run_backend("sdpa", case, torch.float32)
    _assert_all_close(run_backend(backend, case, torch.bfloat16), expected, 3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["sdpa", "gather"])
def test_cuda_matches_cpu_reference(backend: str, dtype: torch.dtype) -> None:
    case = make_case(MIXED_SHAPES, 16, dtype, block_size=16)
    expected = run_backend("sdpa", case, dtype)
    outputs = run_backend(backend, case, dtype, device=torch.device("cuda"))
    _assert_all_close(outputs, expected, 1e-3 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(("backend", "dtype"), FAST_CASES)
def test_comparison_catches_one_wrong_cached_value(backend: str, dtype: torch.dtype) -> None:
    """The reference comparison is not vacuous: one cached value changed in one context fails."""
    case = make_case(MIXED_SHAPES, 13, dtype, block_size=8)
    outputs = run_backend(backend, case, dtype)
    i = max(range(len(case.sequences)), key=lambda j: case.sequences[j].num_computed_tokens)
    case.values[i][case.sequences[i].num_computed_tokens // 2] += 100.0
    with pytest.raises(AssertionError, match=f"sequence {i}:"):
        _assert_all_close(outputs, run_backend("sdpa", case, dtype), _tolerance(dtype))


@pytest.mark.parametrize("backend", ["sdpa", "gather", "cpu_sparse"])
def test_cache_size_layers_and_zeroing(backend: str) -> None:
    spec = Spec(3, 2, 16)
    attention = select_attention_backend(CPU, torch.float32, backend)
    assert attention.name == backend
    attention.allocate_kv_cache(spec, 10, 8)
    cache = attention.kv_cache
    assert cache.numel() * cache.element_size() == 10 * bytes_per_block(spec, 8, torch.float32)
    assert cache.shape[0] == 3 and not cache.any()
    # A step at layer 1 writes layer 1 only.
    case = make_case([(0, 7), (0, 1)], 14, torch.float32, num_kv_heads=2, head_dim=16)
    inputs = prepare_inputs(case.sequences, 8, CPU)
    q, k = torch.randn(8, 6, 16), torch.randn(8, 2, 16)
    with torch.inference_mode():
        attention.build(inputs.attention)
        attention(1, q, k, k + 1)
    assert cache[1].count_nonzero() == 2 * 8 * 2 * 16
    assert not cache[0].any() and not cache[2].any()


def test_auto_selection_and_names() -> None:
    assert set(ATTENTION_BACKENDS) == {"auto", "sdpa", "gather", "cpu_sparse", "triton"}
    assert select_attention_backend(CPU, torch.float32).name == "cpu_sparse"
    assert select_attention_backend(CPU, torch.bfloat16).name == "gather"
    assert select_attention_backend(torch.device("meta"), torch.float32, "auto").name == "gather"
    with pytest.raises(ValueError, match="attention_backend"):
        select_attention_backend(CPU, torch.float32, "flash")
    with pytest.raises(ValueError, match="attention_backend cpu_sparse"):
        select_attention_backend(CPU, torch.bfloat16, "cpu_sparse")


@pytest.mark.parametrize("backend", ["sdpa", "gather", "cpu_sparse"])
def test_build_needs_a_matching_cache(backend: str) -> None:
    """Misuse is a RuntimeError (broken invariant), a bad size a ValueError."""
    attention = select_attention_backend(CPU, torch.float32, backend)
    metadata = prepare_inputs(make_case([(3, 1)], 15, torch.float32).sequences, 8, CPU).attention
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        attention.build(metadata)
    attention.allocate_kv_cache(Spec(), 4, 16)
    with pytest.raises(RuntimeError, match="before build"):
        attention(0, torch.zeros(1, 6, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
    with pytest.raises(RuntimeError, match="block_size"):
        attention.build(metadata)
    with pytest.raises(ValueError, match="num_blocks"):
        attention.allocate_kv_cache(Spec(), 0, 16)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("backend", ["sdpa", "gather"])
def test_fp8_cache_attends_exactly_over_its_stored_values(backend: str, kv_dtype: torch.dtype):
    """An FP8 cache: the output equals float64 attention over the K/V as stored (rounded to
    FP8) to float32 rounding, and stays within the documented distance of attention over the
    unrounded K/V (first chunks of several tokens attend their own K/V at model precision)."""
    from tests.test_runner_attention import _dense

    case = make_case(MIXED_SHAPES, 14, torch.float32, block_size=8)
    outputs = run_backend(backend, case, kv_dtype)
    worst = 0.0
    for seq, out, queries, keys, values in zip(case.sequences, outputs, case.queries,
                                               case.keys, case.values, strict=True):
        first, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_tokens
        stored_k, stored_v = keys[:end], values[:end]
        # Read back from the cache (the values as stored): a later chunk, and with the paged
        # backends any one-token query (they attend every decode from the cache).
        if first > 0 or (backend != "sdpa" and seq.num_tokens == 1):
            stored_k, stored_v = (x.to(kv_dtype).to(torch.float32) for x in (keys[:end],
                                                                              values[:end]))
        torch.testing.assert_close(out.double(), _dense(queries[first:end], stored_k, stored_v,
                                                       first), atol=1e-5, rtol=1e-5)
        exact = _dense(queries[first:end], keys[:end], values[:end], first)
        relative = (out.double() - exact).abs().max() / values[:end].abs().max()
        worst = max(worst, float(relative))
    # The documented tolerance: the type's rounding (2^-4 for e4m3, 2^-3 for e5m2) of the
    # largest |V|, with a little room for the rounding of K moving the weights.
    assert 0 < worst < (0.08 if kv_dtype == torch.float8_e4m3fn else 0.16)


@pytest.mark.parametrize("one_block_at_a_time", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("backend", ["sdpa", "gather"])
def test_swap_out_and_in_moves_whole_blocks_bit_for_bit(
    backend: str, kv_dtype: torch.dtype, one_block_at_a_time: bool, monkeypatch
):
    """Blocks copied to host blocks and back into other device blocks hold the same bytes in
    every layer, K and V; blocks not named are untouched (copied in one go, or in chunks of
    one block)."""
    if one_block_at_a_time:
        from batchinfer.runner.backends import base

        monkeypatch.setattr(base, "SWAP_CHUNK_BYTES", 1)
    spec = Spec(3, 2, 16)
    attention = select_attention_backend(CPU, kv_dtype, backend)
    attention.allocate_kv_cache(spec, 8, 4)
    attention.allocate_swap_space(5)
    raw = attention.kv_cache.view(torch.uint8) if kv_dtype.itemsize == 1 else attention.kv_cache
    raw.copy_(torch.randn(raw.shape).to(raw.dtype) if kv_dtype.itemsize > 1
              else torch.randint(0, 120, raw.shape, dtype=torch.uint8))
    dim = attention.block_dim
    before = attention.kv_cache.clone()
    attention.swap_out([(1, 4), (6, 0)])
    attention.swap_in([(4, 2), (0, 3)])  # device block 1 -> 2, 6 -> 3, through the host
    after = attention.kv_cache
    for source, target in [(1, 2), (6, 3)]:
        assert torch.equal(after.select(dim, target).view(torch.uint8),
                           before.select(dim, source).view(torch.uint8))
    for untouched in (0, 1, 4, 5, 6, 7):
        assert torch.equal(after.select(dim, untouched).view(torch.uint8),
                           before.select(dim, untouched).view(torch.uint8))
    assert attention.swap_space.shape[dim] == 5 and attention.swap_space.device.type == "cpu"
