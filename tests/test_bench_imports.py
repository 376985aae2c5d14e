"""The bench layer speaks only HTTP: importing it loads no torch and no engine code."""

from __future__ import annotations

import subprocess
import sys


def test_bench_imports_no_torch_or_engine() -> None:
    code = (
        "import sys, batchinfer.cli.bench, batchinfer.bench.serve, batchinfer.bench.sweep\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(("
        "'batchinfer.engine', 'batchinfer.runner', 'batchinfer.models'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
