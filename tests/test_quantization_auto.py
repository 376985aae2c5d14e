"""`--quantization auto` (the default): a quantized checkpoint keeps its own form where that
measured faster than float32 here, a float one stays float."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from batchinfer import LLM
from batchinfer.models import linear_kernels as lk
from batchinfer.models import load_model
from batchinfer.models.gguf import STORED_FORMAT, weight_format
from batchinfer.models.registry import default_gguf_path
from tests.tiny_models import make_tiny_gguf, make_tiny_llama


@pytest.mark.slow
def test_the_embedded_gguf_is_q4_1_held_exactly_by_q4() -> None:
    stored = weight_format(default_gguf_path())  # its whole tensor index: seconds
    assert (stored.stored_type, stored.form, stored.exact) == ("Q4_1", "q4", True)


def test_a_gguf_of_float_matrices_is_float_and_its_folder_says_so(tmp_path: Path) -> None:
    # Its ffn_down matrices are Q8_0, the other four of each layer float32: most are floats.
    gguf_path, _ = make_tiny_gguf(tmp_path)
    stored = weight_format(gguf_path)
    assert (stored.stored_type, stored.form, stored.exact) == ("F32", "none", True)
    loaded = load_model(str(gguf_path), torch.float32, "cpu", cache_dir=tmp_path / "cache")
    assert loaded.stored == stored
    # Later loads read the conversion's record, not the GGUF's tensor index.
    record = loaded.path / STORED_FORMAT
    record.write_text(json.dumps({"stored_type": "Q8_0", "form": "q8", "exact": True}))
    assert weight_format(gguf_path, loaded.path).form == "q8"


def test_a_float_checkpoint_stays_float(tmp_path: Path) -> None:
    llm = LLM(str(make_tiny_llama(tmp_path)), dtype="float32", kv_cache_memory="4M")
    assert llm.engine.config.quantization == "auto"
    assert llm.engine.worker.quantization == "none"


def test_floats_need_no_measurement(tmp_path: Path) -> None:
    choice = lk.choose_weight_form(nn.Sequential(nn.Linear(64, 64)), "none", "F16",
                                   torch.device("cpu"), torch.float32, tmp_path)
    assert choice.form == "none"
    assert not (tmp_path / "weight-forms").exists()


def test_a_forced_kernel_names_the_form(tmp_path: Path) -> None:
    llm = LLM(str(make_tiny_llama(tmp_path)), dtype="float32", kv_cache_memory="4M",
              linear_kernels="q4_dense")
    assert llm.engine.worker.quantization == "q4"


def test_the_faster_form_at_one_row_is_kept_and_the_timings_are_cached(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 300))
    cpu = torch.device("cpu")

    def choose() -> lk.FormChoice:
        return lk.choose_weight_form(module, "q4", "Q4_1 (q4, exactly)", cpu, torch.float32,
                                     tmp_path, heads=("2",))

    measured = choose()
    [path] = (tmp_path / "weight-forms").glob("*.json")
    seconds = json.loads(path.read_text())["seconds_per_pass"]
    assert set(seconds) == {"q4", "none"}
    assert all(len(v) == len(lk.FORM_PROBE_ROWS) and min(v) > 0 for v in seconds.values())
    assert measured.form == ("q4" if seconds["q4"][0] < seconds["none"][0] else "none")
    # The head ("2") is not a decoder linear: with it counted, the shapes, so the key, differ.
    lk.choose_weight_form(module, "q4", "Q4_1", cpu, torch.float32, tmp_path)
    assert len(list((tmp_path / "weight-forms").glob("*.json"))) == 2

    # A restart reads the cache: with the timings made to say the other thing, it follows them.
    for q4_ms, float_ms, form in ((1.0, 2.0, "q4"), (2.0, 1.0, "none")):
        path.write_text(json.dumps({"seconds_per_pass": {
            "q4": [q4_ms / 1e3, 9e-3], "none": [float_ms / 1e3, 1e-3]}}))
        choice = choose()
        assert choice.form == form
        assert f"q4 {q4_ms:.2f} / 9.00 ms, float32 {float_ms:.2f} / 1.00 ms" in choice.reason

