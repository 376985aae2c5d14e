"""Checks of configuration values, shared by every config: each raises `ValueError` naming it.

`name` is what the user typed: a field name (`max_num_seqs`) or a flag (`--num-prompts`). Pure
Python, no torch, so the bench layer (which speaks only HTTP) uses them too. Bools are refused
where a number is expected: `True` is an `int` to Python, never a count to a user.
"""

from __future__ import annotations

from collections.abc import Collection

# Integers the API takes are 64-bit, as OpenAI's are: a bigger one cannot mean anything.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class ParamError(ValueError):
    """A request field with a bad value; `param` is the field's name in the API."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def check_int(name: str, value: object, low: int = 1) -> int:
    """`value` if it is an integer >= `low` (1: a positive count); else `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """`value` if it is True or False (not 1, not "yes"); else `ValueError`."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def check_non_negative(name: str, value: object) -> float:
    """`value` if it is a number >= 0 (NaN is not); else `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return value


def check_fraction(name: str, value: object) -> float:
    """`value` if it is a number in (0, 1]; else `ValueError`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


def check_choice(name: str, value: object, choices: Collection[str]) -> str:
    """`value` if it is one of `choices`; else `ValueError` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value
