"""Linear kernels chosen by measurement: every kernel computes the same product as `F.linear`
(int8 ones: that of the dequantized weights), dispatch follows the row buckets, the choice is
cached and read back, and kernels that cannot run here are never chosen (a forced one is a
`ValueError` naming the knob)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchinfer import LLM, SamplingParams
from batchinfer.models import linear_kernels as lk
from batchinfer.models.linear_kernels import (
    KernelLinear,
    WeightForms,
    apply_kernels,
    bucket_of,
    candidates,
    choose_kernels,
    dequantize_q4,
    q4_supported,
    quantize_int8,
    quantize_q4,
)
from batchinfer.native.linear import NativeLinear, quantize_q8
from tests.fresh_cache import fresh_cache
from tests.test_engine import hf_greedy, random_prompts
from tests.tiny_models import make_tiny_llama

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def weights(n: int = 48, k: int = 64, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    return w, (torch.randn(n, generator=g) if bias else None)


@pytest.mark.parametrize("rows", [1, 5, 20, 100])
@pytest.mark.parametrize("bias", [True, False])
def test_every_kernel_computes_the_dense_product(rows, bias):
    w, b = weights(bias=bias)
    x = torch.randn(rows, 2 * w.shape[1])[:, ::2]  # strided, as the MLP's gate half is
    want = F.linear(x, w, b)
    forms = WeightForms(w, b)
    for name in candidates("none", CPU, torch.float32):
        torch.testing.assert_close(forms.kernel(name)(x), want, atol=1e-5, rtol=1e-5)
    q, scale = quantize_int8(w)
    dequantized = q.float() * scale[:, None]
    want_int8 = F.linear(x, dequantized, b)
    int8 = WeightForms(w, b)
    for name in ("int8", "int8_dense"):
        torch.testing.assert_close(int8.kernel(name)(x), want_int8, atol=1e-5, rtol=1e-5)
    # activations rounded to bfloat16 (8 bits of mantissa): within bf16's rounding
    got = int8.kernel("int8_bf16")(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want_int8, atol=3e-2, rtol=2e-2)
    # torch's bf16 int8 kernel misreads rows whose length is not a multiple of 32: refused
    with pytest.raises(ValueError, match="multiple of 32"):
        WeightForms(*weights(k=40)).kernel("int8_bf16")
    # and the int8 weights are within half a step of the float ones
    assert ((dequantized - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 5, 20, 100])
def test_q4_kernels_compute_the_product_of_the_dequantized_weights(rows):
    w, b = weights(n=64, k=96)
    q, pairs = quantize_q4(w)
    dequantized = dequantize_q4(q, pairs)
    assert q.min() >= 0 and q.max() <= 15 and pairs.shape == (3, 64, 2)
    # within half a step of each group's scale
    step = pairs[..., 0].transpose(0, 1).repeat_interleave(32, dim=1)
    assert ((dequantized - w).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(rows, 96)
    want = F.linear(x, dequantized, b)
    forms = WeightForms(w, b)
    names = ["q4_dense"] + (["q4"] if q4_supported(CPU, (64, 96)) else [])
    for name in names:
        torch.testing.assert_close(forms.kernel(name)(x), want, atol=1e-4, rtol=1e-4)
    if q4_supported(CPU, (64, 96)):
        torch.testing.assert_close(forms.kernel("q4_bf16")(x), want, atol=3e-2, rtol=2e-2)


def test_q4_recovers_a_gguf_q4_1_block_exactly():
    """A Q4_1 block is d * q + m with q in 0..15, its minimum at 0 and maximum at 15: quantized
    again it gives the same integers, and dequantized the same values."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (32, 64), generator=g)
    q[:, ::32] = 0
    q[:, 1::32] = 15
    d = torch.rand(32, 2, 1, generator=g) * 0.1 + 0.01
    m = -torch.rand(32, 2, 1, generator=g)
    w = (d * q.reshape(32, 2, 32).float() + m).reshape(32, 64)
    again, pairs = quantize_q4(w)
    assert torch.equal(again, q.to(torch.int32))
    torch.testing.assert_close(dequantize_q4(again, pairs), w, atol=1e-6, rtol=1e-6)


def test_a_kernel_that_refuses_a_shape_falls_back_for_that_shape_only():
    # 48 outputs: not a multiple of 32, which torch's int4 packing needs.
    sites = [WeightForms(*weights(48, 64)), WeightForms(*weights(64, 64))]
    plan = choose_kernels(sites, ("q4",), torch.float32, CPU, None)
    assert plan.choice[(48, 64)] == ("q4_dense",) * 4
    assert plan.choice[(64, 64)] == (("q4",) if q4_supported(CPU, (64, 64)) else
                                     ("q4_dense",)) * 4
    # measured: the refused shape never chooses q4 or q4_bf16, the other may
    names = candidates("q4", CPU, torch.float32)
    measured = choose_kernels(sites, names, torch.float32, CPU, None)
    assert measured.source == "measured"
    assert not set(measured.choice[(48, 64)]) & {"q4", "q4_bf16"}


def test_kernel_linear_dispatches_on_the_row_bucket():
    w, b = weights()
    calls = []
    forms = WeightForms(w, b)
    layer = KernelLinear(forms, ("dense", "packed", "dense", "packed"))
    layer._fns = [lambda x, i=i: calls.append(i) or F.linear(x, w, b) for i in range(4)]
    for rows in (1, 2, 8, 9, 32, 33, 500):
        layer(torch.randn(rows, w.shape[1]))
    assert calls == [0, 1, 1, 2, 2, 3, 3]
    assert [bucket_of(r) for r in (0, 1, 2, 8, 9, 32, 33)] == [0, 0, 1, 1, 2, 2, 3]
    assert "1: dense, 2-8: packed" in layer.extra_repr()


def test_choice_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    sites = [WeightForms(*weights()), WeightForms(*weights(40, 48, seed=1)),
             WeightForms(*weights(seed=2))]  # two layers of one shape
    linears = {(48, 64), (40, 48)}
    names = candidates("none", CPU, torch.float32)
    first = choose_kernels(sites, names, torch.float32, CPU, tmp_path)
    assert first.source == "measured" and set(first.choice) == linears
    assert all(len(k) == 4 and set(k) <= set(names) for k in first.choice.values())
    (stored,) = (tmp_path / "linear-kernels").glob("*.json")
    record = json.loads(stored.read_text())
    assert record["choice"] == first.as_json()
    assert set(record["seconds_per_pass"]) == set(names)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(lk, "measure", no_measuring)
    again = choose_kernels(sites, names, torch.float32, CPU, tmp_path)
    assert again.source == "cached" and again.choice == first.choice
    # Another thread count is another machine setting: measured anew (here: refused).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    with pytest.raises(AssertionError, match="measured again"):
        choose_kernels(sites, names, torch.float32, CPU, tmp_path)


def test_a_corrupt_cache_file_is_measured_again(tmp_path):
    sites = [WeightForms(*weights())]
    names = candidates("none", CPU, torch.float32)
    choose_kernels(sites, names, torch.float32, CPU, tmp_path)
    (stored,) = (tmp_path / "linear-kernels").glob("*.json")
    stored.write_text('{"choice": {"48x64": ["warp_drive"]}}')
    plan = choose_kernels(sites, names, torch.float32, CPU, tmp_path)
    assert plan.source == "measured"


def test_kernels_that_cannot_run_here_are_never_candidates(monkeypatch):
    assert "packed" not in candidates("none", CPU, torch.bfloat16)  # oneDNN packs fp32 only
    assert candidates("int8", torch.device("meta"), torch.float32) == ("int8_dense",)
    assert candidates("q4", CPU, torch.bfloat16) == ("q4", "q4_dense")  # no rounding variant
    monkeypatch.setattr(lk, "prepack_supported", lambda device, dtype: False)
    assert candidates("none", CPU, torch.float32) == ("dense",)
    model = nn.Sequential(nn.Linear(8, 8))
    plan = apply_kernels(model, "none", "auto", CPU, torch.float32, None)
    assert plan.source == "forced" and plan.choice == {(8, 8): ("dense",) * 4}
    with pytest.raises(ValueError, match="linear_kernels 'packed' cannot run here"):
        apply_kernels(nn.Sequential(nn.Linear(8, 8)), "none", "packed", CPU, torch.float32, None)
    with pytest.raises(ValueError, match="does not run quantization 'int8'"):
        apply_kernels(nn.Sequential(nn.Linear(8, 8)), "int8", "dense", CPU, torch.float32, None)


@pytest.mark.parametrize("tied", [False, True])
def test_engine_greedy_tokens_are_hugging_faces_with_every_float_kernel(tmp_path, tied,
                                                                        monkeypatch):
    fresh_cache(monkeypatch, tmp_path)
    model_dir = make_tiny_llama(tmp_path, tie_word_embeddings=tied)
    runs = {}
    for kernels in ("auto", "dense", "packed"):
        llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=32 << 20,
                  linear_kernels=kernels)
        net = llm.engine.worker.loaded.model
        assert isinstance(net.lm_head, KernelLinear)
        assert isinstance(net.layers[0].mlp.down_proj, KernelLinear)
        if kernels != "auto":
            assert net.layers[1].self_attn.qkv_proj.kernels == (kernels,) * 4
        prompts = random_prompts(6, llm.engine.worker.vocab_size, seed=5, high=60)
        runs[kernels] = [o.outputs[0].token_ids
                         for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert runs["auto"] == runs["dense"] == runs["packed"] == hf_greedy(
        model_dir, prompts, GREEDY.max_tokens)
    assert list((tmp_path / "cache" / "linear-kernels").glob("*.json"))  # auto's choice


def _rounded_int8(tensor: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8(tensor.float())
    return q.float() * scale[:, None]


def _rounded_q4(tensor: torch.Tensor) -> torch.Tensor:
    return dequantize_q4(*quantize_q4(tensor.float()))


def _rounded_q8(tensor: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_q8(tensor.float())
    return (q.float() * scale[..., None]).flatten(1)


@pytest.mark.parametrize(("quantization", "rounded", "exact"), [
    ("int8", _rounded_int8, ("int8", "int8_dense")), ("q4", _rounded_q4, ("q4", "q4_dense")),
    ("q8", _rounded_q8, ("q8_dense",))])
def test_quantized_weights_give_the_tokens_of_the_dequantized_model(tmp_path, monkeypatch,
                                                                   quantization, rounded, exact):
    """`quantization int8 | q4 | q8`: the engine's float32-activation kernels compute what float32
    kernels compute on the dequantized weights, so greedy tokens equal Hugging Face's on a
    copy of the model whose layers' weights were rounded the same way. The LM head is on
    Q8_0's grid in both (as the embedded GGUF's is), so its 8-bit form holds it exactly
    whichever form is chosen. `auto` runs."""
    fresh_cache(monkeypatch, tmp_path)
    model_dir = make_tiny_llama(tmp_path / "model")
    from safetensors.torch import load_file, save_file

    rounded_dir = tmp_path / "rounded"
    rounded_dir.mkdir()
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            (rounded_dir / path.name).write_bytes(path.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    q, scale = quantize_q8(tensors["lm_head.weight"])
    tensors["lm_head.weight"] = (q.float() * scale[..., None]).flatten(1)
    save_file(tensors, model_dir / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):  # the decoder layers'
            tensors[name] = rounded(tensor).to(tensor.dtype)
    save_file(tensors, rounded_dir / "model.safetensors")
    want = None
    for kernels in (*exact, "auto"):
        llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=32 << 20,
                  quantization=quantization, linear_kernels=kernels)
        layer = llm.engine.worker.loaded.model.layers[0].mlp.gate_up_proj
        assert set(layer.kernels) <= {quantization, f"{quantization}_bf16",
                                      f"{quantization}_dense", f"{quantization}_native"}
        assert set(llm.engine.worker.loaded.model.lm_head.kernels) <= {"dense", "packed",
                                                                       "q8_native"}
        if want is None:
            prompts = random_prompts(6, llm.engine.worker.vocab_size, seed=8, high=60)
            want = hf_greedy(rounded_dir, prompts, GREEDY.max_tokens)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        if kernels == "auto":  # may round activations (bfloat16, 16-bit groups): not exact
            assert [len(g) for g in got] == [len(w) for w in want]
        else:
            assert got == want, kernels
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(model_dir), quantization="int3")


def test_nibble_packing_round_trips():
    q = torch.randint(0, 16, (5, 64), dtype=torch.int32)
    packed = lk.pack_nibbles(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(lk.unpack_nibbles(packed), q.to(torch.uint8))


def test_a_refused_choice_runs_its_fallback_chain():
    # q4 cannot group 40 inputs in 32s: q4 -> q4_dense -> dense (the float weights)
    w, b = weights(48, 40)
    layer = KernelLinear(WeightForms(w, b), ("q4", "q4_bf16", "q4_dense", "q4"))
    assert layer.kernels == ("dense",) * 4
    x = torch.randn(3, 40)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))
    # a bfloat16 model's int8 kernel reads 16-bit activations: refused unless K % 32 == 0
    wb = w.to(torch.bfloat16)
    bf16_layer = KernelLinear(WeightForms(wb, None), ("int8",) * 4)
    assert bf16_layer.kernels == ("int8_dense",) * 4


def test_a_bucket_where_only_refusing_kernels_were_timed_chooses_a_fallback(monkeypatch):
    """If pruning leaves a shape no kernel that takes it (q4_dense pruned, q4 refusing 48
    outputs), the choice is the fallback that takes it, never the refusing kernel."""
    measure = lk.measure

    def q4_dense_pruned_everywhere(sites, names, dtype, probe_rows):
        timings = measure(sites, names, dtype, probe_rows)
        for bucket in timings["q4_dense"]:
            bucket.clear()
        return timings

    monkeypatch.setattr(lk, "measure", q4_dense_pruned_everywhere)
    # 40 outputs: neither torch's int4 packing (32) nor the native layout (16) takes them
    sites = [WeightForms(*weights(40, 64)), WeightForms(*weights(64, 64))]
    plan = choose_kernels(sites, candidates("q4", CPU, torch.float32), torch.float32, CPU, None)
    assert plan.choice[(40, 64)] == ("q4_dense",) * 4


def _tensors_held(fn, seen=None) -> list[torch.Tensor]:
    """Every tensor a kernel callable reaches through its closures (bound methods: the
    module's tensors)."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    if isinstance(fn, torch.Tensor):
        return [fn]
    if isinstance(fn, NativeLinear):
        return [*fn.tensors, *([fn.bias] if fn.bias is not None else [])]
    if isinstance(fn, nn.Module):
        return [*fn.parameters(), *fn.buffers()]
    if hasattr(fn, "__self__"):
        return _tensors_held(fn.__self__, seen)
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        found += _tensors_held(cell.cell_contents, seen)
    return found


@pytest.mark.parametrize(("quantization", "kernels", "keeps_float"), [
    ("int8", "int8_dense", False), ("q4", "q4_dense", False), ("q4", "auto", False),
    ("q8", "q8_dense", False), ("q8", "auto", False), ("none", "dense", True),
])
def test_a_quantized_layer_keeps_no_float_copy_of_its_weight(quantization, kernels,
                                                            keeps_float):
    """Quantized kernels hold only their own forms, never the float weight (a dense kernel
    reads it, so it holds it)."""
    model = nn.Sequential(nn.Linear(64, 64))
    apply_kernels(model, quantization, kernels, CPU, torch.float32, None)
    held = [t for fn in model[0]._fns for t in _tensors_held(fn)]
    assert held
    floats = [t for t in held if t.dtype == torch.float32 and t.shape == (64, 64)]
    assert bool(floats) == keeps_float
    assert model[0](torch.randn(3, 64)).shape == (3, 64)


def test_each_bucket_counts_the_bytes_its_kernel_reads():
    w, b = weights(64, 256)
    dense = KernelLinear(WeightForms(w, b), ("dense",) * 4)
    assert dense.read_bytes == (w.numel() * 4 + b.numel() * 4,) * 4
    int8 = KernelLinear(WeightForms(w, b), ("int8", "int8", "dense", "dense"))
    # int8: one byte a weight plus a float32 scale per output channel (and the bias)
    assert int8.read_bytes[0] == w.numel() + 64 * 4 + b.numel() * 4
    assert int8.read_bytes[2] == dense.read_bytes[0]
    q4 = KernelLinear(WeightForms(w, b), ("q4_dense",) * 4)
    assert q4.read_bytes[0] < int8.read_bytes[0]  # half a byte a weight plus group scales
