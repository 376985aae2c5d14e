"""Workloads: the prompts a benchmark sends, reproducible from a seed.

The bench has no tokenizer of the server's model, so a synthetic prompt of N tokens is N words
drawn from a list of common English words, each of which is one token in the usual BPE
vocabularies (Llama, Qwen2, Mistral, SmolLM2 encode " the", " time", ... as one token). The
count is close, not exact; the figure reported is the server's own `usage.prompt_tokens`.
`tokens_per_word` (measured with `POST /tokenize` where the server has it) corrects the ratio.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchinfer.core.validation import check_int

# Common words that are a single token (with their leading space) in Llama/Qwen/Mistral BPEs.
WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "that", "on", "as", "with", "by", "he",
    "at", "from", "his", "it", "an", "were", "are", "which", "this", "be", "or", "has", "had",
    "first", "one", "their", "its", "new", "after", "but", "who", "not", "they", "have", "her",
    "she", "two", "been", "other", "when", "there", "all", "during", "into", "school", "time",
    "may", "years", "more", "most", "only", "over", "city", "some", "world", "would", "where",
    "later", "up", "such", "used", "many", "can", "state", "about", "national", "out", "known",
    "university", "united", "then", "made", "also", "year", "well", "people", "under", "part",
    "between", "them", "three", "these", "film", "both", "team", "before", "high", "him", "our",
    "game", "music", "life", "back", "group", "being", "water", "number", "day", "long", "system",
    "great", "because", "work", "north", "south", "east", "west", "home", "house", "family",
    "government", "company", "name", "area", "line", "war", "old", "main", "each", "power",
    "same", "still", "every", "small", "large", "white", "black", "red", "green", "blue", "light",
    "left", "right", "town", "open", "play", "show", "end", "four", "five", "six", "seven",
    "eight", "nine", "ten", "book", "free", "field", "early", "late", "river", "road", "place",
    "side", "hand", "head", "while", "next", "own", "body", "land", "love", "last", "few", "good",
    "real", "law", "general", "point", "case", "week", "form", "order", "age", "young", "local",
    "air", "food", "army", "run", "set", "top", "level"
)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One prompt to send: `prompt` text (with an optional shared `system_prompt`) or chat
    `messages` taken verbatim from a file; `max_tokens` is the exact output length asked for.
    `request_class` (of `--mix`) is sent as the request's `service_tier`."""

    max_tokens: int
    num_prompt_tokens_est: int
    prompt: str | None = None
    system_prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    request_class: str | None = None


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """A distribution of token lengths, parsed from the CLI by `parse_length_spec`.

    kinds: `fixed` (low), `uniform` (low..high inclusive), `normal` (mean, std; clipped to >= 1),
    `hist` (lengths drawn with the weights of a histogram file).
    """

    kind: str
    low: int = 1
    high: int = 1
    mean: float = 0.0
    std: float = 0.0
    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def sample(self, rng: np.random.Generator, size: int) -> list[int]:
        """Draw `size` lengths (each >= 1)."""
        if self.kind == "fixed":
            return [self.low] * size
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(self.low, self.high + 1, size=size)]
        if self.kind == "normal":
            draws = np.rint(rng.normal(self.mean, self.std, size=size))
            return [max(1, int(x)) for x in draws]
        probs = np.asarray(self.weights) / sum(self.weights)
        return [int(x) for x in rng.choice(np.asarray(self.values), size=size, p=probs)]


@dataclass(frozen=True, slots=True)
class ClassLengths:
    """Lengths drawn per request from its class's spec: request i is of class `classes[i]`,
    whose spec is `overrides[class]`, else `default`."""

    classes: tuple[str, ...]
    default: LengthSpec
    overrides: dict[str, LengthSpec]

    def sample(self, rng: np.random.Generator, size: int) -> list[int]:
        """One length per request of `classes` (`size` must be their number)."""
        if size != len(self.classes):
            raise ValueError(f"{size} lengths asked of a mix of {len(self.classes)} requests")
        lengths = [0] * size
        for name in dict.fromkeys(self.classes):  # in order of first appearance
            where = [i for i, c in enumerate(self.classes) if c == name]
            spec = self.overrides.get(name, self.default)
            for i, length in zip(where, spec.sample(rng, len(where)), strict=True):
                lengths[i] = length
        return lengths


Lengths = LengthSpec | ClassLengths


def parse_length_spec(text: str, flag: str) -> LengthSpec:
    """Parse `N`, `LOW:HIGH`, `normal:MEAN,STD` or `hist:PATH` into a `LengthSpec`.

    A histogram file has one `length weight` pair a line (`#` starts a comment). Raises
    `ValueError` naming `flag` for an impossible range (LOW > HIGH, a length < 1) or a bad file.
    """
    text = text.strip()
    if text.startswith("normal:"):
        parts = text[len("normal:"):].split(",")
        if len(parts) != 2:
            raise ValueError(f"{flag} {text!r}: expected normal:MEAN,STD")
        mean, std = (_number(p, flag, text) for p in parts)
        if mean < 1 or std < 0:
            raise ValueError(f"{flag} {text!r}: need MEAN >= 1 and STD >= 0")
        return LengthSpec("normal", mean=mean, std=std)
    if text.startswith("hist:"):
        return _histogram_spec(Path(text[len("hist:"):]), flag)
    if ":" in text:
        low_text, _, high_text = text.partition(":")
        low, high = int(_number(low_text, flag, text)), int(_number(high_text, flag, text))
        if low < 1:
            raise ValueError(f"{flag} {text!r}: lengths must be >= 1 token")
        if low > high:
            raise ValueError(f"{flag} {text!r}: low {low} is greater than high {high}")
        return LengthSpec("uniform", low=low, high=high)
    length = int(_number(text, flag, text))
    if length < 1:
        raise ValueError(f"{flag} {text!r}: lengths must be >= 1 token")
    return LengthSpec("fixed", low=length, high=length)


def _number(part: str, flag: str, text: str) -> float:
    try:
        return float(part)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: {part!r} is not a number") from None


def _histogram_spec(path: Path, flag: str) -> LengthSpec:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read histogram file {path}: {exc.strerror}") from None
    values: list[int] = []
    weights: list[float] = []
    for lineno, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").split()
        try:
            length, weight = int(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            raise ValueError(f"{flag}: {path}:{lineno}: expected 'length weight'") from None
        if length < 1 or weight < 0:
            raise ValueError(f"{flag}: {path}:{lineno}: need length >= 1 and weight >= 0")
        values.append(length)
        weights.append(weight)
    if not values or sum(weights) <= 0:
        raise ValueError(f"{flag}: {path} has no positive weights")
    return LengthSpec("hist", values=tuple(values), weights=tuple(weights))


def random_text(rng: np.random.Generator, num_tokens: int, tokens_per_word: float = 1.0) -> str:
    """Words drawn from `WORDS` whose token count should be close to `num_tokens`."""
    num_words = max(1, round(num_tokens / tokens_per_word))
    picks = rng.integers(0, len(WORDS), size=num_words)
    return " ".join(WORDS[i] for i in picks)


def synthetic_workload(
    num_requests: int,
    input_len: Lengths,
    output_len: Lengths,
    seed: int,
    tokens_per_word: float = 1.0,
) -> list[BenchRequest]:
    """`num_requests` random prompts with input and output lengths drawn from the specs."""
    rng = np.random.default_rng(seed)
    inputs = input_len.sample(rng, num_requests)
    outputs = output_len.sample(rng, num_requests)
    return [
        BenchRequest(out, num_in, prompt=random_text(rng, num_in, tokens_per_word))
        for num_in, out in zip(inputs, outputs, strict=True)
    ]


def shared_prefix_workload(
    num_requests: int,
    prefix_len: int,
    num_prefixes: int,
    input_len: Lengths,
    output_len: Lengths,
    seed: int,
    tokens_per_word: float = 1.0,
) -> list[BenchRequest]:
    """Prompts in `num_prefixes` groups, each group sharing a system prompt of `prefix_len`
    tokens; `input_len` is the length of each prompt's own (unshared) part."""
    if prefix_len < 1 or num_prefixes < 1:
        raise ValueError("--shared-prefix-len and --num-prefixes must be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [random_text(rng, prefix_len, tokens_per_word) for _ in range(num_prefixes)]
    inputs = input_len.sample(rng, num_requests)
    outputs = output_len.sample(rng, num_requests)
    return [
        BenchRequest(
            out,
            prefix_len + num_in,
            prompt=random_text(rng, num_in, tokens_per_word),
            system_prompt=prefixes[i % num_prefixes],
        )
        for i, (num_in, out) in enumerate(zip(inputs, outputs, strict=True))
    ]


def jsonl_workload(
    path: Path, num_requests: int | None, output_len: LengthSpec, seed: int
) -> list[BenchRequest]:
    """Prompts from a JSONL file, one `{"prompt": str}` or `{"messages": [...]}` object a line,
    with an optional `max_tokens` (else drawn from `output_len`). The first `num_requests`
    lines are used (all when None); fewer lines than asked are cycled."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read dataset {path}: {exc.strerror}") from None
    rng = np.random.default_rng(seed)
    requests = [
        _jsonl_request(line, path, lineno, rng, output_len)
        for lineno, line in enumerate(lines, 1)
        if line.strip()
    ]
    if not requests:
        raise ValueError(f"dataset {path} has no prompts")
    if num_requests is None:
        return requests
    return [requests[i % len(requests)] for i in range(num_requests)]


def _jsonl_request(
    line: str, path: Path, lineno: int, rng: np.random.Generator, output_len: LengthSpec
) -> BenchRequest:
    where = f"{path}:{lineno}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: malformed JSON line ({exc.msg})") from None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object")
    max_tokens = item.get("max_tokens")
    if max_tokens is None:
        max_tokens = output_len.sample(rng, 1)[0]
    check_int(f"{where}: max_tokens", max_tokens)
    if isinstance(item.get("prompt"), str):
        prompt = item["prompt"]
        return BenchRequest(max_tokens, len(prompt.split()), prompt=prompt)
    messages = item.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        num_words = sum(len(str(m.get("content", "")).split()) for m in messages)
        return BenchRequest(max_tokens, num_words, messages=tuple(messages))
    raise ValueError(f"{where}: expected a string 'prompt' or a list of 'messages'")
