"""An empty `BATCHINFER_CACHE` for one test that still shares the built native libraries."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.core.paths import default_cache_dir


def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Point `BATCHINFER_CACHE` at `tmp_path / "cache"`: kernel choices, weight-form and
    step-cost measurements and GGUF conversions are made anew there, but its `native` folder
    is the session cache's, so the C kernels (which depend on nothing a test sets) are not
    compiled again for every such test (seconds each)."""
    shared = default_cache_dir() / "native"
    shared.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (cache / "native").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("BATCHINFER_CACHE", str(cache))
    return cache
