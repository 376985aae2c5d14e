"""Priority classes: a mix of request classes, each sent as the request's `service_tier`.

`--mix interactive:0.8,batch:0.2` gives each request a class drawn independently with these
weights (normalised to sum to 1), reproducible from `--seed`. A class may have its own lengths
(`--class-input-len batch=1000:2000`, `--class-output-len batch=256:512`) and may arrive all at
time 0 (`--mix-arrival batch=burst`) while the other classes follow `--request-rate`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from batchinfer.bench.workload import parse_length_spec

CLASS_NAME = re.compile(r"[a-z][a-z0-9_-]*")
# `rate`: on the --request-rate / --burstiness schedule (the default); `burst`: all at time 0.
ARRIVAL_MODES = ("rate", "burst")
# The classes are drawn from a stream of their own, so that they do not correlate with the
# lengths or arrival intervals drawn from the same seed.
_CLASS_STREAM = 1


def parse_mix(text: str) -> dict[str, float]:
    """`"interactive:4,batch:1"` -> `{"interactive": 4.0, "batch": 1.0}`; `check_mix` checks
    and normalises the weights."""
    mix: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition(":")
        if not sep:
            raise ValueError(f"--mix {text!r}: expected CLASS:WEIGHT,CLASS:WEIGHT,...")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"--mix {text!r}: {value!r} is not a number") from None
        if name in mix:
            raise ValueError(f"--mix {text!r}: class {name!r} given twice")
        mix[name] = weight
    return mix


def check_mix(mix: Mapping[str, float]) -> dict[str, float]:
    """The mix with its weights normalised to sum to 1; `ValueError` naming `--mix` for a bad
    class name or a weight that is not a positive finite number."""
    for name, weight in mix.items():
        if not isinstance(name, str) or not CLASS_NAME.fullmatch(name):
            raise ValueError(f"--mix: class name {name!r} must match {CLASS_NAME.pattern}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) \
                or not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"--mix: the weight of {name!r} must be a positive number, "
                             f"got {weight!r}")
    total = sum(mix.values())
    return {name: weight / total for name, weight in mix.items()}


def parse_class_options(items: Sequence[str], flag: str) -> dict[str, str]:
    """`["batch=1000:2000", "bg=64"]` -> `{"batch": "1000:2000", "bg": "64"}` (values unparsed)."""
    options: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise ValueError(f"{flag} {item!r}: expected CLASS=VALUE")
        if name in options:
            raise ValueError(f"{flag}: class {name!r} given twice")
        options[name] = value.strip()
    return options


def check_class_options(
    mix: Mapping[str, float],
    class_input_len: Mapping[str, str],
    class_output_len: Mapping[str, str],
    mix_arrival: Mapping[str, str],
) -> None:
    """`ValueError` naming the flag for a class not in the mix, a bad length or arrival mode."""
    for flag, options in (("--class-input-len", class_input_len),
                          ("--class-output-len", class_output_len),
                          ("--mix-arrival", mix_arrival)):
        for name, value in options.items():
            if name not in mix:
                known = ", ".join(mix) or "none: pass --mix"
                raise ValueError(f"{flag} {name}={value}: {name!r} is not a class of --mix "
                                 f"({known})")
            if flag == "--mix-arrival":
                if value not in ARRIVAL_MODES:
                    raise ValueError(f"{flag} {name}={value}: the mode must be one of "
                                     f"{', '.join(ARRIVAL_MODES)}")
            else:
                parse_length_spec(value, f"{flag} {name}")


def assign_classes(mix: Mapping[str, float], num_requests: int, seed: int) -> list[str]:
    """The class of each request, drawn with the mix's probabilities; [] without a mix."""
    if not mix:
        return []
    rng = np.random.default_rng([seed, _CLASS_STREAM])
    names = list(mix)
    picks = rng.choice(len(names), size=num_requests, p=np.asarray(list(mix.values())))
    return [names[i] for i in picks]
