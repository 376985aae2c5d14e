"""Engine configuration: every limit is a named, validated field with the same name on the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from batchinfer.core.preemption import PREEMPTION_MODES
from batchinfer.core.scheduling.policies import POLICIES
from batchinfer.core.validation import (
    check_bool,
    check_choice,
    check_fraction,
    check_int,
    check_non_negative,
)

BATCHING_FORMS = ("continuous", "dynamic", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("auto", "sdpa", "gather", "cpu_sparse", "triton")
SCHEDULING_POLICIES = tuple(POLICIES)  # fcfs, priority: one class each in core.scheduling
QUANTIZATIONS = ("auto", "none", "int8", "q8", "q4")
ENCODER_QUANTIZATIONS = ("none", "int8", "q8")  # an encoder's weights
PREFILL_ACTIVATIONS = ("int16", "int8")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
SELF_Q4 = "self-q4"  # speculative_model: this checkpoint's 4-bit form drafts
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")  # engine/tools.py's syntaxes
LINEAR_KERNELS = ("auto", "dense", "packed", "int8", "int8_dense", "int8_native", "q4",
                  "q4_dense", "q4_native", "q8_native", "q8_dense")
GiB = 1 << 30
BYTE_SIZES = ("kv_cache_memory", "swap_space")  # fields that accept "2G", "512M"

# `--preset NAME` sets these knobs at once; a knob given explicitly wins over its preset.
# interactive: latency first: priorities, a soft watermark at 70 % and KV admission capped at
#   80 % (the users' article), small steps so a prompt's first token is not stuck behind long
#   prefill chunks, and slow aging (10 s a level: a batch request ranks with interactive ones
#   after 100 s) so a long burst of batch work cannot age into the room kept for interactive
#   requests (docs/scheduling.md has the measurements behind these values).
# offline: throughput first: fcfs, a high watermark, and steps and batches as large as the KV
#   cache allows (`max_num_seqs` / `max_num_batched_tokens` are clamped to the cache at start-up).
PRESETS: dict[str, dict[str, Any]] = {
    "interactive": {
        "scheduling_policy": "priority",
        "kv_soft_watermark": 0.7,
        "kv_admission_watermark": 0.8,
        "max_num_batched_tokens": 256,
        "priority_aging_ms": 10_000.0,
    },
    "offline": {
        "scheduling_policy": "fcfs",
        "kv_admission_watermark": 0.95,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
    },
}


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class EngineConfig:
    """All knobs of the generative engine. Invalid values raise `ValueError` naming the field.

    The CLI exposes each field as `--field-name` with the same default, so a figure measured with
    `batchinfer bench` maps one-to-one onto a Python `LLM(model, field_name=...)` call.
    """

    model: str = field(default="default", metadata=_help(
        "'default' (embedded SmolLM2-135M-Instruct), a Hugging Face folder, a .gguf file or "
        "a Hugging Face Hub id org/name (fetched into the hub cache; HF_HUB_OFFLINE=1: the "
        "cache only); an existing path wins over a hub id"))
    revision: str | None = field(default=None, metadata=_help(
        "hub ids: the branch, tag or commit to load; default: main"))
    gguf_file: str | None = field(default=None, metadata=_help(
        "load this .gguf file from the hub repo (or the local folder) --model names; only "
        "that file is fetched"))
    dtype: str = field(default="auto", metadata=_help(
        "weights and activations: auto (bf16 where fast, else fp32; fp32 on a CPU whose "
        "quantized weights run on the native kernels), float32, bfloat16, float16"))
    device: str = field(default="auto", metadata=_help("auto (cuda if present), cpu or cuda"))
    max_model_len: int | None = field(default=None, metadata=_help(
        "longest prompt + output in tokens; default: the model's, capped by the KV cache"))
    block_size: int = field(default=16, metadata=_help("tokens per KV cache block"))
    kv_cache_memory: int = field(default=2 * GiB, metadata=_help(
        "bytes of KV cache on CPU (accepts 512M, 2G)"))
    gpu_memory_utilization: float = field(default=0.85, metadata=_help(
        "fraction of GPU memory for weights + KV cache (CUDA only)"))
    kv_cache_dtype: str = field(default="auto", metadata=_help(
        "KV cache element type: auto (= dtype), float32, bfloat16, float16, fp8_e4m3, "
        "fp8_e5m2 (1 byte, a per-layer scale)"))
    calculate_kv_scales: bool = field(default=False, metadata=_help(
        "FP8 KV cache: set each layer's K and V scales from the first step's values "
        "(default: 1.0)"))
    max_num_seqs: int = field(default=64, metadata=_help("most sequences in one step"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help(
        "token budget of one step: prefill chunks + decode tokens"))
    batching: str = field(default="continuous", metadata=_help(
        "continuous (iteration-level), dynamic (size + delay window) or static (fixed batches)"))
    max_batch_size: int = field(default=16, metadata=_help(
        "requests per batch for the dynamic and static forms"))
    max_batch_delay_ms: float = field(default=10.0, metadata=_help(
        "dynamic form: dispatch once the oldest waiting request has waited this long"))
    kv_admission_watermark: float = field(default=0.95, metadata=_help(
        "stop admitting new requests while KV cache usage would exceed this fraction"))
    seed: int = field(default=0, metadata=_help("seed of unseeded random sampling"))
    num_threads: int | None = field(default=None, metadata=_help(
        "CPU threads for torch; default: all cores"))
    prepack_weights: bool = field(default=True, metadata=_help(
        "CPU float32: let linear layers use oneDNN's packed layout where it measures faster"))
    quantization: str = field(default="auto", metadata=_help(
        "weight-only quantization of the linear layers: auto (a quantized checkpoint, such as "
        "a Q4 GGUF, keeps its own form, q4 or q8, where a decode pass over its linears "
        "measured faster than float32's at start-up on this machine, else float32; a float "
        "checkpoint stays float), none, int8 (per output channel; a "
        "quarter of float32's bytes), q8 (8-bit in groups of 32 with a scale, as GGUF's Q8_0; "
        "CPU native kernels), q4 (4-bit in groups of 32 with a scale and a zero, as GGUF's "
        "Q4_1; an eighth)"))
    linear_kernels: str = field(default="auto", metadata=_help(
        "auto (per weight shape and row count, the fastest kernel measured at start-up on "
        "this machine, cached), or one kernel for all: dense, packed (CPU float32), int8, "
        "int8_dense, int8_native (quantization int8), q4, q4_dense, q4_native (quantization "
        "q4), q8_native, q8_dense (quantization q8)"))
    prefill_activations: str = field(default="int16", metadata=_help(
        "CPU native kernels of quantized weights (q4, q8, int8) in the decoder layers: the "
        "inputs of products of 8 rows and more (prefill chunks; decode steps of 8+ sequences, "
        "native or not) rounded per group of 32 to int16 (~1e-5 of the group's largest value), "
        "or int8 (AVX-512 VNNI, AVX2, Arm with dot products; products ~1.5x faster than with "
        "int16, but q8 ones on AVX2 alike; like llama.cpp's and OpenVINO's 8-bit activations, "
        "logits move by ~1e-2 of their range, so fewer greedy tokens match float32's)"))
    native_decode: bool = field(default=True, metadata=_help(
        "CPU float32: run decode steps (every sequence one token) as one native call per step, "
        "at the row counts where that measured faster than the torch model at start-up "
        "(cached; off: always the torch model)"))
    special_tokens_in_chat: bool = field(default=False, metadata=_help(
        "parse special-token text inside chat message content as special tokens (lets a user "
        "forge another role's turn; off: content is plain text)"))
    attention_backend: str = field(default="auto", metadata=_help(
        "paged attention: auto (cpu_sparse on CPU with a float32 cache, else gather), sdpa "
        "(the portable reference), gather, cpu_sparse"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "share the KV blocks of a prompt prefix already computed (full blocks, by chained hash;"
        " freed blocks stay cached until reused, least recently freed first)"))
    preset: str | None = field(default=None, metadata=_help(
        "interactive or offline: sets a group of scheduling knobs at once (docs/scheduling.md);"
        " explicit flags win"))
    scheduling_policy: str = field(default="fcfs", metadata=_help(
        "fcfs (arrival order) or priority (lower `priority` first, with aging; victims of "
        "preemption by priority, then size)"))
    priority_aging_ms: float = field(default=1000.0, metadata=_help(
        "priority policy: a waiting request gains one priority level per this much waiting "
        "(0: no aging)"))
    max_queue_time_ms: float | None = field(default=None, metadata=_help(
        "a request waiting longer than this in all (first wait + waits after preemption) "
        "leaves the queue with a queue_timeout error (HTTP 503); default: no limit"))
    kv_soft_watermark: float | None = field(default=None, metadata=_help(
        "above this KV cache usage only interactive or short requests are admitted; "
        "default: off"))
    short_request_tokens: int = field(default=512, metadata=_help(
        "a request whose prompt + max_tokens fit this many tokens counts as short (soft "
        "watermark)"))
    elastic_max_tokens: bool = field(default=False, metadata=_help(
        "under pressure (KV usage above the soft watermark and requests waiting), lower the "
        "output cap of batch-class requests that did not set max_tokens"))
    elastic_min_tokens: int = field(default=64, metadata=_help(
        "the lowered output cap of elastic_max_tokens (never below what a request has already "
        "produced + 1)"))
    max_blocks_per_request: int | None = field(default=None, metadata=_help(
        "most KV blocks one sequence may hold; a request needing more is refused at admission;"
        " default: no cap beyond max_model_len"))
    preemption_mode: str = field(default="recompute", metadata=_help(
        "what a preempted request's KV becomes: recompute (dropped, prefilled again), swap "
        "(copied to host memory and back), auto (the cheaper per request, by costs measured "
        "at start-up)"))
    swap_space: int = field(default=4 * GiB, metadata=_help(
        "bytes of host memory for swapped-out KV blocks (accepts 4G, 512M); used by "
        "preemption_mode swap and auto, a pool of its own on CPU too"))
    max_swap_blocks_per_step: int = field(default=128, metadata=_help(
        "most KV blocks copied out (and, separately, in) in one step: a longer request swaps "
        "its leading blocks and recomputes the rest"))
    max_cached_grammars: int = field(default=256, metadata=_help(
        "structured outputs: most compiled grammars kept, one per distinct JSON schema, regex, "
        "choice list or grammar (least recently used dropped first)"))
    speculative_method: str = field(default="none", metadata=_help(
        "speculative decoding: none, ngram (prompt lookup: what followed the latest earlier "
        "match of the last tokens, in the prompt and output) or draft (a draft model, "
        "speculative_model); proposed tokens are verified in the batch, so outputs are those "
        "of the model alone (docs/speculative.md)"))
    speculative_model: str | None = field(default=None, metadata=_help(
        "speculative_method draft: self-q4 (this checkpoint with 4-bit weights proposes, the "
        "served weights verify) or the path of a smaller model with the same vocabulary"))
    num_speculative_tokens: int = field(default=4, metadata=_help(
        "speculative decoding: the most tokens a sequence proposes in one step (the ceiling "
        "of speculative_depth auto)"))
    speculative_depth: str | int = field(default="auto", metadata=_help(
        "tokens each sequence proposes per step: auto (chosen every step, 0 to "
        "num_speculative_tokens per sequence, from the step costs measured at start-up and "
        "each request's acceptance rate: 0 where the batch is compute-bound) or a fixed N"))
    prompt_lookup_min: int = field(default=2, metadata=_help(
        "speculative_method ngram: the shortest suffix of the tokens so far that is looked up"))
    prompt_lookup_max: int = field(default=5, metadata=_help(
        "speculative_method ngram: the longest suffix looked up (the longest that matches "
        "proposes)"))
    tool_call_parser: str = field(default="auto", metadata=_help(
        "the tool-call syntax read from (and, for tool_choice required or a named function, "
        "enforced on) a chat's output: hermes (<tool_call> JSON blocks: Qwen 2.5 / 3, Hermes, "
        "and the fallback prompt of templates that take no tools), llama3_json (Llama 3.1+ "
        "JSON objects), auto (from the chat template's text)"))

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("device", self.device, DEVICES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("batching", self.batching, BATCHING_FORMS)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        check_choice("linear_kernels", self.linear_kernels, LINEAR_KERNELS)
        check_choice("prefill_activations", self.prefill_activations, PREFILL_ACTIVATIONS)
        check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.preset is not None:
            check_choice("preset", self.preset, tuple(PRESETS))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string")
        for name in ("revision", "gguf_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.gguf_file is not None and not self.gguf_file.lower().endswith(".gguf"):
            raise ValueError(f"gguf_file must name a .gguf file, got {self.gguf_file!r}")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len)
        check_int("block_size", self.block_size)
        check_int("kv_cache_memory", self.kv_cache_memory)
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("max_batch_size", self.max_batch_size)
        check_int("seed", self.seed, low=0)
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads)
        for name in ("special_tokens_in_chat", "calculate_kv_scales", "enable_prefix_caching",
                     "prepack_weights", "elastic_max_tokens", "native_decode"):
            check_bool(name, getattr(self, name))
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError("calculate_kv_scales needs kv_cache_dtype fp8_e4m3 or fp8_e5m2, "
                             f"got {self.kv_cache_dtype!r}")
        check_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        check_fraction("kv_admission_watermark", self.kv_admission_watermark)
        check_non_negative("max_batch_delay_ms", self.max_batch_delay_ms)
        check_non_negative("priority_aging_ms", self.priority_aging_ms)
        if self.max_queue_time_ms is not None:
            check_non_negative("max_queue_time_ms", self.max_queue_time_ms)
        if self.kv_soft_watermark is not None:
            check_fraction("kv_soft_watermark", self.kv_soft_watermark)
        check_int("short_request_tokens", self.short_request_tokens)
        check_int("elastic_min_tokens", self.elastic_min_tokens)
        if self.elastic_max_tokens and self.kv_soft_watermark is None:
            raise ValueError("elastic_max_tokens needs kv_soft_watermark (the pressure level "
                             "it acts above)")
        if self.max_blocks_per_request is not None:
            check_int("max_blocks_per_request", self.max_blocks_per_request)
        check_int("swap_space", self.swap_space, low=0)
        check_int("max_swap_blocks_per_step", self.max_swap_blocks_per_step)
        check_int("max_cached_grammars", self.max_cached_grammars)
        self._check_speculation()

    def _check_speculation(self) -> None:
        check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise ValueError("speculative_method draft needs speculative_model: self-q4 or the "
                             "path of a draft model")
        if self.speculative_model is not None and self.speculative_method != "draft":
            raise ValueError("speculative_model needs speculative_method draft, got "
                             f"{self.speculative_method!r}")
        if self.speculative_model is not None and (
                not isinstance(self.speculative_model, str) or not self.speculative_model):
            raise ValueError(f"speculative_model must be self-q4 or a path, got "
                             f"{self.speculative_model!r}")
        check_int("num_speculative_tokens", self.num_speculative_tokens)
        depth = self.speculative_depth
        if isinstance(depth, str) and depth.strip().isdigit():
            depth = int(depth)
            object.__setattr__(self, "speculative_depth", depth)  # "3" from the CLI
        if depth != "auto" and (isinstance(depth, bool) or not isinstance(depth, int)
                                or depth < 1):
            raise ValueError(f"speculative_depth must be auto or an integer >= 1, got {depth!r}")
        check_int("prompt_lookup_min", self.prompt_lookup_min)
        check_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @property
    def max_speculative_tokens(self) -> int:
        """The most tokens a sequence proposes in a step: the fixed depth, else auto's
        ceiling; 0 when speculative decoding is off."""
        if self.speculative_method == "none":
            return 0
        depth = self.speculative_depth
        return depth if isinstance(depth, int) else self.num_speculative_tokens

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown names with a `ValueError`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        for name in BYTE_SIZES:
            if isinstance(kwargs.get(name), str):
                kwargs[name] = parse_bytes(name, kwargs[name])
        preset = kwargs.get("preset")
        if preset is not None:
            check_choice("preset", preset, tuple(PRESETS))
            kwargs = {**PRESETS[preset], **kwargs}
        return cls(**kwargs)

    def fitted_to_cache(self, num_blocks: int) -> EngineConfig:
        """The offline preset's "as large as the cache allows": `max_num_seqs` at most one per
        KV block and the step's token budget at most the whole cache. Other configs as is."""
        if self.preset != "offline":
            return self
        return replace(
            self,
            max_num_seqs=max(1, min(self.max_num_seqs, num_blocks)),
            max_num_batched_tokens=max(1, min(self.max_num_batched_tokens,
                                              num_blocks * self.block_size)),
        )


def parse_bytes(name: str, text: str) -> int:
    """Parse '2G', '512M', '1.5GiB' or a plain integer into bytes; `ValueError` names `name`."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1:] if s[-1:] in units else ""
    try:
        value = float(s[: len(s) - len(unit)]) * units[unit]
    except ValueError:
        raise ValueError(f"{name} must be a size like 2G or 512M, got {text!r}") from None
    return int(value)
