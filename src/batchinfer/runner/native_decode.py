"""Decode steps in one native call: the whole model for a step of single-token sequences.

A decode step of one sequence does little arithmetic per op and runs about 400 torch ops
(norms, projections, RoPE, cache writes, attention, SwiGLU, residual adds), each with a few
microseconds of dispatch: at one row that fixed cost is most of the step. `bi_decode`
(`native/cpu_kernels.c`) runs every layer, the final norm and the LM head in one OpenMP region,
reading the weights in the forms the linear kernels chose (`KernelLinear.native`: 4-bit or
8-bit groups, or the dense float32 weight) and the KV cache in place.

It takes a step when every sequence in it brings one token (decodes, sorted first by
`prepare_inputs`) and its row bucket (1; 2-8; 9-32; 33+ sequences) is one where the native
step measured faster than the torch one at start-up (`choose_buckets`: a few dummy decode
steps each way, at the bucket's probe rows; the answer is cached like the kernel choice, so a
restart measures nothing). Every linear needs a native form at that bucket: its chosen
kernel's, or one kept for decode steps that reads the same weights (`q4_native` beside torch's
4-bit kernels, `int8_native` beside its int8 ones, `q8_native` for q8 weights, the float32
weight beside `packed`). Other
steps (prefill chunks, a bucket where torch won) run the torch model. It needs the CPU, float32 weights and
a cache in the block-rows layout (`cpu_sparse`, `gather`) of float32, float16, bfloat16 or FP8
(`--kv-cache-dtype`): a narrower cache is widened to float32 as it is read (in registers,
or for e4m3 a block at a time into L1), and written with the bytes the torch path writes (FP8 with the layer's scales), so a step
reads half or a quarter of float32's cache bytes; `NativeDecoder.build` says why not otherwise. The two paths compute the same function (the same weights; the native
kernels round activations to 16 bits per group of 32; with `--prefill-activations int8`, steps
of 8+ sequences round them to 8 bits, as the torch model's products of 8+ rows do):
tests/test_native.py checks their logits against each other.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import torch

from batchinfer import native
from batchinfer.core.cpu import cpu_model
from batchinfer.core.outputs import ScheduledSequence
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.models.files import write_cache_json
from batchinfer.models.linear_kernels import BUCKET_NAMES, KernelLinear, bucket_of
from batchinfer.models.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from batchinfer.native.linear import NativeLinear, move_forms_to_huge_pages
from batchinfer.runner.backends.paged_rows import PagedRowsBackend
from batchinfer.runner.input_batch import StepInputs, prepare_inputs

# Start-up measurement: dummy decode steps of this many sequences per row bucket (the 33+
# bucket at its low end: a 256-sequence torch step of a 135M model takes seconds, and start-up
# would pay it eight times), of this many context tokens each, a warm-up then this many timed
# steps each way, alternating (the median counts).
PROBE_ROWS = (1, 8, 32, 64)
PROBE_CONTEXT = 128
PROBE_STEPS = 3

logger = logging.getLogger(__name__)


class NativeDecoder:
    """`logits(inputs)` of a decode step by `bi_decode`, for the row buckets it takes."""

    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM, backend: PagedRowsBackend,
                 buckets: tuple[bool, ...]) -> None:
        self.lib = lib
        self.model = model
        self.backend = backend
        self.buckets = buckets  # per row bucket: whether its steps run here
        # Per bucket, the model as `bi_decode` reads it, the layer array it points into and
        # the native forms whose tensors it points at (held here, whatever frees them
        # elsewhere).
        self._structs: list[tuple[native.Model, ctypes.Array[native.Layer],
                                  list[NativeLinear]] | None] = [
            self._model_struct(b) if on else None for b, on in enumerate(buckets)]
        self._work = torch.empty(0)
        self._logits = torch.empty(0)
        self._kv_scales = torch.empty(0)

    @classmethod
    def build(cls, model: object, backend: object) -> tuple[NativeDecoder | None, str]:
        """The decoder, or None and why it cannot run this model and cache."""
        lib = native.library()
        if lib is None:
            return None, "the native kernels are not built here"
        if not isinstance(model, LlamaForCausalLM):
            return None, "not a Llama-family model"
        why = unsupported_layers(model)
        if why is not None:
            return None, why
        if not isinstance(backend, PagedRowsBackend) or backend.kv_dtype not in native.KV_TYPES:
            return None, ("needs a KV cache in the block-rows layout of float32, float16, "
                          "bfloat16 or FP8")
        if backend.device.type != "cpu" or model.embed_tokens.weight.dtype != torch.float32:
            return None, "needs float32 weights on the CPU"
        spec = model.spec
        if spec.num_heads % spec.num_kv_heads or (
                spec.num_heads // spec.num_kv_heads * spec.head_dim) % native.GROUP:
            return None, (f"needs the query heads of a KV head to span a multiple of "
                          f"{native.GROUP} values")
        linears = [m for m in model.modules() if isinstance(m, KernelLinear)]
        if not isinstance(model.lm_head, KernelLinear) or len(linears) != (
                4 * model.spec.num_layers + 1):
            return None, "the linears have no chosen kernels"
        if model.lm_head.out_features != spec.vocab_size:
            return None, "the LM head's outputs are not the vocabulary"
        buckets = tuple(all(linear.native[b] is not None for linear in linears)
                        for b in range(len(BUCKET_NAMES)))
        if not any(buckets):
            return None, "no row bucket has native kernels for every linear"
        return cls(lib, model, backend, buckets), ""

    def bucket_names(self) -> list[str]:
        """The row buckets (`BUCKET_NAMES`) whose decode steps run here."""
        return [name for name, on in zip(BUCKET_NAMES, self.buckets, strict=True) if on]

    def describe(self) -> str:
        taken = self.bucket_names()
        return f"rows {', '.join(taken)}" if taken else "no row bucket"

    def cache_key(self, fits: tuple[bool, ...]) -> str:
        """What the native-vs-torch choice depends on: machine, torch, threads, the model's
        shape, the cache's block size, every linear's kernels and native forms (and whether
        their torch-side products take 8-bit inputs), and which probes (`fits`) the cache can
        hold."""
        linears = [m for m in self.model.modules() if isinstance(m, KernelLinear)]
        facts = {
            "cpu": cpu_model(), "machine": platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "spec": [str(v) for v in astuple(self.model.spec)],
            "block_size": self.backend.block_size, "kv_dtype": str(self.backend.kv_dtype),
            "source": native.source_digest(), "isa": native.isa_level(),
            "kernels": sorted({(m.kernels, tuple(f.struct.kind if f else -1 for f in m.native))
                               for m in linears}),
            # 8-bit inputs (`--prefill-activations int8`) speed up both sides' products
            "int8_inputs": self.int8_inputs(),
            "probe": [PROBE_ROWS, PROBE_CONTEXT, PROBE_STEPS], "fits": list(fits),
        }
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]

    def keep_buckets(self, buckets: tuple[bool, ...]) -> None:
        """Take only these buckets' steps from now on; the native forms made for the others
        are freed."""
        self.buckets = tuple(a and b for a, b in zip(self.buckets, buckets, strict=True))
        self._structs = [entry if on else None
                         for entry, on in zip(self._structs, self.buckets, strict=True)]
        release_native_forms(self.model, self.buckets)

    def move_weights_to_huge_pages(self) -> int:
        """Move the quantized weights the kept buckets' steps read into huge pages (see
        `native.memory`), in the order a step reads them; returns the bytes moved."""
        forms = [form for entry in self._structs if entry is not None for form in entry[2]]
        moved = move_forms_to_huge_pages(forms)
        if moved:  # the layer arrays hold copies of the forms' structs: made again
            self._structs = [self._model_struct(b) if on else None
                             for b, on in enumerate(self.buckets)]
        return moved

    def _model_struct(self, bucket: int) -> tuple[native.Model, ctypes.Array[native.Layer],
                                                  list[NativeLinear]]:
        model, spec = self.model, self.model.spec
        layers = (native.Layer * spec.num_layers)()
        forms: list[NativeLinear] = []

        def _linear(linear: object) -> native.Linear:
            assert isinstance(linear, KernelLinear)
            form = linear.native[bucket]
            assert form is not None  # `build` checked every linear has one
            forms.append(form)
            return form.struct

        for i, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            layers[i] = native.Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                *(_linear(linear) for linear in (
                    attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)))
        struct = native.Model(
            spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads,
            spec.head_dim, spec.intermediate_size, spec.vocab_size, self.backend.block_size,
            spec.rms_norm_eps, native.KV_TYPES[self.backend.kv_dtype],
            model.embed_tokens.weight.data_ptr(), model.norm.weight.data_ptr(),
            model.rope_cos.data_ptr(), model.rope_sin.data_ptr(), layers,
            _linear(model.lm_head), 0, 0, 0, int(self.int8_inputs()))
        return struct, layers, forms

    def int8_inputs(self) -> bool:
        """Whether the layers' products take 8-bit inputs (`--prefill-activations int8`, set
        on their kernels by `set_int8_inputs`): then so do those of decode steps of 8
        sequences and more (where the library has the 8-bit path)."""
        return any(getattr(fn, "int8_inputs", False)
                   for m in self.model.modules() if isinstance(m, KernelLinear)
                   for fn in m._fns)

    def accepts(self, inputs: StepInputs) -> bool:
        metadata = inputs.attention
        return (metadata.num_decodes == metadata.num_seqs
                and self.buckets[bucket_of(metadata.num_seqs)])

    def logits(self, inputs: StepInputs, shared_rows: bool = False) -> torch.Tensor:
        """Float32 logits `[rows, vocab]` of a step `accepts` took, one row per sequence, its
        K/V written into the cache. The tensor is reused by the next step. `shared_rows`: rows
        may be positions of one sequence (speculative decoding's verification), so every
        row's K/V is written before any row attends."""
        metadata = inputs.attention
        rows = metadata.num_seqs
        entry = self._structs[bucket_of(rows)]
        assert entry is not None, "a step accepts() refused"
        struct = entry[0]
        cache = self.backend.kv_cache  # read each step: the backend may reallocate it
        struct.kv_cache, struct.num_blocks = cache.data_ptr(), cache.shape[1]
        struct.block_size = self.backend.block_size
        struct.kv_first = int(shared_rows)
        if self.backend.quantized:  # FP8: the layers' scales, as the torch path has them now
            self._kv_scales = torch.tensor(self.backend.kv_scales, dtype=torch.float32)
            struct.kv_scales = self._kv_scales.data_ptr()
        threads = torch.get_num_threads()
        need = self.lib.bi_work_floats(ctypes.byref(struct), rows, threads)
        if self._work.numel() < need:
            self._work = torch.empty(need)
        vocab = self.model.spec.vocab_size
        if self._logits.numel() < rows * vocab:
            self._logits = torch.empty(rows * vocab)
        logits = self._logits[: rows * vocab].view(rows, vocab)
        pointers = (t.data_ptr() for t in (
            inputs.input_ids, inputs.positions, metadata.slot_mapping,
            metadata.context_lens_tensor, metadata.block_ids, metadata.block_starts_tensor,
            self._work, logits))
        self.lib.bi_decode(ctypes.byref(struct), rows, *pointers, threads)
        return logits


def unsupported_layers(model: LlamaForCausalLM) -> str | None:
    """Why `bi_decode` does not compute `model`'s function, or None where it does: it computes
    Llama's layer exactly (SwiGLU, full attention at `1 / sqrt(head_dim)`, no q/k norms, no
    norms after the sublayers, unscaled embeddings and logits)."""
    spec, cls = model.spec, type(model)
    plain = (cls.embed is LlamaForCausalLM.embed
             and cls.compute_logits is LlamaForCausalLM.compute_logits
             and type(model.norm) is RMSNorm
             and all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                     and type(layer.input_layernorm) is RMSNorm for layer in model.layers))
    if not plain:
        return f"{spec.architecture}'s layers are not the Llama layer the native step computes"
    if spec.hidden_act != "silu":
        return f"the native step computes SwiGLU, not {spec.hidden_act}"
    if spec.sliding_window is not None:
        return "sliding-window attention is not in the native step"
    if spec.query_pre_attn_scalar is not None or spec.attn_logit_softcapping is not None:
        return "a softmax scale other than 1 / sqrt(head_dim), or soft-capping"
    return None


def release_native_forms(model: object, buckets: tuple[bool, ...]) -> None:
    """Free the native forms of every linear of `model` but those of `buckets`."""
    if isinstance(model, torch.nn.Module):
        for module in model.modules():
            if isinstance(module, KernelLinear):
                module.keep_native(buckets)


def choose_buckets(decoder: NativeDecoder, torch_logits: Callable[[StepInputs], torch.Tensor],
                   num_blocks: int, cache_dir: Path | None) -> tuple[bool, ...]:
    """Per row bucket, whether native decode steps beat the torch model's there: measured
    on dummy decode steps of `PROBE_ROWS` sequences (`torch_logits` runs one the torch way),
    or read from the cache folder where this machine measured the same setup. A bucket the
    cache cannot hold the probe of keeps the torch model. The dummy steps write K/V into
    blocks no sequence owns yet; every slot is written again before a real step reads it."""
    block_size = decoder.backend.block_size
    # The probe's new token sits at position `context`: inside the model's RoPE tables.
    context = min(PROBE_CONTEXT, decoder.model.rope_cos.shape[0] - 1)
    per_seq = -(-(context + 1) // block_size)
    fits = tuple(rows * per_seq <= num_blocks for rows in PROBE_ROWS)
    path = None
    if cache_dir is not None:
        path = cache_dir / "native-decode" / f"{decoder.cache_key(fits)}.json"
        try:
            stored = json.loads(path.read_text())["native"]
            if isinstance(stored, list) and len(stored) == len(BUCKET_NAMES):
                return tuple(bool(on) and able for on, able in
                             zip(stored, decoder.buckets, strict=True))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not measured yet here, or unreadable: measure
    chosen, seconds = [], {}
    for bucket, rows in enumerate(PROBE_ROWS):
        if not decoder.buckets[bucket] or not fits[bucket]:
            chosen.append(False)
            continue
        params = SamplingParams(max_tokens=1, temperature=0)
        sequences = [ScheduledSequence(f"probe-{i}", [1], context,
                                       list(range(i * per_seq, (i + 1) * per_seq)), True,
                                       params, context) for i in range(rows)]
        inputs = prepare_inputs(sequences, block_size, decoder.backend.device)
        ways = {"native": decoder.logits, "torch": torch_logits}
        times: dict[str, list[float]] = {name: [] for name in ways}
        with torch.inference_mode():
            for step in range(PROBE_STEPS + 1):
                for name, run in ways.items():
                    start = time.perf_counter()
                    run(inputs)
                    if step:  # the first of each is a warm-up
                        times[name].append(time.perf_counter() - start)
        native_s, torch_s = (statistics.median(times[name]) for name in ("native", "torch"))
        seconds[BUCKET_NAMES[bucket]] = {"native": native_s, "torch": torch_s}
        chosen.append(native_s < torch_s)
    if path is not None:
        write_cache_json(path, {"cpu": cpu_model(), "native": chosen, "seconds_per_step": seconds},
                         "the native decode choice")
    return tuple(chosen)
