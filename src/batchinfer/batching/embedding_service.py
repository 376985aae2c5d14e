"""`EmbeddingService`: an `Encoder` behind a `DynamicBatcher`, plus the offline embed path.

The HTTP layer parses a request and calls `await service.embed(...)`; the CLI's `embed`
command calls `embed_offline(...)`. Both validate input the same way (`InputError` naming
`input`), both batch by length so padding stays small, both return vectors in input order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from batchinfer.batching.batcher import DynamicBatcher
from batchinfer.batching.config import BatcherConfig
from batchinfer.batching.errors import InputError
from batchinfer.batching.metrics import BatcherMetrics
from batchinfer.batching.offline import iter_batched_map
from batchinfer.core.validation import check_int

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from batchinfer.models.encoder import Encoder

EmbeddingInput = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]

# Online defaults for an encoder: a full batch of max-length (256-token) items fits the budget,
# and the queue holds a few maximal requests (max_client_batch_size inputs each).
ENCODER_BATCHER_CONFIG = BatcherConfig(max_batch_size=32, max_batch_delay_ms=5.0,
                                       max_batch_tokens=8192, max_queue_size=8192)


@dataclass(frozen=True)
class EmbeddingConfig:
    """The encoder and the request limits of an embedding service. `batchinfer embed` takes
    `--model`, `--dtype`, `--device`, `--max-length` and `--quantization` under these names;
    `batchinfer serve` takes `--embedding-model` and `--embedding-quantization`."""

    model: str = field(default="default", metadata={
        "help": "'default' (embedded all-MiniLM-L6-v2), a local Hugging Face folder or "
                "a hub id (org/name)"})
    dtype: str = field(default="auto", metadata={
        "help": "auto (bfloat16 where the hardware has fast bf16, else float32), float32, "
                "bfloat16"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if present), cpu, cuda"})
    max_length: int | None = field(default=None, metadata={
        "help": "longest input in tokens; default: the model's (256 for all-MiniLM-L6-v2)"})
    quantization: str = field(default="none", metadata={
        "help": "none, int8 (per output channel), q8 (8-bit in groups of 32, native CPU "
                "kernels); either kept only where the probe sentences' vectors stay within "
                "cosine 0.999 of the float ones, else float with a warning"})
    max_client_batch_size: int = field(default=2048, metadata={
        "help": "most inputs in one /v1/embeddings request"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model name in the API; default: the model's name"})

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        check_int("max_client_batch_size", self.max_client_batch_size)

    def load_encoder(self) -> Encoder:
        from batchinfer.models.encoder import Encoder

        return Encoder(self.model, dtype=self.dtype, device=self.device,
                       max_length=self.max_length, quantization=self.quantization)


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    vectors: list[np.ndarray]  # one float32 [dim] row per input, in input order
    num_tokens: int  # tokens fed to the model, special tokens included


class EmbeddingService:
    """Owns the encoder and its `DynamicBatcher`; one per served embedding model."""

    def __init__(self, encoder: Encoder, config: EmbeddingConfig | None = None,
                 batcher_config: BatcherConfig | None = None, *,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.encoder = encoder
        self.config = config or EmbeddingConfig()
        self.model_name = self.config.served_model_name or encoder.name
        self.model_aliases = {self.model_name, encoder.name, self.config.model,
                              f"sentence-transformers/{encoder.name}"}
        self.metrics = BatcherMetrics(registry) if registry is not None else None
        self.batcher: DynamicBatcher[list[int], np.ndarray] = DynamicBatcher(
            self._run_batch, batcher_config or ENCODER_BATCHER_CONFIG,
            length_fn=len, clock=clock, metrics=self.metrics, name="embeddings")

    @classmethod
    def load(cls, config: EmbeddingConfig | None = None,
             batcher_config: BatcherConfig | None = None, *,
             registry: CollectorRegistry | None = None) -> EmbeddingService:
        """Load the encoder named by `config.model` and wrap it."""
        config = config or EmbeddingConfig()
        return cls(config.load_encoder(), config, batcher_config, registry=registry)

    def _run_batch(self, batch: list[list[int]]) -> list[np.ndarray]:
        return list(self.encoder.encode_ids(batch).numpy())

    def prepare(self, inputs: EmbeddingInput, *, truncate: bool = False) -> list[list[int]]:
        """Validate and tokenize: model input ids (special tokens added), in input order.

        Raises `InputError` (a `ValueError`) with `param="input"`."""
        kind, items = classify_input(inputs)
        limit = self.config.max_client_batch_size
        if len(items) > limit:
            raise _bad_input(f"input has {len(items)} items, more than "
                                      f"max_client_batch_size={limit}")
        try:
            if kind == "text":
                return self.encoder.tokenize(items, truncate=truncate)
            return self.encoder.add_special_tokens(items, truncate=truncate)
        except ValueError as exc:
            raise _bad_input(str(exc)) from None

    async def embed(self, inputs: EmbeddingInput, *, truncate: bool = False,
                    lane: str | None = None, timeout_ms: float | None = None) -> EmbeddingResult:
        """Embed one request's inputs through the shared batcher; vectors in input order."""
        try:
            self.batcher.config.lane(lane)
        except ValueError as exc:
            raise InputError(str(exc), param="lane") from None
        ids_list = await asyncio.to_thread(self.prepare, inputs, truncate=truncate)
        if len(ids_list) > self.batcher.config.max_queue_size:
            # Could never be admitted: a client error, not a retryable 429.
            raise _bad_input(f"input has {len(ids_list)} items, more than the queue holds "
                             f"(max_queue_size={self.batcher.config.max_queue_size})")
        vectors = await self.batcher.submit_many(ids_list, lane=lane, timeout_ms=timeout_ms,
                                                 lengths=[len(ids) for ids in ids_list])
        return EmbeddingResult(vectors, sum(len(ids) for ids in ids_list))

    async def close(self) -> None:
        await self.batcher.close()


def classify_input(inputs: Any) -> tuple[str, list[Any]]:
    """OpenAI's `input` forms -> ("text", [str, ...]) or ("ids", [[int, ...], ...]).

    `ValueError` (`InputError`, param `input`) for empty lists, empty strings, wrong types."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, bytes):
        raise _bad_input("input must be a string, a list of strings, a list of token "
                                  f"ids or a list of token id lists; got {type(inputs).__name__}")
    items = list(inputs)
    if not items:
        raise _bad_input("input must not be empty")
    if all(isinstance(x, str) for x in items):
        empty = next((i for i, x in enumerate(items) if not x), None)
        if empty is not None:
            raise _bad_input(f"input[{empty}] is an empty string")
        return "text", items
    if all(_is_int(x) for x in items):
        return "ids", [items]
    if all(isinstance(x, Sequence) and not isinstance(x, str) for x in items):
        for i, ids in enumerate(items):
            if not ids:
                raise _bad_input(f"input[{i}] is an empty token id list")
            if not all(_is_int(t) for t in ids):
                raise _bad_input(f"input[{i}] must be a list of integer token ids")
        return "ids", [list(ids) for ids in items]
    raise _bad_input("input must be a string, a list of strings, a list of token ids "
                              "or a list of token id lists (not a mix)")


def _bad_input(message: str) -> InputError:
    return InputError(message, param="input")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def embed_offline(encoder: Encoder, texts: Iterable[str], *, batch_size: int = 32,
                  max_batch_tokens: int | None = 8192, sort_window: int | None = None,
                  truncate: bool = False, progress: bool = False,
                  num_workers: int = 1) -> Iterator[np.ndarray]:
    """Offline embedding: tokenize, sort by length inside each window, batch under a token
    budget, yield float32 vectors in input order (streams window by window). `num_workers`
    batches run at once (see `batched_map`)."""
    window = sort_window or 64 * batch_size
    text_iter = iter(texts)
    offset = 0

    def chunks() -> Iterator[list[int]]:
        nonlocal offset
        while batch := _take(text_iter, window, offset):
            try:
                ids_list = encoder.tokenize(batch, truncate=truncate)
            except ValueError as exc:
                raise _bad_input(_shift_index(str(exc), offset)) from None
            offset += len(batch)
            yield from ids_list

    def run(batch: list[list[int]]) -> list[np.ndarray]:
        return list(encoder.encode_ids(batch).numpy())

    yield from iter_batched_map(run, chunks(), batch_size, max_batch_tokens=max_batch_tokens,
                                length_fn=len, sort_window=window, progress=progress,
                                desc="embed", num_workers=num_workers)  # type: ignore[misc]


def _take(iterator: Iterator[str], count: int, offset: int) -> list[str]:
    out: list[str] = []
    for text in iterator:
        if not isinstance(text, str) or not text:
            raise _bad_input(f"input[{offset + len(out)}] must be a non-empty string, "
                                      f"got {text!r}")
        out.append(text)
        if len(out) == count:
            break
    return out


def _shift_index(message: str, offset: int) -> str:
    """Make `input[i]` in an encoder message count from the start of the whole input."""
    if offset and message.startswith("input["):
        index, rest = message[6:].split("]", 1)
        return f"input[{int(index) + offset}]{rest}"
    return message
