"""Request-level batching for encoders and any list-in/list-out callable.

`DynamicBatcher` (online: size + delay window, length buckets, lanes, timeouts, failure
isolation), `batch` (decorator form), `batched_map` (offline fixed batches, input order kept).
Imports are lazy: nothing here pulls torch until the embedding service is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchinfer.batching.batcher import DynamicBatcher
    from batchinfer.batching.config import BatcherConfig, LaneConfig
    from batchinfer.batching.decorator import batch
    from batchinfer.batching.embedding_service import EmbeddingConfig, EmbeddingService
    from batchinfer.batching.errors import (
        BatcherClosedError,
        InputError,
        ItemTimeoutError,
        OverloadedError,
    )
    from batchinfer.batching.metrics import BatcherMetrics
    from batchinfer.batching.offline import batched_map, iter_batched_map

_EXPORTS = {
    "DynamicBatcher": "batcher",
    "batch": "decorator",
    "batched_map": "offline",
    "iter_batched_map": "offline",
    "BatcherConfig": "config",
    "LaneConfig": "config",
    "BatcherMetrics": "metrics",
    "EmbeddingConfig": "embedding_service",
    "EmbeddingService": "embedding_service",
    "BatcherClosedError": "errors",
    "InputError": "errors",
    "ItemTimeoutError": "errors",
    "OverloadedError": "errors",
}
__all__ = [
    "BatcherClosedError",
    "BatcherConfig",
    "BatcherMetrics",
    "DynamicBatcher",
    "EmbeddingConfig",
    "EmbeddingService",
    "InputError",
    "ItemTimeoutError",
    "LaneConfig",
    "OverloadedError",
    "batch",
    "batched_map",
    "iter_batched_map",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'batchinfer.batching' has no attribute {name!r}")
    return getattr(importlib.import_module(f"batchinfer.batching.{module}"), name)
