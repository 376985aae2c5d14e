"""The dispatch decision, as a pure class: no asyncio, no clock, `now` is an argument.

`BatchQueue` holds the waiting items and answers one question: given the time `now`, which
batch (if any) should run next? The asyncio `DynamicBatcher` asks it whenever a worker is free,
so every rule below is testable with hand-made timestamps, without sleeping.

Rules, per length bucket (a batch never mixes buckets, so it is padded only to similar lengths):
- ready by size: `max_batch_size` items wait, or one more item would push the padded cost
  (longest x count) over `max_batch_tokens`;
- ready by delay: some item has waited its lane's `max_batch_delay_ms` (timed from its own
  arrival), however few items wait with it;
- a batch takes its bucket's items in priority order: lane priority lifted by aging (one level
  per `aging_ms` waited), then arrival. So the oldest item of a lane is never held back to fill
  a batch: when it is due, its batch goes, as small as it is (no head-of-line blocking).
Among ready buckets: the most urgent head item first (aged lane priority), then buckets with a
due item before merely full ones, then the shortest bucket, then the oldest head.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from batchinfer.batching.buckets import LengthBuckets
from batchinfer.batching.config import BatcherConfig
from batchinfer.core.validation import check_int

# Float slack when comparing times: arrival + delay computed in floats must still count as
# due at exactly that instant.
_EPSILON_S = 1e-9


class DispatchReason(enum.StrEnum):
    SIZE = "size"  # max_batch_size items
    TOKENS = "tokens"  # one more item would exceed max_batch_tokens
    DELAY = "delay"  # an item waited max_batch_delay_ms
    FLUSH = "flush"  # closing: everything goes


@dataclass(slots=True, eq=False)
class QueuedItem:
    """One waiting item. Times are seconds on the batcher's clock."""

    item_id: int
    payload: Any
    length: int
    lane: str
    lane_priority: int
    arrival_s: float
    due_s: float  # arrival + the lane's max_batch_delay_ms
    deadline_s: float | None  # arrival + timeout_ms; expired items never run


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A batch chosen to run, in priority order, with why it was chosen now."""

    items: tuple[QueuedItem, ...]
    reason: DispatchReason
    bucket: int

    @property
    def padded_length(self) -> int:
        return max(item.length for item in self.items)

    @property
    def num_padded_tokens(self) -> int:
        """Cost of the batch: every item padded to the longest."""
        return self.padded_length * len(self.items)

    @property
    def num_tokens(self) -> int:
        return sum(item.length for item in self.items)


class BatchQueue:
    """Waiting items and the dispatch rules. Not thread-safe; one owner (the batcher's loop)."""

    def __init__(self, config: BatcherConfig, buckets: LengthBuckets | None = None) -> None:
        self.config = config
        self.buckets = buckets or LengthBuckets(config.num_buckets, config.bucket_boundaries)
        self._items: dict[int, QueuedItem] = {}  # insertion order = arrival order
        self._next_item_id = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: int) -> bool:
        return item_id in self._items

    def has_room(self, num_items: int = 1) -> bool:
        return len(self._items) + num_items <= self.config.max_queue_size

    def push(self, payload: Any, now: float, *, length: int = 1, lane: str | None = None,
             timeout_ms: float | None = None) -> QueuedItem:
        """Enqueue one item arriving at `now`. Raises `ValueError` for a bad length or lane.

        The caller checks `has_room()` first: the queue itself never refuses for size.
        """
        check_int("length", length)
        budget = self.config.max_batch_tokens
        if budget is not None and length > budget:
            raise ValueError(f"length {length} exceeds max_batch_tokens={budget}: "
                             "this item could never be batched")
        lane_config = self.config.lane(lane)
        delay_ms = lane_config.max_batch_delay_ms
        if delay_ms is None:
            delay_ms = self.config.max_batch_delay_ms
        if timeout_ms is None:
            timeout_ms = self.config.timeout_ms
        elif isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float) \
                or not timeout_ms >= 0:
            raise ValueError(f"timeout_ms must be a number >= 0, got {timeout_ms!r}")
        item = QueuedItem(
            item_id=self._next_item_id, payload=payload, length=length, lane=lane_config.name,
            lane_priority=lane_config.priority, arrival_s=now, due_s=now + delay_ms / 1e3,
            deadline_s=None if timeout_ms is None else now + timeout_ms / 1e3,
        )
        self._next_item_id += 1
        self._items[item.item_id] = item
        self.buckets.observe(length)
        return item

    def remove(self, item_id: int) -> QueuedItem | None:
        """Take a waiting item out (cancellation); `None` if it is not waiting any more."""
        return self._items.pop(item_id, None)

    def pop_expired(self, now: float) -> list[QueuedItem]:
        """Remove and return the items whose deadline has passed; they must not run."""
        expired = [it for it in self._items.values()
                   if it.deadline_s is not None and it.deadline_s <= now + _EPSILON_S]
        for item in expired:
            del self._items[item.item_id]
        return expired

    def pop_batch(self, now: float, *, flush: bool = False) -> Dispatch | None:
        """Remove and return the batch to run at `now`, or `None` if no bucket is ready.

        `flush=True` treats every item as due (closing). Expire items first (`pop_expired`).
        """
        groups: dict[int, list[QueuedItem]] = {}
        for item in self._items.values():
            groups.setdefault(self.buckets.index(item.length), []).append(item)
        best: tuple[tuple[float, int, int, float], Dispatch] | None = None
        for bucket, items in groups.items():
            items.sort(key=lambda it: (self.effective_priority(it, now), it.arrival_s))
            chosen, full_reason = self._fill(items)
            due = flush or any(it.due_s <= now + _EPSILON_S for it in items)
            if full_reason is None and not due:
                continue
            reason = full_reason or (DispatchReason.FLUSH if flush else DispatchReason.DELAY)
            head = chosen[0]
            key = (self.effective_priority(head, now), 0 if due else 1, bucket, head.arrival_s)
            if best is None or key < best[0]:
                best = (key, Dispatch(tuple(chosen), reason, bucket))
        if best is None:
            return None
        for item in best[1].items:
            del self._items[item.item_id]
        return best[1]

    def next_due_s(self) -> float | None:
        """Earliest time an item becomes due by delay (`None`: queue empty)."""
        return min((it.due_s for it in self._items.values()), default=None)

    def next_deadline_s(self) -> float | None:
        """Earliest timeout among waiting items (`None`: none has one)."""
        return min((it.deadline_s for it in self._items.values() if it.deadline_s is not None),
                   default=None)

    def effective_priority(self, item: QueuedItem, now: float) -> int:
        """Lane priority minus one level per `aging_ms` waited: old items overtake any lane."""
        waited_ms = max(0.0, now - item.arrival_s) * 1e3
        return item.lane_priority - math.floor(waited_ms / self.config.aging_ms)

    def _fill(self, items: list[QueuedItem]) -> tuple[list[QueuedItem], DispatchReason | None]:
        """Take `items` in order up to the limits; the reason is set when a limit was hit."""
        max_size, budget = self.config.max_batch_size, self.config.max_batch_tokens
        chosen: list[QueuedItem] = []
        longest = 0
        for item in items:
            if len(chosen) == max_size:
                return chosen, DispatchReason.SIZE
            padded_with_item = max(longest, item.length) * (len(chosen) + 1)
            if budget is not None and chosen and padded_with_item > budget:
                return chosen, DispatchReason.TOKENS
            chosen.append(item)
            longest = max(longest, item.length)
        if len(chosen) == max_size:
            return chosen, DispatchReason.SIZE
        if budget is not None and longest * (len(chosen) + 1) > budget:
            return chosen, DispatchReason.TOKENS
        return chosen, None
