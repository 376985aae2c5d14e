"""The `triton` backend's kernels, run by Triton's interpreter on CPU tensors, against the
`sdpa` reference and float64 dense attention: decodes across block boundaries (split-K),
first chunks and chunks after a cached prefix in one step (varlen), GQA / MHA / MQA, every KV
dtype with and without FP8 scales; and the engine's greedy tokens with it equal `sdpa`'s."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton sees a kernel

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from batchinfer.runner.attention import select_attention_backend  # noqa: E402
from batchinfer.runner.backends.triton import TritonBackend  # noqa: E402
from batchinfer.runner.backends.triton.decode import num_splits_for  # noqa: E402
from tests.test_attention_backends import _assert_all_close  # noqa: E402
from tests.test_runner_attention import CPU, _dense, make_case, run_backend  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter was turned off for this run")

# (num_computed_tokens, num_new_tokens): decodes from a one-token prompt to 70 tokens (several
# splits), first chunks of 1-19 tokens, chunks after cached prefixes (one longer than a tile).
SHAPES = [(0, 1), (3, 1), (15, 1), (16, 1), (70, 1), (33, 1), (0, 19), (0, 3), (9, 12),
          (21, 40), (5, 1)]
# (num_heads, num_kv_heads, head_dim, block_size)
SLOW = pytest.mark.slow  # the interpreter is slow: the default run keeps one case of each kind
HEADS = [(6, 2, 16, 4), pytest.param(4, 4, 16, 8, marks=SLOW), (8, 1, 32, 16),
         pytest.param(4, 2, 24, 16, marks=SLOW)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3,
             torch.float8_e4m3fn: 1.5e-1, torch.float8_e5m2: 3e-1}


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), HEADS)
def test_triton_matches_sdpa_float32(num_heads, num_kv_heads, head_dim, block_size):
    case = make_case(SHAPES, 21, torch.float32, num_heads, num_kv_heads, head_dim, block_size)
    expected = run_backend("sdpa", case, torch.float32)
    _assert_all_close(run_backend("triton", case, torch.float32), expected, 2e-5)


def test_triton_equals_float64_dense_attention():
    case = make_case(SHAPES, 20, torch.float32, 8, 2, 32, 8)
    outputs = run_backend("triton", case, torch.float32)
    for seq, out, queries, keys, values in zip(case.sequences, outputs, case.queries, case.keys,
                                               case.values, strict=True):
        first, context_len = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_tokens
        expected = _dense(queries[first:], keys[:context_len], values[:context_len], first)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_dtype", [
    pytest.param(torch.bfloat16, marks=SLOW), pytest.param(torch.float16, marks=SLOW),
    torch.float8_e4m3fn, pytest.param(torch.float8_e5m2, marks=SLOW)])
def test_triton_matches_sdpa_over_every_kv_dtype(kv_dtype):
    """float32 queries over a narrower cache: both backends read the same stored values."""
    case = make_case(SHAPES, 22, torch.float32, 6, 2, 16, 8)
    expected = run_backend("sdpa", case, kv_dtype)
    _assert_all_close(run_backend("triton", case, kv_dtype), expected, TOLERANCE[kv_dtype])


@SLOW
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_sdpa_in_half_precision(dtype):
    case = make_case(SHAPES, 23, dtype, 6, 2, 16, 8)
    expected = run_backend("sdpa", case, dtype)
    _assert_all_close(run_backend("triton", case, dtype), expected, TOLERANCE[dtype])


@SLOW
def test_fp8_scales_are_folded_in_as_sdpa_does():
    """Calibrated per-layer scales (not 1.0): the same outputs as `sdpa` with the same scales."""
    case = make_case(SHAPES, 24, torch.float32, 6, 2, 16, 8)
    outputs = {}
    for name in ("sdpa", "triton"):
        backend = select_attention_backend(CPU, torch.float8_e4m3fn, name,
                                           calculate_kv_scales=True)
        outputs[name] = _run_with(backend, case)
        assert backend.kv_scales[1] != (1.0, 1.0)
    _assert_all_close(outputs["triton"], outputs["sdpa"], TOLERANCE[torch.float8_e4m3fn])


def _run_with(backend, case):
    import tests.test_runner_attention as reference

    original = reference.select_attention_backend
    reference.select_attention_backend = lambda *args, **kwargs: backend
    try:
        return run_backend(backend.name, case, backend.kv_dtype)
    finally:
        reference.select_attention_backend = original


def test_the_comparison_catches_one_wrong_cached_value():
    case = make_case(SHAPES, 25, torch.float32, 6, 2, 16, 8)
    outputs = run_backend("triton", case, torch.float32)
    i = max(range(len(case.sequences)), key=lambda j: case.sequences[j].num_computed_tokens)
    case.values[i][case.sequences[i].num_computed_tokens // 2] += 100.0
    with pytest.raises(AssertionError, match=f"sequence {i}:"):
        _assert_all_close(outputs, run_backend("sdpa", case, torch.float32), 2e-5)


def test_split_k_is_exercised():
    assert num_splits_for(max_blocks=18, num_decodes=4, num_kv_heads=2) > 1
    assert num_splits_for(max_blocks=1, num_decodes=1, num_kv_heads=1) == 1


def test_triton_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton"):
        TritonBackend(CPU, torch.float32)


# float16 overflows 1e6 to inf, as torch does; the interpreter's numpy says so.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16,
                                      torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_kv_write_stores_what_torch_rounds_to(kv_dtype):
    """Every magnitude from float8's subnormals to its largest values, halfway cases, zeros:
    the stored bits equal torch's `.to(kv_dtype)` of the scaled, clamped values."""
    from batchinfer.runner.backends.triton.kv_write import write_kv

    generator = torch.Generator().manual_seed(5)
    magnitudes = 10.0 ** (torch.rand(96, 2, 16, generator=generator) * 11 - 8)
    k = torch.randn(96, 2, 16, generator=generator) * magnitudes
    k[0, 0, :8] = torch.tensor([0.0, -0.0, 4.5, -4.5, 2.0 ** -10, 3 * 2.0 ** -17, 1e6, -1e6])
    v = -k.flip(0)
    key_cache = torch.zeros(12, 8, 2, 16, dtype=kv_dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(96, generator=generator)
    scales = (0.5, 2.0) if kv_dtype.itemsize == 1 else (1.0, 1.0)
    write_kv(k, v, key_cache, value_cache, slots, scales)
    top = torch.finfo(kv_dtype).max
    for cache, x, scale in ((key_cache, k, scales[0]), (value_cache, v, scales[1])):
        expected = torch.zeros_like(cache)
        stored = (x / scale).clamp(-top, top) if kv_dtype.itemsize == 1 else x
        expected.view(-1, 2, 16)[slots] = stored.to(kv_dtype)
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_the_engines_greedy_tokens_with_triton_equal_sdpas(tmp_path):
    """Prefill chunks, decodes and a cached prefix through the whole engine, interpreted."""
    from batchinfer import LLM, SamplingParams
    from tests.tiny_models import make_tiny_llama

    model_dir = str(make_tiny_llama(tmp_path))
    prompts = [[5, 9, 17, 2, 33, 41, 7, 8, 90, 12, 4], [7, 7, 3], [5, 9, 17, 2, 33, 41, 7, 8, 1]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("sdpa", "triton"):
        llm = LLM(model_dir, dtype="float32", kv_cache_memory=1 << 20, block_size=4,
                  max_num_batched_tokens=16, max_model_len=64, enable_prefix_caching=True,
                  attention_backend=backend)
        assert llm.engine.core.runner.attention.name == backend
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["sdpa"]
