"""Sampling parameters of one request, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchinfer.core.structured_output import StructuredOutput
from batchinfer.core.validation import INT64_MAX, INT64_MIN

# Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): dividing logits by less would make
# the distribution a point mass anyway, and by far less (1e-300 is 0.0 in float32) it overflows
# to inf and NaN.
MIN_SAMPLING_TEMPERATURE = 1e-5
# OpenAI's range of a `logit_bias` value: -100 bans a token, +100 makes it all but certain.
MAX_LOGIT_BIAS = 100.0


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; mirrors vLLM's `SamplingParams` field names.

    Every field is checked in `__post_init__`; a bad value raises `ValueError` naming the field.
    A `temperature` below `MIN_SAMPLING_TEMPERATURE` (1e-5, 0 included) means greedy. `seed`
    (a 64-bit integer) makes sampling of this request reproducible whatever else shares its
    batch. Integers are 64-bit; token ids are checked against the vocabulary by the engine.
    `logit_bias` maps token ids to a bias in [-100, 100] added to their logits before sampling.
    `structured_output` constrains the output to a JSON schema, a regex, a choice or a grammar
    (`StructuredOutput`): the grammar then decides where the output ends, so an end-of-sequence
    token it allows ends the output even under `ignore_eos` or short of `min_tokens`.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("n", self.n, low=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or at least 1, got 0")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0)
            if self.logprobs > 20:
                raise ValueError(f"logprobs must be at most 20, got {self.logprobs}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        self._check_logit_bias()
        if self.structured_output is not None and not isinstance(self.structured_output,
                                                                 StructuredOutput):
            raise ValueError("structured_output must be a StructuredOutput, got "
                             f"{type(self.structured_output).__name__}")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must map token ids to biases, got "
                             f"{type(self.logit_bias).__name__}")
        self.logit_bias = dict(self.logit_bias)
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id, low=0)
            _check_float("logit_bias", bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for "
                                 f"token {token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check_int(name: str, value: object, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must be a 64-bit integer, got {value}")


def _check_float(name: str, value: object, low: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
