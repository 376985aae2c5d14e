"""Arrival times of benchmark requests: Poisson or gamma-distributed intervals, as in vLLM.

`burstiness` is the shape of the gamma distribution of the intervals between requests; its
scale is chosen so that the mean interval is `1 / request_rate` whatever the shape. Shape 1 is
a Poisson process (exponential intervals); below 1 the arrivals are burstier, above 1 more
regular. The coefficient of variation of the intervals is `1 / sqrt(burstiness)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from batchinfer.core.validation import check_int


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times in seconds from the start, one per request; the first is 0.

    `request_rate` is requests per second (`math.inf`: every request at time 0).
    """
    check_int("num_requests", num_requests, low=0)
    check_arrivals(request_rate, burstiness)
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    scale = 1.0 / (request_rate * burstiness)
    intervals = rng.gamma(shape=burstiness, scale=scale, size=num_requests - 1)
    return [0.0, *np.cumsum(intervals).tolist()]


def burst_arrival_times(
    in_burst: Sequence[bool], request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times, one per request in order: 0 for those `in_burst`, the others in their order
    on the schedule of `arrival_times` (so the list is not sorted when bursts follow others)."""
    scheduled = iter(arrival_times(in_burst.count(False), request_rate, burstiness, seed))
    return [0.0 if burst else next(scheduled) for burst in in_burst]


def check_arrivals(request_rate: float, burstiness: float) -> None:
    """`ValueError` naming the flag unless the rate is > 0 (or inf) and the shape finite > 0."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness must be a positive number, got {burstiness}")


def parse_rate(text: str) -> float:
    """A request rate from the CLI: a positive number or `inf`."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"--request-rate {text!r}: expected a number or 'inf'") from None
    if not rate > 0:
        raise ValueError(f"--request-rate {text!r}: must be > 0 (or inf)")
    return rate
