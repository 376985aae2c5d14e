"""Where batchinfer keeps what it makes once and reuses, for every layer to share.

Pure Python (no torch), so the native kernels, the model loaders and the server agree on one
folder without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$BATCHINFER_CACHE`, else `~/.cache/batchinfer`: converted GGUFs (`gguf/`), the built
    native library (`native/`), the start-up measurements (`linear-kernels/`,
    `native-decode/`) and the Batch API's store (`batches/`)."""
    env = os.environ.get("BATCHINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchinfer"
