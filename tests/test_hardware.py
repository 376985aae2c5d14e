"""One device/dtype rule for the generator and the encoder, and `read_json`'s errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.core.config import DTYPES
from batchinfer.models import hardware
from batchinfer.models.encoder import ENCODER_DTYPES
from batchinfer.models.files import read_json
from batchinfer.models.hardware import (
    TORCH_DTYPES,
    cpu_has_fast_bf16,
    resolve_device,
    resolve_dtype,
)


def test_every_configurable_dtype_has_a_torch_dtype() -> None:
    assert set(DTYPES) == {"auto", *TORCH_DTYPES}
    assert set(ENCODER_DTYPES) <= set(DTYPES)


def test_explicit_dtypes_and_bad_names() -> None:
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of .*'fp8'"):
        resolve_dtype("fp8", "cpu")
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16; got"):
        resolve_dtype("float16", "cpu", ENCODER_DTYPES)  # the encoder offers no float16


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_auto_dtype_follows_the_cpu_for_generator_and_encoder_alike(
        monkeypatch: pytest.MonkeyPatch, fast_bf16: bool) -> None:
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: fast_bf16)
    expected = torch.bfloat16 if fast_bf16 else torch.float32
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("auto", "cpu", ENCODER_DTYPES) == expected


def test_fast_bf16_needs_avx512_kernels_and_the_cpu_flag(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with_bf16, without = tmp_path / "with", tmp_path / "without"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 sse\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu avx512f sse\n")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert cpu_has_fast_bf16(with_bf16)
    assert not cpu_has_fast_bf16(without)
    assert not cpu_has_fast_bf16(tmp_path / "missing")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not cpu_has_fast_bf16(with_bf16)


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_read_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "ok.json").write_text('{"a": 1}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text('{"a": ')
    assert read_json(tmp_path / "ok.json") == {"a": 1}
    assert read_json(tmp_path / "list.json", expect=list) == [1, 2]
    assert read_json(tmp_path / "absent.json", required=False) == {}
    assert read_json(tmp_path / "absent.json", required=False, expect=list) == []
    with pytest.raises(ValueError, match="absent.json is missing"):
        read_json(tmp_path / "absent.json")
    with pytest.raises(ValueError, match=r"bad\.json: cannot parse"):
        read_json(tmp_path / "bad.json")
    with pytest.raises(ValueError, match=r"list\.json: expected a JSON object, got list"):
        read_json(tmp_path / "list.json")
