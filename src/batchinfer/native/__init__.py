"""The CPU kernels of `cpu_kernels.c` (each instruction-set level's own in `kernels/`),
compiled for this machine at first use and loaded with ctypes.

Why compiled here rather than shipped: the fastest code differs by CPU, so the library is built
by the system C compiler (`$CC`, else `cc`) into the cache folder, once per instruction-set
level (`ISA_LEVELS`): `avx512` (`-march=native` on a CPU with AVX-512 F and BW), `avx2`
(`-march=x86-64-v3`: AVX2, FMA, F16C), `neon` (64-bit Arm, `-march=native`: the hand-written
NEON kernels) and `portable` (`-march=x86-64-v2` on x86, `-march=native` elsewhere: the C loops
the compiler vectorizes; the only level off x86 and 64-bit Arm). `library()` loads the
best level the CPU reports, or the one `BATCHINFER_CPU_ISA` names (`auto` | `avx512` | `avx2` |
`neon` | `portable`; another name is a `ValueError`, a level the CPU lacks is logged and the
best one below it loads instead); `isa_level()` says which. Only that level is compiled at start-up
(about a second); the others are built when asked for (`library(level=...)`). Each build is
keyed by the source, the compiler, the flags, the CPU model and its instruction-set flags: a
restart, or another process, loads it without compiling. No compiler, or a failed build:
`library()` returns None, says why once in the log, and every caller keeps torch's kernels.
`BATCHINFER_NATIVE=0` turns it off.

The library uses OpenMP; it links `libgomp.so.1`, the runtime torch's CPU build already
loaded, so both share one thread pool instead of two competing for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from batchinfer.core.cpu import cpu_flags, cpu_model
from batchinfer.core.paths import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -fno-strict-aliasing: 16-bit inputs are read as 32-bit pairs; -fno-math-errno: lrintf and
# sqrtf become single instructions.
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-fno-strict-aliasing",
                "-fno-math-errno")
LIBS = ("-lm",)

# The instruction-set levels a build targets, best first, and the CPU flags each needs (x86).
ISA_LEVELS = ("avx512", "avx2", "neon", "portable")
LEVEL_CPU_FLAGS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx2", "fma", "f16c"}),
    # x86-64-v3: the compiler may use any of these (lzcnt is `abm`'s)
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}),
    "portable": frozenset(),
}
X86_MACHINES = ("x86_64", "amd64", "AMD64")
# 64-bit Arm, where Advanced SIMD (NEON) is part of the architecture
ARM64_MACHINES = ("aarch64", "arm64", "ARM64")
# x86-64-v2: every x86-64 CPU of the last fifteen years
PORTABLE_X86_FLAGS = frozenset({"sse4_2", "ssse3", "popcnt", "cx16"})

# Weight layouts of `bi_linear.kind` (see cpu_kernels.c).
F32, Q4, Q8 = 0, 1, 2
TILE = 16  # outputs interleaved per tile in the q4 / q8 layouts
TILE_F32 = 4  # the float32 kernel's outputs per tile (it reads the weight as it is)
GROUP = 32  # weights per scale


class Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("weight", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear)]


class Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int32), ("hidden", ctypes.c_int32),
                ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("intermediate", ctypes.c_int32),
                ("vocab", ctypes.c_int32), ("block_size", ctypes.c_int32),
                ("eps", ctypes.c_float), ("kv_type", ctypes.c_int32),
                ("embed", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p),
                ("layers", ctypes.POINTER(Layer)), ("lm_head", Linear),
                ("kv_cache", ctypes.c_void_p), ("num_blocks", ctypes.c_int64),
                ("kv_scales", ctypes.c_void_p), ("act8", ctypes.c_int32),
                ("kv_first", ctypes.c_int32)]


# The KV cache element types `bi_decode` reads and writes (`bi_model.kv_type`).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3,
            torch.float8_e5m2: 4}


_lock = threading.Lock()
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}
# `library()`'s answer for the default folder and level, by the environment that names them:
# the prefill attention asks once a layer, so the common call is a dictionary lookup.
_by_env: dict[tuple[str | None, ...], ctypes.CDLL | None] = {}


def compiler() -> str | None:
    """The C compiler to build with (`$CC`, else `cc`), or None when there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


@functools.cache
def source_digest(source: Path = SOURCE) -> str:
    """A digest of the kernels' source (`source` and the headers of its `kernels` folder:
    each instruction-set level's kernels and the contract they share): cached choices
    measured with other code are stale."""
    digest = hashlib.sha256()
    for path in (source, *sorted(source.with_name("kernels").glob("*.h"))):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def supported_levels(flags: frozenset[str] | None = None,
                     machine: str | None = None) -> tuple[str, ...]:
    """The levels of `ISA_LEVELS` a CPU with these instruction-set `flags` (default: this
    one's) runs, best first: on x86 by its flags, `neon` on 64-bit Arm, `portable` always."""
    machine = machine or platform.machine()
    if machine in ARM64_MACHINES:
        return ("neon", "portable")
    if machine not in X86_MACHINES:
        return ("portable",)
    have = cpu_flags() if flags is None else flags
    return tuple(level for level in ISA_LEVELS
                 if level in LEVEL_CPU_FLAGS and LEVEL_CPU_FLAGS[level] <= have)


def choose_level(requested: str | None, supported: Sequence[str]) -> str:
    """The level to load: the best `supported` one for None, `""` or `auto`, else the one
    `requested` names; one the CPU lacks is logged and the best supported one below it is
    taken. An unknown name is a `ValueError`."""
    name = (requested or "auto").strip().lower()
    if name == "auto":
        return supported[0]
    if name not in ISA_LEVELS:
        raise ValueError(f"BATCHINFER_CPU_ISA must be auto, {', '.join(ISA_LEVELS)}; "
                         f"got {requested!r}")
    if name in supported:
        return name
    below = [level for level in ISA_LEVELS[ISA_LEVELS.index(name):] if level in supported]
    logger.warning("BATCHINFER_CPU_ISA=%s: this CPU lacks it (it runs %s); using %s", name,
                   ", ".join(supported), below[0])
    return below[0]


def level_flags(level: str, machine: str | None = None,
                flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The compiler flags of a build at `level` (one of `ISA_LEVELS`)."""
    if level not in ISA_LEVELS:
        raise ValueError(f"unknown ISA level {level!r}: one of {', '.join(ISA_LEVELS)}")
    if (machine or platform.machine()) not in X86_MACHINES:
        # off x86 the compiler targets this CPU; the portable level leaves out the NEON file
        forced = ("-DBI_FORCE_PORTABLE",) if level == "portable" else ()
        return ("-march=native", *forced, *COMMON_FLAGS)
    if level == "avx512":
        return ("-march=native", *COMMON_FLAGS)
    if level == "avx2":
        return ("-march=x86-64-v3", "-mtune=native", *COMMON_FLAGS)
    have = cpu_flags() if flags is None else flags
    arch = ("-march=x86-64-v2",) if have >= PORTABLE_X86_FLAGS else ()
    return (*arch, "-mtune=native", *COMMON_FLAGS)


def library(cache_dir: Path | None = None, level: str | None = None) -> ctypes.CDLL | None:
    """The built library (building it on first use) at `level` (default: `BATCHINFER_CPU_ISA`,
    else the best this CPU runs), or None where it cannot be had. A level the CPU lacks is
    refused with a `ValueError` when asked for by argument (tests), logged and stepped down
    from when named by the environment."""
    if os.environ.get("BATCHINFER_NATIVE", "1") == "0":
        return None
    env = (os.environ.get("BATCHINFER_CACHE"), os.environ.get("HOME"),
           os.environ.get("BATCHINFER_CPU_ISA"), level)
    if cache_dir is None and env in _by_env:
        return _by_env[env]
    supported = supported_levels()
    if level is None:
        level = choose_level(os.environ.get("BATCHINFER_CPU_ISA"), supported)
    elif level not in supported:
        raise ValueError(f"ISA level {level!r}: this CPU runs {', '.join(supported)}")
    folder = (cache_dir or default_cache_dir()) / "native"
    key = (str(folder), level)
    with _lock:
        if key not in _loaded:
            _loaded[key] = build_and_load(folder, level_flags(level))
        if cache_dir is None:
            _by_env[env] = _loaded[key]
        return _loaded[key]


def isa_level(lib: ctypes.CDLL | None = None) -> str | None:
    """The instruction-set level `lib` (default: `library()`'s) was built for, or None where
    the native kernels are not used."""
    lib = library() if lib is None else lib
    return None if lib is None else lib.bi_isa().decode()


def build_and_load(folder: Path, flags: tuple[str, ...], source: Path = SOURCE
                   ) -> ctypes.CDLL | None:
    """Build (unless built) and load the library of `source` (another checkout's, to compare)
    with `flags` into `folder`; None, with the reason logged, where that fails. `library()`
    builds with `level_flags(level)`."""
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler (cc, or $CC): the native CPU kernels are not used")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        digest = hashlib.sha256("\0".join(
            [source_digest(source), version, platform.machine(), cpu_model(),
             " ".join(sorted(cpu_flags())), *flags]).encode()).hexdigest()[:20]
        target = folder / f"cpu_kernels-{digest}.so"
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".{os.getpid()}.tmp")  # one per builder: no torn files
            result = subprocess.run([cc, *flags, "-o", str(tmp), str(source), *LIBS],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                tmp.unlink(missing_ok=True)
                logger.warning("building the native CPU kernels failed (%s): %s", cc,
                               result.stderr.strip()[-2000:])
                return None
            tmp.replace(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("the native CPU kernels are not used: %s", exc)
        return None
    lib.bi_avx512.restype = ctypes.c_int
    lib.bi_isa.restype = ctypes.c_char_p
    lib.bi_linear_forward.argtypes = [ctypes.POINTER(Linear), ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.bi_linear_forward.restype = ctypes.c_int
    lib.bi_linear_forward8.argtypes = lib.bi_linear_forward.argtypes
    lib.bi_linear_forward8.restype = ctypes.c_int
    lib.bi_act8.restype = ctypes.c_int
    lib.bi_work_floats.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int]
    lib.bi_work_floats.restype = ctypes.c_int64
    lib.bi_decode.argtypes = [ctypes.POINTER(Model), ctypes.c_int, *[ctypes.c_void_p] * 8,
                              ctypes.c_int]
    lib.bi_decode.restype = None
    lib.bi_packed_attention.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
        ctypes.c_int, ctypes.c_int]
    lib.bi_packed_attention.restype = ctypes.c_int
    lib.bi_kv_store.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                ctypes.c_void_p]
    lib.bi_kv_store.restype = None
    lib.bi_kv_load.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.bi_kv_load.restype = None
    lib.bi_rms_norm_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
                                     ctypes.c_int]
    lib.bi_rms_norm_rows.restype = None
    lib.bi_silu_mul_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_int]
    lib.bi_silu_mul_rows.restype = None
    lib.bi_rope_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int]
    lib.bi_rope_rows.restype = None
    lib.bi_add_layer_norm_rows.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int]
    lib.bi_add_layer_norm_rows.restype = None
    lib.bi_gelu.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.bi_gelu.restype = None
    logger.info("native CPU kernels loaded from %s (ISA level %s)", target,
                lib.bi_isa().decode())
    return lib


def packed_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     lengths: Sequence[int], num_heads: int, *,
                     starts: Sequence[int] | None = None, causal: bool = False,
                     scale: float | None = None, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Self-attention of sentences in float32 CPU rows: `q` `[T, num_heads * head_dim]`, `k`
    and `v` `[T, kv_heads * head_dim]` (each with its own row stride, heads side by side in a
    row: views of one fused projection do), sentence s the `lengths[s]` rows from `starts[s]`
    (default: end to end from row 0). Each row attends to its sentence's rows, unmasked or
    (`causal`) up to itself; query head h reads KV head h // (num_heads // kv_heads); scores
    scaled by `scale` (default 1/sqrt(head_dim)). Written into `out` (a new `[T, num_heads *
    head_dim]` tensor by default; rows outside the sentences are left as they are)."""
    tensors = (q, k, v) if out is None else (q, k, v, out)
    if not all(t.dim() == 2 and t.stride(1) == 1 and t.dtype == torch.float32
               and t.device.type == "cpu" for t in tensors) or k.shape != v.shape \
            or k.shape[0] != q.shape[0]:
        raise ValueError("packed_attention takes float32 CPU rows: q [T, heads * d], k and v "
                         "[T, kv_heads * d]")
    if num_heads < 1 or q.shape[1] % num_heads:
        raise ValueError(f"num_heads must divide the row width {q.shape[1]}, got {num_heads}")
    head_dim = q.shape[1] // num_heads
    kv_heads = k.shape[1] // head_dim
    if kv_heads < 1 or k.shape[1] % head_dim or num_heads % kv_heads:
        raise ValueError(f"k and v rows of {k.shape[1]} do not hold KV heads of {head_dim} "
                         f"that divide {num_heads} query heads")
    counts = list(lengths)
    begins = list(itertools.accumulate(counts, initial=0))[:-1] if starts is None \
        else list(starts)
    if len(begins) != len(counts) or any(n < 1 or b < 0 or b + n > q.shape[0]
                                         for b, n in zip(begins, counts, strict=True)):
        raise ValueError(f"lengths must be positive and lie within the {q.shape[0]} rows")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    elif out.shape != q.shape:
        raise ValueError("out must have q's shape")
    if not counts:
        return out
    count_t = torch.tensor(counts, dtype=torch.int64)
    begin_t = torch.tensor(begins, dtype=torch.int64)
    if lib.bi_packed_attention(len(counts), begin_t.data_ptr(), count_t.data_ptr(),
                               max(counts), num_heads, kv_heads, head_dim, q.data_ptr(),
                               q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                               v.stride(0), out.data_ptr(), out.stride(0),
                               head_dim ** -0.5 if scale is None else scale, int(causal),
                               torch.get_num_threads()):
        raise MemoryError("the native attention could not allocate its scratch")
    return out
