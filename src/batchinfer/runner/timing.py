"""Timing of start-up measurements: runs of a callable, on the device's clock."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed_runs(run: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Seconds of `repeats` runs of `run` after one untimed warm-up run (on CUDA, each run
    waits for the device)."""
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return times
