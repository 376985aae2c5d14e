"""Joining or starting the Ray cluster that `serve --ray` and `run-batch --ray` run on."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from types import ModuleType
from typing import Any

from batchinfer.core.config import EngineConfig

logger = logging.getLogger(__name__)
RAY_EXTRA = "pip install 'batchinfer[ray]'"


def require_ray() -> ModuleType:
    """The `ray` module; `ValueError` telling how to install it when it is missing."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"--ray needs Ray: {RAY_EXTRA}") from None
    return ray


LOCAL_CLUSTER_DEADLINES = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_gcs_server_port_wait_time_s": "120",
    "RAY_worker_register_timeout_seconds": "120",
}


def connect(address: str | None, **init_kwargs: Any) -> str | None:
    """Join the cluster at `address` ('auto': the one `ray start` made on this node), or at
    $RAY_ADDRESS, or start a local one when neither is given. Already connected (a test, a
    notebook): kept as it is. Returns "started" (a local cluster this process owns), "joined"
    (someone else's: leave it running) or None (already connected: nothing to undo)."""
    ray = require_ray()
    if ray.is_initialized():
        return None
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if address is None:
        # A local cluster: no dashboard (nothing here reads it); metrics reported every 2 s
        # (Ray's default, 10 s, is coarse next to a benchmark's scrapes); workers at normal
        # priority (Ray's default nice 15 lets any other process preempt an engine's OpenMP
        # threads mid-step, and each preemption stalls the whole step).
        # Start-up deadlines a busy machine (a laptop) can meet: by default Serve's proxy is
        # killed after three missed 5 s readiness checks. Ray's processes inherit them.
        for name, value in LOCAL_CLUSTER_DEADLINES.items():
            os.environ.setdefault(name, value)
        init_kwargs.setdefault("include_dashboard", False)
        init_kwargs.setdefault("_system_config", {"metrics_report_interval_ms": 2000,
                                                  "worker_niceness": 0})
        ray.init(**init_kwargs)
        logger.info("started a local Ray cluster (%s CPUs)",
                    ray.cluster_resources().get("CPU", 0))
        return "started"
    ray.init(address=address)
    logger.info("joined the Ray cluster at %s (%s CPUs)", address,
                ray.cluster_resources().get("CPU", 0))
    return "joined"


def actor_cpus(engine_config: EngineConfig | None, cpus: float | None) -> float:
    """CPUs Ray reserves for one engine actor: `cpus`, else the engine's num_threads, else 1."""
    if cpus is not None:
        if not cpus > 0:
            raise ValueError(f"cpus per replica must be positive, got {cpus}")
        return cpus
    if engine_config is not None and engine_config.num_threads is not None:
        return float(engine_config.num_threads)
    return 1.0


def actor_engine_config(engine_config: EngineConfig, cpus: float) -> EngineConfig:
    """The engine of one actor: unless told otherwise, as many torch threads as its CPUs (torch
    would otherwise take every core of the node, once per actor)."""
    if engine_config.num_threads is not None:
        return engine_config
    return dataclasses.replace(engine_config, num_threads=max(1, math.floor(cpus)))


def metrics_export_urls() -> list[str]:
    """Where each live node of the cluster exports its Prometheus metrics (Ray's own and the
    replicas' `ray_batchinfer_*`)."""
    ray = require_ray()
    return [f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            for node in ray.nodes() if node.get("Alive") and node.get("MetricsExportPort")]
