"""`benchmarks/gpu_check.py` runs end to end on a CPU under Triton's interpreter (the same
engine path a GPU runs), and its greedy row compares real tokens with Hugging Face's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_interpreted_on_a_cpu(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
         "--shapes", "tiny", "--dtype", "float32", "--tokens", "6", "--burst", "3",
         "--burst-tokens", "4", "--batches", "1", "--json", str(tmp_path / "rows.json")],
        capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| tiny | greedy float32 | 6/6 tokens equal HF's ok |" in result.stdout
    assert "burst of 3, FP8 e4m3 KV" in result.stdout
