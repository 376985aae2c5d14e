"""`core.validation`: the checks every config uses, and their one message format."""

from __future__ import annotations

import math

import pytest

from batchinfer.core.validation import check_choice, check_fraction, check_int, check_non_negative


def test_check_int() -> None:
    assert check_int("max_num_seqs", 3) == 3
    assert check_int("seed", 0, low=0) == 0
    for bad in (0, -1, 2.0, True, "3", None):
        with pytest.raises(ValueError, match=r"max_num_seqs must be an integer >= 1, got"):
            check_int("max_num_seqs", bad)


def test_check_non_negative_and_fraction() -> None:
    assert check_non_negative("max_batch_delay_ms", 0) == 0
    assert check_non_negative("max_batch_delay_ms", 2.5) == 2.5
    for bad in (-0.1, math.nan, False, "1"):
        with pytest.raises(ValueError, match="max_batch_delay_ms must be a number >= 0"):
            check_non_negative("max_batch_delay_ms", bad)
    assert check_fraction("kv_admission_watermark", 1) == 1
    for bad in (0, 1.01, math.nan, True):
        with pytest.raises(ValueError, match=r"kv_admission_watermark must be in \(0, 1\]"):
            check_fraction("kv_admission_watermark", bad)


def test_check_choice() -> None:
    assert check_choice("--endpoint", "chat", ("completions", "chat")) == "chat"
    with pytest.raises(ValueError, match="--endpoint must be one of completions, chat; got 'x'"):
        check_choice("--endpoint", "x", ("completions", "chat"))
