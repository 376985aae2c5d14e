"""The native CPU kernels (`native/cpu_kernels.c`): each computes the product `F.linear`
computes on the same weights, a decode step in one native call gives the torch model's
logits, the choice between them is measured and cached, and without a compiler everything
falls back to torch's kernels."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F

from batchinfer import LLM, SamplingParams, native
from batchinfer.core.cpu import cpu_flags
from batchinfer.core.outputs import ScheduledSequence, SchedulerOutput
from batchinfer.models.linear_kernels import (
    KernelLinear,
    WeightForms,
    candidates,
    dequantize_q4,
    kernel_names,
    q4_affine,
    quantize_int8,
    quantize_q4,
    set_int8_inputs,
)
from batchinfer.models.llama import Rotary, apply_rope
from batchinfer.models.loader import load_model
from batchinfer.native import elementwise
from batchinfer.native.linear import (
    NativeLinear,
    dequantize_q8,
    pack_q4,
    pack_q8,
    pack_q8_groups,
    quantize_q8,
)
from batchinfer.runner.input_batch import prepare_inputs
from batchinfer.runner.model_runner import ModelRunner
from batchinfer.runner.native_decode import NativeDecoder, choose_buckets
from tests.fresh_cache import fresh_cache
from tests.test_native_levels import has_act8
from tests.tiny_models import make_tiny_llama

CPU = torch.device("cpu")
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def lib():
    built = native.library()
    if built is None:
        pytest.skip("the native kernels cannot be built here (no working C compiler)")
    return built


def weights(n: int, k: int, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.2,
            torch.randn(n, generator=g) if bias else None)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("n", "k"), [(48, 64), (32, 96), (16, 32), (80, 64), (112, 32)])
def test_native_kernels_compute_the_product_of_their_weights(lib, n, k):
    """Every row count, with and without a bias: row tiles of 4 and a remainder (few rows),
    a group's weights unpacked once for blocks of up to 32 rows (8 and more), taken 4 rows x
    4 tiles at a time and what remains of either (80 and 112 outputs: 5 and 7 tiles), threads
    taking blocks of rows (64 and more on two threads): q4, q8 and per-channel int8 against F.linear on the
    weights they hold, float32 against the weight itself. The quantized ones round each input
    group of 32 to 16-bit integers at a power-of-two scale (an error of up to 1/32767 of the
    group's largest |x|): within 2e-4."""
    for seed, with_bias in ((0, True), (1, False)):
        w, b = weights(n, k, seed, with_bias)
        forms = WeightForms(w, b)
        q4 = dequantize_q4(*quantize_q4(w))
        q8 = dequantize_q8(*pack_q8(w))
        q_int8, channel = quantize_int8(w)
        int8 = q_int8.float() * channel[:, None]
        f32 = NativeLinear(lib, native.F32, n, k, (w,), b)
        for rows in (1, 2, 3, 4, 5, 9, 13, 37, 70):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            assert relative_error(forms.kernel("q4_native")(x), F.linear(x, q4, b)) < 2e-4
            assert relative_error(forms.kernel("q8_native")(x), F.linear(x, q8, b)) < 2e-4
            assert relative_error(forms.kernel("int8_native")(x), F.linear(x, int8, b)) < 2e-4
            assert relative_error(f32(x), F.linear(x, w, b)) < 1e-5
        # inputs of any leading shape and dtype come back in that shape and dtype
        x3 = torch.randn(2, 3, k, dtype=torch.float64)
        out = forms.kernel("q4_native")(x3)
        assert out.shape == (2, 3, n) and out.dtype == torch.float64


def test_zero_and_tiny_weight_scales_give_their_weights_next_to_any_input_scale(lib):
    """A group whose scale is 0 (or below 2^-66) holds its offset (q4) or zeros (q8) whatever
    its integers say, and the many-row kernels, which fold an input group's power-of-two scale
    into the weight scale's exponent, still give F.linear on those weights: no NaN from a zero
    scale, next to input groups from 1e-20 to 1e6 (scales 2^-60 and less, up to 2^5)."""
    n, k = 32, 128
    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
    offset = torch.randn(n, k // 32, generator=g) * 0.05
    scale[0, 1] = 0.0
    scale[5, :] = 0.0
    scale[9, 2] = 1e-25
    w4 = q.float().view(n, -1, 32) * scale[..., None] + offset[..., None]
    w4[0, 1] = offset[0, 1]
    w4[5] = offset[5][:, None]
    w4[9, 2] = offset[9, 2]
    q8 = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    scale8 = scale.clone()
    w8 = q8.float() * scale8[..., None]
    w8[0, 1] = w8[5] = w8[9, 2] = 0.0
    q4_form = NativeLinear(lib, native.Q4, n, k, pack_q4(q, scale, offset), None)
    q8_form = NativeLinear(lib, native.Q8, n, k, pack_q8_groups(q8, scale8), None)
    for rows in (1, 9, 37):
        x = torch.randn(rows, k, generator=g)
        x[:, :32] *= 1e-20
        x[:, 32:64] *= 1e6
        for form, w in ((q4_form, w4.view(n, k)), (q8_form, w8.view(n, k))):
            want = F.linear(x.double(), w.double()).float()
            got = form(x)
            assert bool(torch.isfinite(got).all()), rows
            assert relative_error(got, want) < 2e-4, rows
    # a scale the exponent add would overflow is refused, naming the form
    with pytest.raises(ValueError, match="q8 weight scale"):
        pack_q8_groups(q8, scale8.masked_fill(scale8 > 0, 2.0 ** 31))


def test_q8_holds_a_q8_0_tensor_exactly_and_rounds_others_per_group():
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (32, 64), generator=g)
    q[:, ::32] = 127  # each group's largest |q|, as Q8_0 blocks have
    d = torch.rand(32, 2, 1, generator=g) * 0.01 + 1e-3
    w = (q.view(32, 2, 32).float() * d).view(32, 64)
    packed, scale = pack_q8(w)
    assert packed.shape == (2, 2, 16, 32) and scale.shape == (2, 2, 16)
    torch.testing.assert_close(dequantize_q8(packed, scale), w, rtol=1e-6, atol=0)
    back, _ = quantize_q8(w)
    assert torch.equal(back.view(32, 64), q.to(torch.int8))
    other = torch.randn(32, 64)
    err = (dequantize_q8(*pack_q8(other)) - other).abs().view(32, 2, 32)
    assert bool((err <= other.abs().view(32, 2, 32).amax(2, keepdim=True) / 254 + 1e-7).all())


def _act8_reference(x, w_int, scale, offset, bias):
    """What the 8-bit input path computes: each input group of 32 rounded to int8 by its
    largest |x| / 127, products with the weights' integers scaled per group, plus (q4) each
    group's offset times the float sum of its unrounded inputs."""
    rows, k = x.shape
    groups = k // 32
    xg = x.view(rows, groups, 32)
    top = xg.abs().amax(2, keepdim=True)
    x_hat = torch.round(xg * (127 / top)).clamp(-127, 127) * (top / 127)
    wg = w_int.float().view(w_int.shape[0], groups, 32)
    y = torch.einsum("rgi,ngi->rng", x_hat, wg)  # [rows, n, groups]
    y = (y * scale.view(1, -1, groups)).sum(2)
    if offset is not None:
        y += xg.sum(2) @ offset.view(-1, groups).T
    return y + bias


def _one_thread(check, *args) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check(*args)
    finally:
        torch.set_num_threads(threads)


def test_8_bit_inputs_compute_the_rounded_product(lib):
    """`prefill_activations int8` (where the level has 8-bit products: AVX-512 VNNI, AVX2):
    products of 8 rows and more (threads sharing the tiles below 32 rows a thread, taking
    blocks of rows from there; one thread here) round each input group to 8 bits, which moves
    them off the 16-bit results but exactly onto what the rounding implies; fewer rows keep 16
    bits. Elsewhere nothing changes."""
    _one_thread(_check_8_bit_inputs, lib)


def _check_8_bit_inputs(lib):
    w, b = weights(112, 96)  # 7 tiles: 4 together, then 3
    q4, pairs = quantize_q4(w)
    q4_scale, q4_offset = q4_affine(pairs)
    q8, q8_scale = quantize_q8(w)
    forms = WeightForms(w, b)
    cases = [(forms.kernel("q4_native"), q4, q4_scale, q4_offset),
             (forms.kernel("q8_native"), q8, q8_scale, None)]
    for kernel, w_int, scale, offset in cases:
        for rows in (5, 9, 13, 64, 97):
            x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
            kernel.int8_inputs = False
            wide = kernel(x)
            kernel.int8_inputs = True
            got = kernel(x)
            kernel.int8_inputs = False
            if lib.bi_act8() and rows >= 8:
                assert relative_error(got, _act8_reference(x, w_int, scale, offset, b)) < 1e-5
                assert relative_error(got, wide) > 1e-4  # really 8 bits
            else:
                assert torch.equal(got, wide)


def _per_sentence_sdpa(q, k, v, lengths, heads, starts=None, causal=False, scale=None):
    out = []
    starts = starts or [sum(lengths[:i]) for i in range(len(lengths))]
    for start, n in zip(starts, lengths, strict=True):
        q_s, k_s, v_s = (t[start:start + n].reshape(n, -1, q.shape[1] // heads).transpose(0, 1)
                         for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q_s[None], k_s[None], v_s[None],
                                                  is_causal=causal, scale=scale,
                                                  enable_gqa=True)[0]
        out.append(attended.transpose(0, 1).reshape(n, -1))
    return torch.cat(out)


def check_packed_attention(lib):
    """Sentences of 1 to 130 tokens (partial and whole blocks of 64 keys, query rows in fours
    and a remainder), in no particular order, as views of one fused projection: unmasked with
    as many KV heads as query heads (encoders), and causal with fewer KV heads, at given rows
    of a larger batch (a step's first prefill chunks), leaving the other rows alone."""
    lengths = [5, 1, 130, 64, 3, 17, 66, 4]
    g = torch.Generator().manual_seed(3)
    for heads, head_dim in ((3, 32), (2, 64), (4, 24)):  # vectorized sizes, and any other
        width = heads * head_dim
        qkv = torch.randn(sum(lengths), 3 * width, generator=g) * 2
        q, k, v = qkv[:, :width], qkv[:, width:2 * width], qkv[:, 2 * width:]
        got = native.packed_attention(lib, q, k, v, lengths, heads)
        want = _per_sentence_sdpa(q, k, v, lengths, heads)
        assert relative_error(got, want) < 1e-5, head_dim
    for heads, kv_heads, head_dim in ((6, 2, 64), (4, 1, 32), (3, 3, 24)):
        total = sum(lengths) + 9
        qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim, generator=g) * 2
        q = qkv[:, :heads * head_dim].contiguous()  # a separate tensor, as after RoPE
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim]
        v = qkv[:, (heads + kv_heads) * head_dim:]
        starts = [9 + sum(lengths[:i]) for i in range(len(lengths))]
        out = torch.full((total, heads * head_dim), 7.0)
        native.packed_attention(lib, q, k, v, lengths, heads, starts=starts, causal=True,
                                scale=0.3, out=out)
        want = _per_sentence_sdpa(q, k, v, lengths, heads, starts, causal=True, scale=0.3)
        assert relative_error(out[9:], want) < 1e-5, (heads, kv_heads, head_dim)
        assert bool((out[:9] == 7.0).all())  # rows outside the sentences untouched
    with pytest.raises(ValueError, match="lengths"):
        native.packed_attention(lib, q, k, v, [total + 1], heads)


def test_packed_attention_equals_per_sentence_sdpa(lib):
    check_packed_attention(lib)


def _check_elementwise(lib):
    """The decoder's RMSNorm, SiLU(gate) x up and rotation, the encoder's residual add +
    LayerNorm and GELU, in one native pass each, give torch's results (few rows on the calling
    thread, many across threads; sizes the vector loops take whole and with a remainder); a
    product adds into the residual in its epilogue."""
    g = torch.Generator().manual_seed(5)
    for rows in (1, 3, 40):
        x = torch.randn(rows, 2 * 96, generator=g) * 3
        weight = torch.randn(96, generator=g)
        part = x[:, :96]  # rows of unit stride, 192 floats apart
        want = part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
        assert relative_error(elementwise.rms_norm(lib, part, weight, 1e-5), want) < 1e-6
        gate_up = torch.randn(rows, 2 * 80, generator=g) * 4
        want = F.silu(gate_up[:, :80]) * gate_up[:, 80:]
        got = elementwise.silu_mul(lib, gate_up)
        assert got.is_contiguous() and relative_error(got, want) < 1e-5
        for head_dim in (64, 24):
            qkv = torch.randn(rows, 5, head_dim, generator=g)
            positions = torch.randint(0, 50, (rows,), generator=g)
            angles = torch.outer(torch.arange(50).float(), torch.rand(head_dim // 2, generator=g))
            cos, sin = angles.cos(), angles.sin()
            want = apply_rope(qkv[:, :3], cos[positions][:, None], sin[positions][:, None])
            untouched = qkv[:, 3:].clone()
            elementwise.rotate_(lib, qkv, 3, positions, cos, sin)
            assert relative_error(qkv[:, :3], want) < 1e-6
            assert torch.equal(qkv[:, 3:], untouched)
    for rows in (1, 3, 40):  # an encoder layer's residual add + LayerNorm, and its GELU
        a, b = torch.randn(rows, 2 * 96, generator=g)[:, 96:], torch.randn(rows, 96, generator=g)
        gamma, beta = torch.randn(96, generator=g), torch.randn(96, generator=g)
        want = F.layer_norm(a + b, (96,), gamma, beta, 1e-12)
        assert relative_error(elementwise.add_layer_norm(lib, a, b, gamma, beta, 1e-12),
                              want) < 1e-5
        out = torch.zeros(rows, 2 * 96)[:, :96]
        elementwise.add_layer_norm(lib, a, b, gamma, beta, 1e-12, out=out)
        assert relative_error(out, want) < 1e-5
        x = torch.randn(rows, 1000, generator=g) * 4  # a remainder past 16-wide chunks
        assert relative_error(elementwise.gelu_(lib, x.clone()), F.gelu(x)) < 1e-6
    w, b = weights(48, 64)
    forms = WeightForms(w, b)
    for rows in (5, 70):
        x, residual = torch.randn(rows, 64, generator=g), torch.randn(rows, 48, generator=g)
        want = residual + forms.kernel("q4_native")(x)
        forms.kernel("q4_native").add_into(residual, x)
        assert relative_error(residual, want) < 1e-6
    with pytest.raises(ValueError, match="add_into"):
        forms.kernel("q4_native").add_into(torch.zeros(5, 48).t(), torch.randn(48, 64))


def test_a_layers_element_wise_steps_run_natively_as_torch_computes_them(lib):
    _check_elementwise(lib)


def test_the_native_rotation_refuses_positions_beyond_its_tables(lib):
    """The native rotation reads its tables by position: one out of them is an IndexError
    naming the range (torch's lookup raises one too), never a read past the table."""
    cos = sin = torch.zeros(8, 4)
    for positions in ([0, 8], [-1, 2]):
        with pytest.raises(IndexError, match=r"\[0, 8\)"):
            Rotary(cos, sin, torch.tensor(positions), torch.float32)
    rotary = Rotary(cos, sin, torch.tensor([0, 7]), torch.float32)
    assert rotary.lib is lib


def test_shapes_the_layouts_cannot_take_are_refused_and_fall_back(lib):
    w, b = weights(40, 64)  # 40 outputs: no tile of 16
    forms = WeightForms(w, b)
    with pytest.raises(ValueError, match="multiple of 16"):
        forms.kernel("q4_native")
    layer = KernelLinear(WeightForms(w, b), ("q4_native", "q8_native", "q4_native", "dense"))
    assert layer.kernels == ("q4_dense", "dense", "q4_dense", "dense")
    one, three = torch.randn(1, 64), torch.randn(3, 64)  # buckets "1" and "2-8"
    torch.testing.assert_close(layer(one), F.linear(one, dequantize_q4(*quantize_q4(w)), b),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(three), F.linear(three, w, b), rtol=1e-5, atol=1e-5)


def test_without_the_library_native_kernels_are_neither_candidates_nor_forced(monkeypatch):
    monkeypatch.setattr(native, "library", lambda cache_dir=None: None)
    assert "q4_native" not in candidates("q4", CPU, torch.float32)
    with pytest.raises(ValueError, match="linear_kernels 'q4_native' cannot run here"):
        kernel_names("q4", "q4_native", CPU, torch.float32)
    # q8 is a form for the native kernels: without them it is refused, naming the knob
    with pytest.raises(ValueError, match="quantization 'q8' runs on the native CPU kernels"):
        kernel_names("q8", "auto", CPU, torch.float32)
    w, b = weights(32, 64)
    layer = KernelLinear(WeightForms(w, b), ("q4_native",) * 4)
    assert layer.kernels == ("q4_dense",) * 4
    assert layer.native == (None,) * 4


def test_a_missing_or_failing_compiler_leaves_the_torch_kernels(tmp_path, monkeypatch, caplog):
    for compiler, reason in (("/nonexistent/cc", "no C compiler"),
                             ("false", "building the native CPU kernels failed")):
        monkeypatch.setenv("CC", compiler)
        with caplog.at_level(logging.WARNING, logger="batchinfer.native"):
            assert native.library(tmp_path / compiler.strip("/").replace("/", "-")) is None
        assert reason in caplog.text
        caplog.clear()
    monkeypatch.setenv("BATCHINFER_NATIVE", "0")
    monkeypatch.delenv("CC")
    assert native.library(tmp_path / "off") is None


def _llama(tmp_path, quantization: str, kernels: str, kv_dtype: torch.dtype = torch.float32,
           **overrides):
    folder = make_tiny_llama(tmp_path, **overrides)
    loaded = load_model(str(folder), torch.float32, CPU)
    # No packed layout: an untied head's every measured kernel (dense, q8_native) then has a
    # native form, so every bucket can run natively whatever the measurement picked.
    loaded.model.choose_linear_kernels(quantization, kernels, CPU, torch.float32, None,
                                       allow_packed=False, native_decode=True)
    runner = ModelRunner(loaded.model, loaded.spec, 160, BLOCK_SIZE, CPU, kv_dtype, [2], 0,
                         calculate_kv_scales=kv_dtype in KV_FP8)
    return loaded, runner


KV_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_NARROW = (torch.float16, torch.bfloat16, *KV_FP8)


def _check_kv_conversions(lib) -> None:
    """Every cache element type: the bytes the native store writes are torch's (ties to even,
    subnormals, values past an 8-bit type's range clamped), and the native read gives their
    exact values."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(4000, generator=g) * 10 ** e for e in range(-9, 6)])
    for dtype in KV_NARROW:
        ties = torch.arange(-300, 300).to(dtype).float()
        ties = (ties[1:] + ties[:-1]) / 2  # halfway between neighbours: the even one wins
        values = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1e30, -1e30])])
        scale = 0.37 if dtype in KV_FP8 else 1.0
        if dtype in KV_FP8:
            top = torch.finfo(dtype).max
            want = (values / scale).clamp(-top, top).to(dtype)
        else:
            want = values.to(dtype)
        got = torch.empty(values.shape, dtype=dtype)
        lib.bi_kv_store(values.data_ptr(), values.numel(), native.KV_TYPES[dtype], scale,
                        got.data_ptr())
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype
        read = torch.empty(values.shape)
        lib.bi_kv_load(want.data_ptr(), want.numel(), native.KV_TYPES[dtype], read.data_ptr())
        assert torch.equal(read, want.float()), dtype


def test_kv_cache_elements_are_stored_and_read_as_torch_does(lib):
    _check_kv_conversions(lib)


def _sequences(lengths: list[int], vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    per_seq = 160 // max(4, len(lengths))  # blocks of the runner's 160: 640 tokens for four
    return [{"id": str(i), "tokens": [rng.randrange(vocab) for _ in range(n)],
             "table": list(range(i * per_seq, (i + 1) * per_seq))}
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("case", ["q4-head64", "dense-qwen2-bias", "q4-tied", "q8",
                                  "q4-13-seqs"])
def test_native_decode_steps_give_the_torch_models_logits(lib, tmp_path, case):
    """Decode steps of 1 and 3 sequences (contexts up to ~330 tokens: cut into parts that
    run on different threads and are merged), and of 11 and 13 (linears holding a group's
    weights for every row), against the torch model on the same cache: the same logits, each
    step's K/V written where the torch model writes them."""
    quantization, kernels, overrides = {
        # head_dim 64 and 2 query heads per KV head: the AVX-512 attention path
        "q4-head64": ("q4", "q4_native", {"hidden_size": 128, "num_attention_heads": 2,
                                          "num_key_value_heads": 1, "vocab_size": 320,
                                          "intermediate_size": 256}),
        "dense-qwen2-bias": ("none", "dense", {"arch": "qwen2"}),
        "q4-tied": ("q4", "q4_native", {"tie_word_embeddings": True}),
        "q8": ("q8", "q8_native", {}),
        "q4-13-seqs": ("q4", "q4_native", {}),
    }[case]
    loaded, runner = _llama(tmp_path, quantization, kernels, **overrides)
    lengths = [3, 170, 17, 40, 9, 120, 64, 1, 150, 33, 80, 5, 100] if case == "q4-13-seqs" \
        else [5, 140, 330]
    _compare_decode_steps(loaded, runner, 1e-5 if quantization == "none" else 1e-3, lengths)


@pytest.mark.parametrize("kv_dtype", KV_NARROW)
def test_native_decode_steps_read_and_write_narrower_kv_caches(lib, tmp_path, kv_dtype):
    """float16, bfloat16 and FP8 caches (FP8 with per-layer scales calibrated on the first
    step): the native step stores the K/V bytes the torch path stores and computes its
    logits."""
    loaded, runner = _llama(tmp_path, "q4", "q4_native", kv_dtype)
    assert runner.attention.name == "gather"
    _compare_decode_steps(loaded, runner, 1e-3)
    if kv_dtype in KV_FP8:
        assert {k for k, _ in runner.attention.kv_scales} != {1.0}  # calibrated


def _compare_decode_steps(loaded, runner: ModelRunner, tolerance: float,
                          lengths: tuple[int, ...] | list[int] = (5, 140, 330)) -> None:
    decoder, why = NativeDecoder.build(loaded.model, runner.attention)
    assert decoder is not None, why
    assert decoder.buckets[0] and decoder.buckets[1]
    params = SamplingParams(max_tokens=8, temperature=0)
    vocab = loaded.spec.vocab_size
    seqs = _sequences(list(lengths), vocab, seed=1)
    with torch.inference_mode():
        runner.execute(SchedulerOutput([
            ScheduledSequence(s["id"], s["tokens"], 0, s["table"], True, params,
                              len(s["tokens"])) for s in seqs]))
        rng = random.Random(2)
        for step, members in enumerate([seqs, seqs[2:], seqs, seqs[:1]]):
            scheduled = [ScheduledSequence(s["id"], [rng.randrange(vocab)], len(s["tokens"]),
                                           s["table"], True, params, len(s["tokens"]))
                         for s in members]
            inputs = prepare_inputs(scheduled, BLOCK_SIZE, CPU)
            assert decoder.accepts(inputs)
            got = decoder.logits(inputs)[inputs.logits_indices].clone()
            cache_after_native = runner.attention.kv_cache.float()
            want = runner._torch_logits(inputs)
            assert relative_error(got, want) < tolerance, step
            cache = runner.attention.kv_cache.float()
            if runner.attention.kv_dtype == torch.float32:
                assert relative_error(cache_after_native, cache) < tolerance
            else:  # K/V reach the store equal within float rounding; it rounds them alike
                assert (cache_after_native != cache).float().mean() < 1e-3
            for s, new in zip(members, scheduled, strict=True):
                s["tokens"] = s["tokens"] + new.token_ids


def test_decode_steps_of_many_sequences_take_8_bit_inputs_as_the_torch_products_do(
        lib, tmp_path):
    """`prefill_activations int8`: a native decode step of 8+ sequences rounds its layers'
    inputs to 8 bits, as the torch model's products of 8+ rows do (one thread: 12 rows share
    the tiles, 40 take blocks). Their logits sit far closer to each other than to the native
    step's own 16-bit ones (not equal: the paths' float arithmetic differs by ~1e-6, e.g. in
    exp, which moves a few values across a rounding step of this tiny model's coarse 8-bit
    groups; the products themselves are checked exactly in `test_8_bit_inputs_...`). At 5
    sequences both keep 16 bits."""
    if not lib.bi_act8():
        pytest.skip(f"the {native.isa_level(lib)} level has no 8-bit inputs")
    _one_thread(_check_8_bit_decode_steps, tmp_path)


def _check_8_bit_decode_steps(tmp_path):
    loaded, runner = _llama(tmp_path, "q4", "q4_native")
    assert set_int8_inputs(loaded.model) > 0
    decoder, _ = NativeDecoder.build(loaded.model, runner.attention)
    assert decoder is not None and decoder.int8_inputs()
    params = SamplingParams(max_tokens=8, temperature=0)
    seqs = _sequences([5 + i for i in range(40)], loaded.spec.vocab_size, seed=4)
    with torch.inference_mode():
        runner.execute(SchedulerOutput([
            ScheduledSequence(s["id"], s["tokens"], 0, s["table"], True, params,
                              len(s["tokens"])) for s in seqs]))
        for rows in (40, 12, 5):
            inputs = prepare_inputs([
                ScheduledSequence(s["id"], [7], len(s["tokens"]), s["table"], True, params,
                                  len(s["tokens"])) for s in seqs[:rows]], BLOCK_SIZE, CPU)
            eight = decoder.logits(inputs).clone()
            for entry in decoder._structs:
                if entry is not None:
                    entry[0].act8 = 0
            wide = decoder.logits(inputs).clone()
            for entry in decoder._structs:
                if entry is not None:
                    entry[0].act8 = 1
            torch_side = runner._torch_logits(inputs)
            if rows >= 8:
                assert ((eight - torch_side).abs().mean()
                        < 0.5 * (wide - torch_side).abs().mean()), rows
            else:
                assert torch.equal(eight, wide)
                assert relative_error(wide, torch_side) < 1e-3


def test_native_decode_refuses_what_it_cannot_run(lib, tmp_path):
    folder = make_tiny_llama(tmp_path)
    loaded = load_model(str(folder), torch.float32, CPU)
    loaded.model.choose_linear_kernels("q4", "q4_native", CPU, torch.float32, None,
                                       native_decode=True)
    sparse_int8 = ModelRunner(loaded.model, loaded.spec, 64, BLOCK_SIZE, CPU, torch.int8,
                              [2], 0, attention_backend="gather")
    decoder, why = NativeDecoder.build(loaded.model, sparse_int8.attention)
    assert decoder is None and "float16, bfloat16 or FP8" in why
    sdpa = ModelRunner(loaded.model, loaded.spec, 64, BLOCK_SIZE, CPU, torch.float32, [2], 0,
                       attention_backend="sdpa")
    assert NativeDecoder.build(loaded.model, sdpa.attention)[0] is None
    prefill = prepare_inputs([ScheduledSequence("a", [1, 2, 3], 0, [0], True,
                                                SamplingParams(), 3)], BLOCK_SIZE, CPU)
    gather = ModelRunner(loaded.model, loaded.spec, 64, BLOCK_SIZE, CPU, torch.float32, [2], 0,
                         attention_backend="gather")
    decoder, _ = NativeDecoder.build(loaded.model, gather.attention)
    assert decoder is not None and not decoder.accepts(prefill)  # not one token each


def test_the_native_or_torch_choice_is_measured_once_then_cached(lib, tmp_path):
    loaded, runner = _llama(tmp_path, "q4", "q4_native")
    decoder, _ = NativeDecoder.build(loaded.model, runner.attention)
    timed = []

    def torch_logits(inputs):
        timed.append(inputs.attention.num_seqs)
        return runner._torch_logits(inputs)

    # 160 blocks of 16: the 64-sequence probe (9 blocks each) does not fit: torch there
    first = choose_buckets(decoder, torch_logits, 160, tmp_path / "cache")
    assert first[3] is False
    assert sorted(set(timed)) == [1, 8]  # 32 x 9 blocks do not fit either
    (stored,) = (tmp_path / "cache" / "native-decode").glob("*.json")
    assert "seconds_per_step" in stored.read_text()

    def refuse(inputs):
        raise AssertionError("measured again")

    assert choose_buckets(decoder, refuse, 160, tmp_path / "cache") == first


def test_the_engine_decodes_the_same_tokens_natively(lib, tmp_path, monkeypatch):
    """`native_decode` on and off: the same greedy tokens (the native steps taken: the
    choice measured a tiny model's one-sequence step faster natively)."""
    fresh_cache(monkeypatch, tmp_path)
    folder = make_tiny_llama(tmp_path)
    prompts = [[5 + i, 17, 33 + i, 8] * (i + 1) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for on in (True, False):
        # no packed layout: the untied head has a native form whatever it measured fastest
        llm = LLM(str(folder), dtype="float32", kv_cache_memory=16 << 20, quantization="q4",
                  linear_kernels="q4_native", native_decode=on, prepack_weights=False)
        decoder = llm.engine.worker.runner.native_decode
        assert (decoder is not None and decoder.buckets[0]) if on else decoder is None
        single = llm.generate([prompts[0]], params, use_tqdm=False)
        batch = llm.generate(prompts, params, use_tqdm=False)
        outputs[on] = [o.outputs[0].token_ids for o in single + batch]
    assert outputs[True] == outputs[False]


def test_8_bit_prefill_inputs_reach_the_layers_but_not_the_head(lib, tmp_path, monkeypatch):
    """`prefill_activations int8`: every decoder layer's native kernel takes 8-bit inputs, the
    LM head's 8-bit form does not; a long prompt (its prefill a product of many rows) still
    decodes; an unknown value is refused, naming the knob."""
    fresh_cache(monkeypatch, tmp_path)
    folder = make_tiny_llama(tmp_path)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=16 << 20, quantization="q4",
              linear_kernels="q4_native", prefill_activations="int8")
    model = llm.engine.worker.loaded.model
    assert (llm.engine.worker.int8_input_linears > 0) == bool(lib.bi_act8())
    layer = model.layers[0].mlp.gate_up_proj
    assert all(fn.int8_inputs == bool(lib.bi_act8()) for fn in layer._fns)
    head = getattr(model, "lm_head", None)
    if head is not None:
        assert not any(getattr(fn, "int8_inputs", False) for fn in head._fns)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    out = llm.generate([[5, 17, 33, 8] * 40], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="prefill_activations"):
        LLM(str(folder), prefill_activations="int4")


def test_decoder_describes_its_buckets(lib, tmp_path):
    loaded, runner = _llama(tmp_path, "q4", "q4_native")
    decoder, _ = NativeDecoder.build(loaded.model, runner.attention)
    decoder.keep_buckets((True, False, True, False))
    assert decoder.describe() == "rows 1, 9-32"
    decoder.keep_buckets((False,) * 4)
    assert decoder.describe() == "no row bucket"


def test_decode_forms_hold_the_weights_the_chosen_kernels_read(lib):
    """A bucket whose kernel has no native form takes the decode form only when both read
    the same weights (4-bit for the q4 kernels, float for dense/packed); dropped buckets
    free theirs."""
    w, _ = weights(32, 64, bias=False)

    def kinds(layer: KernelLinear) -> list[int | None]:
        return [None if f is None else f.struct.kind for f in layer.native]

    head = KernelLinear(WeightForms(w, None), ("packed", "dense", "packed", "q8_native"),
                        "dense")
    assert kinds(head) == [native.F32, native.F32, native.F32, native.Q8]
    layer = KernelLinear(WeightForms(w, None), ("q4_bf16", "q4_native", "q4_dense", "dense"),
                         "q4_native")
    assert kinds(layer) == [native.Q4, native.Q4, native.Q4, native.F32]
    untied = KernelLinear(WeightForms(w, None), ("packed",) * 4)
    assert kinds(untied) == [None] * 4  # no float copy kept for decode steps
    layer.keep_native((True, False, False, True))
    assert kinds(layer) == [native.Q4, None, None, native.F32]


def test_the_library_is_keyed_by_the_cpus_instruction_set(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: sse avx2 avx512f\nmodel name\t: X\n")
    assert cpu_flags(info) == {"avx2", "avx512f", "sse"}
    info.write_text("Features\t: fp asimd\n")
    assert cpu_flags(info) == {"asimd", "fp"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_isa_levels_follow_the_cpus_flags(caplog):
    """The levels a CPU runs come from its flags on x86 (`neon` and `portable` on 64-bit Arm,
    only `portable` elsewhere); the best loads
    unless `BATCHINFER_CPU_ISA` names one; one the CPU lacks steps down, logged; an unknown
    name is an error."""
    v3 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "sse4_2", "ssse3", "popcnt",
          "cx16"}
    every = frozenset(v3 | {"avx512f", "avx512bw"})
    assert native.supported_levels(every, "x86_64") == ("avx512", "avx2", "portable")
    assert native.supported_levels(frozenset(v3), "x86_64") == ("avx2", "portable")
    assert native.supported_levels(frozenset({"avx2", "sse4_2"}), "x86_64") == ("portable",)
    assert native.supported_levels(every, "aarch64") == ("neon", "portable")
    assert native.supported_levels(every, "riscv64") == ("portable",)
    assert native.choose_level(None, ("avx2", "portable")) == "avx2"
    assert native.choose_level("auto", ("avx512", "avx2", "portable")) == "avx512"
    assert native.choose_level("portable", ("avx512", "avx2", "portable")) == "portable"
    with caplog.at_level(logging.WARNING, logger="batchinfer.native"):
        assert native.choose_level("avx512", ("avx2", "portable")) == "avx2"
    assert "lacks" in caplog.text
    with pytest.raises(ValueError, match="BATCHINFER_CPU_ISA"):
        native.choose_level("sse9", ("avx2", "portable"))
    assert "-march=x86-64-v3" in native.level_flags("avx2", "x86_64")
    assert "-march=x86-64-v2" in native.level_flags("portable", "x86_64", frozenset(v3))
    assert not any(f.startswith("-march") for f in native.level_flags("portable", "x86_64",
                                                                      frozenset()))
    assert "-march=native" in native.level_flags("portable", "aarch64")
    assert "-DBI_FORCE_PORTABLE" in native.level_flags("portable", "aarch64")
    assert "-DBI_FORCE_PORTABLE" not in native.level_flags("neon", "aarch64")
    with pytest.raises(ValueError, match="unknown ISA level"):
        native.level_flags("sse9")


def test_the_environment_chooses_the_level_that_loads(lib, monkeypatch):
    """`BATCHINFER_CPU_ISA` loads that level's build (`bi_isa()` says which); unset, the best
    this CPU runs loads; an unknown name is a `ValueError`; a level asked for by argument that
    the CPU lacks is refused."""
    supported = native.supported_levels()
    monkeypatch.delenv("BATCHINFER_CPU_ISA", raising=False)
    assert native.isa_level() == supported[0]
    for level in supported:
        monkeypatch.setenv("BATCHINFER_CPU_ISA", level)
        assert native.library().bi_isa().decode() == level
        assert native.isa_level() == level
    monkeypatch.setenv("BATCHINFER_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="BATCHINFER_CPU_ISA"):
        native.library()
    monkeypatch.delenv("BATCHINFER_CPU_ISA")
    lacking = [level for level in native.ISA_LEVELS if level not in supported]
    for level in lacking:
        with pytest.raises(ValueError, match="this CPU runs"):
            native.library(level=level)


def _level_library(level: str):
    if level not in native.supported_levels():
        pytest.skip(f"this CPU does not run the {level} build")
    built = native.library(level=level)
    if built is None:
        pytest.skip("the native kernels cannot be built here (no working C compiler)")
    assert built.bi_isa().decode() == level
    assert built.bi_avx512() == (level == "avx512")
    return built


LINEAR_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 130)


@pytest.mark.parametrize("level", native.ISA_LEVELS)
def test_every_isa_level_computes_the_products_of_their_weights(level, monkeypatch):
    """Each level's build (AVX-512, AVX2, portable C), q4 / q8 / float32 products at shapes
    that take whole tiles of 4 and of 16 and a remainder, 1 to 130 rows (remainders of 4, 8,
    16 and 32), on 1 to 3 threads: F.linear on the weights they hold, within the tolerances of
    `test_native_kernels_compute_the_product_of_their_weights`."""
    built = _level_library(level)
    monkeypatch.setattr(native, "library", lambda cache_dir=None, level=None: built)
    threads = torch.get_num_threads()
    try:
        for n, k, seed in ((16, 32, 0), (80, 96, 1), (112, 160, 2)):
            w, b = weights(n, k, seed, bias=seed != 1)
            forms = WeightForms(w, b)
            q4 = dequantize_q4(*quantize_q4(w))
            q8 = dequantize_q8(*pack_q8(w))
            f32 = NativeLinear(built, native.F32, n, k, (w,), b)
            for rows in LINEAR_ROWS:
                torch.set_num_threads(1 + rows % 3)
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                assert relative_error(forms.kernel("q4_native")(x),
                                      F.linear(x, q4, b)) < 2e-4, (n, k, rows)
                assert relative_error(forms.kernel("q8_native")(x),
                                      F.linear(x, q8, b)) < 2e-4, (n, k, rows)
                assert relative_error(f32(x), F.linear(x, w, b)) < 1e-5, (n, k, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("level", native.ISA_LEVELS)
def test_every_isa_level_computes_the_same_attention_and_decode_steps(level, lib, tmp_path,
                                                                      monkeypatch):
    """Each level's build other than the default one (which the rest of this file tests):
    packed attention, the KV cache conversions, the element-wise passes, products and decode
    steps with 8-bit inputs where the level has them (else the 16-bit inputs where 8-bit ones
    are asked for), and decode steps over float32, float16, bfloat16 and e5m2 caches (head
    sizes 16 and 64) give what torch gives."""
    built = _level_library(level)
    if level == native.isa_level(lib):
        pytest.skip("the default build: tested by the rest of this file")
    monkeypatch.setattr(native, "library", lambda cache_dir=None, level=None: built)
    check_packed_attention(built)
    _check_kv_conversions(built)
    _check_elementwise(built)
    # 8-bit products: AVX2, AVX-512 VNNI, NEON dot products; elsewhere the 16-bit inputs run
    assert built.bi_act8() == has_act8(level)
    if built.bi_act8():
        _one_thread(_check_8_bit_inputs, built)
        _one_thread(_check_8_bit_decode_steps, tmp_path / "act8")
    else:
        w, b = weights(48, 64)
        q4 = WeightForms(w, b).kernel("q4_native")
        many = torch.randn(70, 64)
        wide = q4(many)
        q4.int8_inputs = True
        assert torch.equal(q4(many), wide)
    head64 = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
              "vocab_size": 320, "intermediate_size": 256}  # the fixed-size attention kernels
    for name, kv_dtype, overrides in (("f32", torch.float32, {}),
                                      ("f32-head64", torch.float32, head64),
                                      ("f16-head64", torch.float16, head64),
                                      ("bf16-head64", torch.bfloat16, head64),
                                      ("e5m2-head64", torch.float8_e5m2, head64)):
        loaded, runner = _llama(tmp_path / name, "q4", "q4_native", kv_dtype, **overrides)
        _compare_decode_steps(loaded, runner, 1e-3)
