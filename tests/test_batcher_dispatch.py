"""Dispatch rules of the pure `BatchQueue`, driven with hand-made timestamps (no sleeping)."""

from __future__ import annotations

import pytest

from batchinfer.batching.buckets import LengthBuckets, quantile_boundaries
from batchinfer.batching.config import BatcherConfig, LaneConfig
from batchinfer.batching.policy import BatchQueue, DispatchReason


def make_queue(**kwargs: object) -> BatchQueue:
    kwargs.setdefault("num_buckets", 1)
    return BatchQueue(BatcherConfig(**kwargs))  # type: ignore[arg-type]


def ms(value: float) -> float:
    return value / 1e3


def test_size_dispatches_immediately_when_full() -> None:
    q = make_queue(max_batch_size=4, max_batch_delay_ms=10)
    for i in range(3):
        q.push(i, now=ms(i))
    assert q.pop_batch(now=ms(3)) is None  # 3 of 4, nobody due yet
    q.push(3, now=ms(3))
    d = q.pop_batch(now=ms(3))
    assert d is not None and d.reason is DispatchReason.SIZE
    assert [it.payload for it in d.items] == [0, 1, 2, 3]
    assert len(q) == 0


def test_size_takes_oldest_first_and_leaves_the_rest() -> None:
    q = make_queue(max_batch_size=4, max_batch_delay_ms=10)
    for i in range(6):
        q.push(i, now=ms(i))
    d = q.pop_batch(now=ms(6))
    assert [it.payload for it in d.items] == [0, 1, 2, 3]
    assert q.pop_batch(now=ms(6)) is None  # 2 left, oldest (item 4) due at 14 ms
    d = q.pop_batch(now=ms(14))
    assert [it.payload for it in d.items] == [4, 5] and d.reason is DispatchReason.DELAY


def test_delay_is_timed_from_the_oldest_item_arrival() -> None:
    q = make_queue(max_batch_size=32, max_batch_delay_ms=5)
    q.push("a", now=ms(100))
    q.push("b", now=ms(104))
    assert q.next_due_s() == pytest.approx(ms(105))
    assert q.pop_batch(now=ms(104.999)) is None
    d = q.pop_batch(now=ms(105))  # exactly 5 ms after "a" arrived, not after "b"
    assert d is not None and d.reason is DispatchReason.DELAY
    assert [it.payload for it in d.items] == ["a", "b"]


def test_zero_delay_dispatches_on_arrival() -> None:
    q = make_queue(max_batch_delay_ms=0)
    q.push("a", now=1.0)
    assert [it.payload for it in q.pop_batch(now=1.0).items] == ["a"]


def test_token_budget_dispatches_before_it_would_be_exceeded() -> None:
    q = make_queue(max_batch_size=32, max_batch_delay_ms=50, max_batch_tokens=100)
    q.push("a", now=0.0, length=20)
    q.push("b", now=0.0, length=25)
    q.push("c", now=0.0, length=20)  # 3 x 25 = 75; a 4th needs >= 4 x 25 = 100: still fits
    assert q.pop_batch(now=0.0) is None
    q.push("d", now=0.0, length=30)  # 4 x 30 = 120 > 100: d waits, a b c go (3 x 25 = 75)
    d = q.pop_batch(now=0.0)
    assert d is not None and d.reason is DispatchReason.TOKENS
    assert [it.payload for it in d.items] == ["a", "b", "c"]
    assert d.num_padded_tokens == 75 and d.num_tokens == 65
    assert [it.payload for it in q.pop_batch(now=ms(50)).items] == ["d"]


def test_token_budget_full_when_no_further_item_could_fit() -> None:
    q = make_queue(max_batch_size=32, max_batch_delay_ms=50, max_batch_tokens=100)
    q.push("a", now=0.0, length=40)
    q.push("b", now=0.0, length=50)  # 2 x 50 = 100: a third item can never fit
    d = q.pop_batch(now=0.0)
    assert d is not None and d.reason is DispatchReason.TOKENS and len(d.items) == 2


def test_item_longer_than_token_budget_is_refused() -> None:
    q = make_queue(max_batch_tokens=64)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        q.push("x", now=0.0, length=65)


def test_no_head_of_line_blocking_oldest_goes_when_due_even_if_small() -> None:
    # A long item arrives first; a stream of short ones fills the short bucket.
    q = BatchQueue(BatcherConfig(max_batch_size=4, max_batch_delay_ms=5,
                                 bucket_boundaries=(32,)))
    q.push("long", now=0.0, length=200)
    for i in range(4):
        q.push(f"s{i}", now=ms(1 + i / 10), length=8)
    full = q.pop_batch(now=ms(1.5))
    assert full.reason is DispatchReason.SIZE and "long" not in [it.payload for it in full.items]
    for i in range(3):
        q.push(f"t{i}", now=ms(4), length=8)
    # At 5 ms the long item is due: it goes now, alone, ahead of the newer short items.
    d = q.pop_batch(now=ms(5))
    assert [it.payload for it in d.items] == ["long"] and d.reason is DispatchReason.DELAY


def test_oldest_item_is_in_the_batch_when_its_bucket_overflows() -> None:
    q = make_queue(max_batch_size=2, max_batch_delay_ms=5)
    q.push("old", now=0.0)
    for i in range(5):
        q.push(i, now=ms(4.9))
    d = q.pop_batch(now=ms(5))
    assert [it.payload for it in d.items] == ["old", 0]


def test_due_buckets_go_shortest_first() -> None:
    q = BatchQueue(BatcherConfig(max_batch_delay_ms=5, bucket_boundaries=(16, 64)))
    q.push("long", now=0.0, length=100)
    q.push("mid", now=ms(0.5), length=40)
    q.push("short", now=ms(1), length=4)
    order = [q.pop_batch(now=ms(10)).items[0].payload for _ in range(3)]
    assert order == ["short", "mid", "long"]


def test_batches_never_mix_buckets_and_pad_to_own_longest() -> None:
    q = BatchQueue(BatcherConfig(max_batch_delay_ms=0, bucket_boundaries=(16,)))
    for length in (3, 100, 5, 90):
        q.push(length, now=0.0, length=length)
    first, second = q.pop_batch(now=0.0), q.pop_batch(now=0.0)
    assert sorted(it.length for it in first.items) == [3, 5] and first.padded_length == 5
    assert sorted(it.length for it in second.items) == [90, 100] and second.padded_length == 100


def test_lane_priority_and_aging_prevents_starvation() -> None:
    lanes = (LaneConfig("interactive", 0), LaneConfig("batch", 1))
    q = make_queue(max_batch_size=1, max_batch_delay_ms=0, aging_ms=100, lanes=lanes)
    q.push("bulk", now=0.0, lane="batch")
    q.push("chat1", now=ms(50), lane="interactive")
    # Same aged level? bulk: 1 - floor(60/100) = 1; chat1: 0 -> interactive first.
    assert q.pop_batch(now=ms(60)).items[0].payload == "chat1"
    q.push("chat2", now=ms(150), lane="interactive")
    # At 200 ms bulk has aged 2 levels (1 - 2 = -1) and overtakes a fresh interactive item.
    assert q.pop_batch(now=ms(200)).items[0].payload == "bulk"
    assert q.pop_batch(now=ms(200)).items[0].payload == "chat2"


def test_interactive_items_fill_the_batch_before_bulk_ones() -> None:
    q = make_queue(max_batch_size=2, max_batch_delay_ms=5, aging_ms=1000)
    q.push("b1", now=0.0, lane="batch")
    q.push("b2", now=0.0, lane="batch")
    q.push("i1", now=ms(1), lane="interactive")
    d = q.pop_batch(now=ms(1))
    assert [it.payload for it in d.items] == ["i1", "b1"]


def test_lane_with_its_own_delay() -> None:
    lanes = (LaneConfig("interactive", 0, max_batch_delay_ms=2),
             LaneConfig("batch", 1, max_batch_delay_ms=50))
    q = make_queue(lanes=lanes)
    q.push("bulk", now=0.0, lane="batch")
    assert q.pop_batch(now=ms(10)) is None
    q.push("chat", now=ms(10), lane="interactive")
    d = q.pop_batch(now=ms(12))
    assert [it.payload for it in d.items] == ["chat", "bulk"]  # bulk rides along for free


def test_unknown_lane_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="lane"):
        make_queue().push("x", now=0.0, lane="nope")


def test_expired_items_are_removed_and_never_dispatched() -> None:
    q = make_queue(max_batch_delay_ms=10)
    q.push("short-lived", now=0.0, timeout_ms=3)
    q.push("patient", now=0.0)
    assert q.next_deadline_s() == pytest.approx(ms(3))
    assert q.pop_expired(now=ms(2)) == []
    assert [it.payload for it in q.pop_expired(now=ms(3))] == ["short-lived"]
    assert [it.payload for it in q.pop_batch(now=ms(10)).items] == ["patient"]


def test_remove_cancels_a_waiting_item() -> None:
    q = make_queue(max_batch_delay_ms=0)
    a = q.push("a", now=0.0)
    q.push("b", now=0.0)
    assert q.remove(a.item_id) is a and q.remove(a.item_id) is None
    assert [it.payload for it in q.pop_batch(now=0.0).items] == ["b"]


def test_queue_room_and_flush() -> None:
    q = make_queue(max_queue_size=2, max_batch_delay_ms=1000)
    assert q.has_room(2) and not q.has_room(3)
    q.push("a", now=0.0)
    q.push("b", now=0.0)
    assert not q.has_room(1)
    d = q.pop_batch(now=0.0, flush=True)
    assert d.reason is DispatchReason.FLUSH and len(d.items) == 2


def test_learned_buckets_follow_the_length_distribution() -> None:
    buckets = LengthBuckets(num_buckets=4, min_observations=8, relearn_every=8)
    assert buckets.boundaries == (16, 32, 64)  # before learning
    for length in [10] * 10 + [100] * 10 + [200] * 10 + [300] * 10:
        buckets.observe(length)
    assert buckets.boundaries == (10, 100, 200)
    assert [buckets.index(n) for n in (5, 10, 11, 150, 250, 999)] == [0, 0, 1, 2, 3, 3]


def test_quantile_boundaries_collapse_duplicates() -> None:
    assert quantile_boundaries([7] * 50, 4) == ()
    assert quantile_boundaries(list(range(1, 101)), 4) == (25, 50, 75)


def test_given_boundaries_are_fixed() -> None:
    buckets = LengthBuckets(boundaries=(8, 64))
    for _ in range(1000):
        buckets.observe(500)
    assert buckets.boundaries == (8, 64) and len(buckets) == 3


@pytest.mark.parametrize("field,value", [
    ("max_batch_size", 0), ("max_batch_delay_ms", -1), ("max_batch_tokens", 0),
    ("max_queue_size", 0), ("num_buckets", 0), ("bucket_boundaries", (64, 8)),
    ("aging_ms", 0), ("timeout_ms", -5), ("max_concurrent_batches", 0),
])
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        BatcherConfig(**{field: value})  # type: ignore[arg-type]
