"""Each instruction-set level's kernels against the portable level's, entry point by entry
point (`native_levels_check.c`: products, cache widening, SiLU, GELU, packed attention,
decode steps; 8-bit-input products against a scalar reference of their rounding): the levels
this CPU runs, natively; the Arm NEON level (`native/kernels/neon.h`) on an x86 machine,
where the Debian cross-compiler builds the `neon` and `portable` levels for 64-bit Arm with
the flags the loader gives them (for ARMv8.0, and for ARMv8.2 with dot products) and
`qemu-user` runs the comparison on an emulated CPU of that architecture. Correctness only:
qemu's timings say nothing about an Arm CPU's. The Arm checks are skipped, with the reason,
where the cross-compiler or qemu is missing (`make test` installs them where it can)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from batchinfer import native
from batchinfer.core.cpu import cpu_flags

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")
CHECK = Path(__file__).with_name("native_levels_check.c")
# The cross-compiler's own CPU is not an Arm one: an architecture stands in for
# `-march=native`, run under a qemu CPU of that architecture: the ARMv8.0 baseline (no 8-bit
# dot products: the neon level's 16-bit paths only), and ARMv8.2 with the dot-product
# extension (its `sdot` 8-bit path too).
ARM_TARGETS = {"armv8.0": ("-march=armv8-a", "cortex-a57"),
               "armv8.2+dotprod": ("-march=armv8.2-a+dotprod", "max")}


def _arm_tools() -> tuple[str, str]:
    if platform.machine() in native.ARM64_MACHINES:
        pytest.skip("an Arm machine runs the neon level natively (the test above)")
    cc, qemu = shutil.which(CROSS_CC), shutil.which(QEMU)
    if cc is None or qemu is None or not (SYSROOT / "include" / "stdio.h").is_file():
        pytest.skip(f"no {CROSS_CC} / {QEMU} / {SYSROOT}/include (Debian: gcc-aarch64-linux-gnu, "
                    "libc6-dev-arm64-cross, qemu-user)")
    return cc, qemu


def _build(cc: str, level: str, target: Path, source: Path = native.SOURCE,
           arch: str = "-march=armv8-a") -> None:
    flags = [arch if flag == "-march=native" else flag
             for flag in native.level_flags(level, machine="aarch64")]
    subprocess.run([cc, *flags, "-o", str(target), str(source), *native.LIBS],
                   check=True, capture_output=True, text=True, timeout=300)


def _compare(cc: str, qemu: str, level_lib: Path, portable_lib: Path, kernels: Path,
             folder: Path, cpu: str = "cortex-a57") -> subprocess.CompletedProcess[str]:
    """Builds the comparison program against `kernels`' common.h and runs it under qemu,
    emulating `cpu`."""
    check = folder / "check"
    subprocess.run([cc, "-O1", f"-I{kernels}", "-o", str(check), str(CHECK), "-ldl", "-lm"],
                   check=True, capture_output=True, text=True, timeout=300)
    return subprocess.run([qemu, "-cpu", cpu, "-L", str(SYSROOT), str(check), str(level_lib),
                           str(portable_lib)], capture_output=True, text=True, timeout=600)


def has_act8(level: str) -> bool:
    """Whether the loader's build of `level` has 8-bit-input products on this CPU: AVX2
    always, AVX-512 with VNNI, NEON with the dot-product extension (`asimddp`)."""
    flags = cpu_flags()
    return {"avx2": True, "avx512": "avx512_vnni" in flags,
            "neon": "asimddp" in flags}.get(level, False)


@pytest.mark.parametrize("level", [level for level in native.ISA_LEVELS if level != "portable"])
def test_each_level_this_cpu_runs_matches_the_portable_one(level, tmp_path):
    """The comparison program passes for every level this CPU runs, built as the loader
    builds it, against the portable build."""
    if level not in native.supported_levels():
        pytest.skip(f"this CPU does not run the {level} build")
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    libs = {}
    for name in (level, "portable"):
        libs[name] = tmp_path / f"{name}.so"
        subprocess.run([cc, *native.level_flags(name), "-o", str(libs[name]), str(native.SOURCE),
                        *native.LIBS], check=True, capture_output=True, text=True, timeout=300)
    check = tmp_path / "check"
    subprocess.run([cc, "-O1", f"-I{native.SOURCE.parent / 'kernels'}", "-o", str(check),
                    str(CHECK), "-ldl", "-lm"], check=True, capture_output=True, text=True,
                   timeout=300)
    result = subprocess.run([str(check), str(libs[level]), str(libs["portable"])],
                            capture_output=True, text=True, timeout=600)
    assert result.stdout.startswith(f"levels {level} portable"), result.stdout + result.stderr
    failures = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert result.returncode == 0 and not failures, "\n".join(failures) + result.stderr
    _assert_every_check_ran(result.stdout, act8=has_act8(level))


def _assert_every_check_ran(stdout: str, act8: bool) -> None:
    """Every check the program lists ran and passed; `act8`: with the level's 8-bit products
    (else the 16-bit ones where 8-bit ones are asked for)."""
    assert f"act8 {int(act8)}" in stdout.splitlines()
    passed = {line[3:] for line in stdout.splitlines() if line.startswith("ok ")}
    for kind in ("f32", "q4", "q8"):
        assert sum(name.startswith(f"linear {kind} ") for name in passed) >= 130, kind
        assert f"decode {kind} weights, f16 cache, threads=3" in passed
    for kind in ("q4", "q8"):
        eight = {name for name in passed
                 if name.startswith(f"linear8 {kind} ") and "(16-bit)" not in name}
        assert len(eight) >= (100 if act8 else 0), kind
        assert f"decode8 {kind} weights, threads=2" in passed
    for kv_type in ("f32", "f16", "bf16", "e4m3", "e5m2"):
        assert f"kv_load {kv_type}" in passed
        for head_dim in (64, 128):
            assert f"decode head={head_dim} q4 weights, {kv_type} cache, threads=2" in passed
    for d in (16, 24, 32, 64, 128):
        for mask in ("", " causal"):
            assert any(name.startswith(f"packed_attention d={d}{mask} threads=")
                       for name in passed), (d, mask)
    assert {f"linear q4 n=80 k=64 rows={rows} threads={threads}" for rows in (97, 130)
            for threads in (1, 3)} <= {name.split(" bias")[0].split(" accumulate")[0]
                                       for name in passed}
    assert {"gelu n=13", "gelu n=16421", "silu_mul inter=67"} <= passed


# The ARMv8.0 build (no dot products) runs in `make test-slow`; the default suite runs the
# ARMv8.2 one, whose 16-bit paths are the same code.
@pytest.mark.parametrize("target", [
    pytest.param(target, marks=pytest.mark.slow) if target == "armv8.0" else target
    for target in ARM_TARGETS])
def test_neon_kernels_match_the_portable_ones_under_qemu(target, tmp_path):
    """Every check of the comparison program passes for the neon build against the portable
    one, and it ran the checks it lists (the linears at every kind and shape, the widening of
    every cache type, decode steps of every weight kind; 8-bit products where the target has
    dot products), on an emulated CPU of the architecture built for: an ARMv8.0 build runs on
    a core without the ARMv8.2 instructions."""
    cc, qemu = _arm_tools()
    arch, cpu = ARM_TARGETS[target]
    neon, portable = tmp_path / "neon.so", tmp_path / "portable.so"
    _build(cc, "neon", neon, arch=arch)
    _build(cc, "portable", portable, arch=arch)
    result = _compare(cc, qemu, neon, portable, native.SOURCE.parent / "kernels", tmp_path, cpu)
    lines = result.stdout.splitlines()
    assert lines and lines[0] == "levels neon portable", result.stdout + result.stderr
    failures = [line for line in lines if line.startswith("FAIL")]
    assert result.returncode == 0 and not failures, "\n".join(failures) + result.stderr
    _assert_every_check_ran(result.stdout, act8="dotprod" in target)


@pytest.mark.slow
def test_the_comparison_catches_a_wrong_kernel(tmp_path):
    """The comparison can fail: a neon build whose q4 products take the wrong input pair for
    the high nibbles is caught."""
    cc, qemu = _arm_tools()
    source = tmp_path / "src"
    shutil.copytree(native.SOURCE.parent / "kernels", source / "kernels")
    shutil.copy(native.SOURCE, source / native.SOURCE.name)
    neon_h = source / "kernels" / "neon.h"
    right = "vmovl_u8(vget_low_u8(hi))), xb);"
    assert right in neon_h.read_text()
    neon_h.write_text(neon_h.read_text().replace(right, "vmovl_u8(vget_low_u8(hi))), xa);"))
    wrong, portable = tmp_path / "wrong.so", tmp_path / "portable.so"
    _build(cc, "neon", wrong, source / native.SOURCE.name)
    _build(cc, "portable", portable, source / native.SOURCE.name)
    result = _compare(cc, qemu, wrong, portable, source / "kernels", tmp_path)
    assert result.returncode == 1
    assert any(line.startswith("FAIL linear q4") for line in result.stdout.splitlines())
