"""Arrival times as a pure function: mean interval 1/rate, CV 1/sqrt(burstiness)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchinfer.bench.arrival import arrival_times, parse_rate


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
@pytest.mark.parametrize("rate", [2.0, 50.0])
def test_interval_mean_and_cv(rate: float, burstiness: float) -> None:
    times = arrival_times(20_001, rate, burstiness, seed=1)
    intervals = np.diff(times)
    assert times[0] == 0.0
    assert np.all(intervals >= 0)
    assert intervals.mean() == pytest.approx(1 / rate, rel=0.05)
    cv = intervals.std() / intervals.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_reproducible_from_seed() -> None:
    assert arrival_times(100, 4.0, 1.0, seed=7) == arrival_times(100, 4.0, 1.0, seed=7)
    assert arrival_times(100, 4.0, 1.0, seed=7) != arrival_times(100, 4.0, 1.0, seed=8)


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, -2.0)])
def test_invalid_values_raise(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_times(10, rate, burstiness)


def test_parse_rate() -> None:
    assert parse_rate("inf") == math.inf
    assert parse_rate("2.5") == 2.5
    for bad in ("0", "-3", "fast"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_rate(bad)
