"""Length buckets: items of similar length are batched together so padding stays small."""

from __future__ import annotations

from bisect import bisect_left
from collections import deque

from batchinfer.core.validation import check_int


class LengthBuckets:
    """Map an item length to a bucket index (0 = shortest).

    Bucket `i` holds lengths in `(boundaries[i-1], boundaries[i]]`; the last bucket is open.
    With `boundaries` given they are fixed. Otherwise they are learned: every `relearn_every`
    observations the boundaries become the equal-count quantiles of the last `window` observed
    lengths, so each bucket receives about the same share of the traffic. Until
    `min_observations` lengths are seen, powers of two from 16 are used.
    """

    def __init__(
        self,
        num_buckets: int = 4,
        boundaries: tuple[int, ...] | None = None,
        *,
        window: int = 2048,
        relearn_every: int = 256,
        min_observations: int = 64,
    ) -> None:
        self.num_buckets = check_int("num_buckets", num_buckets)
        self.learned = boundaries is None
        self._lengths: deque[int] = deque(maxlen=window)
        self._relearn_every = relearn_every
        self._min_observations = min_observations
        self._num_since_learn = 0
        if boundaries is None:
            boundaries = tuple(16 << k for k in range(num_buckets - 1))
        self.boundaries: tuple[int, ...] = tuple(boundaries)

    def __len__(self) -> int:
        return len(self.boundaries) + 1

    def index(self, length: int) -> int:
        """Bucket of an item of `length` tokens."""
        return bisect_left(self.boundaries, length)

    def observe(self, length: int) -> None:
        """Record one arrival's length; relearn the boundaries when it is time."""
        if not self.learned or self.num_buckets == 1:
            return
        self._lengths.append(length)
        self._num_since_learn += 1
        enough = len(self._lengths) >= self._min_observations
        if enough and (self._num_since_learn >= self._relearn_every
                       or len(self._lengths) == self._min_observations):
            self.boundaries = quantile_boundaries(list(self._lengths), self.num_buckets)
            self._num_since_learn = 0


def quantile_boundaries(lengths: list[int], num_buckets: int) -> tuple[int, ...]:
    """Upper bounds splitting `lengths` into `num_buckets` groups of about equal count.

    Duplicates collapse, so a narrow distribution yields fewer buckets, never empty ones.
    """
    ordered = sorted(lengths)
    bounds: list[int] = []
    for k in range(1, num_buckets):
        bound = ordered[-(-k * len(ordered) // num_buckets) - 1]  # ceil(k n / b) - 1
        if bound < ordered[-1] and (not bounds or bound > bounds[-1]):
            bounds.append(bound)
    return tuple(bounds)
