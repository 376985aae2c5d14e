"""Batcher knobs: frozen, validated at construction (`ValueError` naming the field)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchinfer.core.validation import check_int, check_non_negative


@dataclass(frozen=True, slots=True)
class LaneConfig:
    """A priority lane. Lower `priority` goes first; aging lifts a waiting item one level per
    `BatcherConfig.aging_ms`, so no lane starves. `max_batch_delay_ms=None` uses the batcher's."""

    name: str
    priority: int = 0
    max_batch_delay_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"lane name must be a non-empty string, got {self.name!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"lane {self.name!r}: priority must be an integer")
        if self.max_batch_delay_ms is not None:
            check_non_negative(f"lane {self.name!r}: max_batch_delay_ms", self.max_batch_delay_ms)


DEFAULT_LANES = (LaneConfig("interactive", priority=0), LaneConfig("batch", priority=1))


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    """All knobs of a `DynamicBatcher`; each is also a keyword argument of it and of `@batch`.

    No CLI flag sets them: `batchinfer serve --embedding-model` runs with
    `embedding_service.ENCODER_BATCHER_CONFIG`."""

    max_batch_size: int = field(default=32, metadata={"help": "most items in one batch"})
    max_batch_delay_ms: float = field(default=5.0, metadata={
        "help": "dispatch once the oldest waiting item has waited this long"})
    max_batch_tokens: int | None = field(default=None, metadata={
        "help": "padded cost budget of one batch (longest item x count); none: no budget"})
    max_queue_size: int = field(default=1024, metadata={
        "help": "waiting items before new ones are refused (HTTP 429)"})
    num_buckets: int = field(default=4, metadata={
        "help": "length buckets learned from the observed lengths (1 disables bucketing)"})
    bucket_boundaries: tuple[int, ...] | None = field(default=None, metadata={
        "help": "fixed bucket upper bounds, e.g. 32,64,128 (overrides num_buckets)"})
    lanes: tuple[LaneConfig, ...] = DEFAULT_LANES
    aging_ms: float = field(default=100.0, metadata={
        "help": "a waiting item gains one priority level per aging_ms (no lane starves)"})
    timeout_ms: float | None = field(default=None, metadata={
        "help": "default per-item queue timeout; expired items fail and never run"})
    max_concurrent_batches: int = field(default=1, metadata={
        "help": "batches running at once (1 for one CPU model)"})
    isolate_failures: bool = field(default=True, metadata={
        "help": "bisect a failing batch so only the failing items get the error"})

    def __post_init__(self) -> None:
        check_int("max_batch_size", self.max_batch_size)
        check_non_negative("max_batch_delay_ms", self.max_batch_delay_ms)
        if self.max_batch_tokens is not None:
            check_int("max_batch_tokens", self.max_batch_tokens)
        check_int("max_queue_size", self.max_queue_size)
        check_int("num_buckets", self.num_buckets)
        if self.bucket_boundaries is not None:
            bounds = self.bucket_boundaries
            if not isinstance(bounds, tuple) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in bounds
            ) or list(bounds) != sorted(set(bounds)):
                raise ValueError(
                    f"bucket_boundaries must be a tuple of increasing positive integers, "
                    f"got {bounds!r}")
        if not self.lanes or not all(isinstance(lane, LaneConfig) for lane in self.lanes):
            raise ValueError("lanes must be a non-empty tuple of LaneConfig")
        names = [lane.name for lane in self.lanes]
        if len(set(names)) != len(names):
            raise ValueError(f"lanes must have distinct names, got {names}")
        if isinstance(self.aging_ms, bool) or not isinstance(self.aging_ms, int | float) \
                or self.aging_ms <= 0:
            raise ValueError(f"aging_ms must be > 0, got {self.aging_ms!r}")
        if self.timeout_ms is not None:
            check_non_negative("timeout_ms", self.timeout_ms)
        check_int("max_concurrent_batches", self.max_concurrent_batches)

    @property
    def default_lane(self) -> str:
        """The lane of items submitted without one: the first lane."""
        return self.lanes[0].name

    def lane(self, name: str | None) -> LaneConfig:
        """The lane called `name` (`None`: the default lane); `ValueError` if unknown."""
        if name is None:
            return self.lanes[0]
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise ValueError(f"lane must be one of {', '.join(x.name for x in self.lanes)}; "
                         f"got {name!r}")
