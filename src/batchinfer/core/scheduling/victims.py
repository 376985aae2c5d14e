"""Who gives way: when a running request yields to a waiting one, which running request is the
victim, and when preempting for a waiting request is worth doing at all.

- **Yielding** (`yields_to`, the priority policy): a running request gives way to a waiting one
  when its base priority is higher (worse) and it was not admitted at the waiting one's level by
  aging. Requests of one priority never yield to each other, so nothing ping-pongs.
- **Victim order** (`priority_victim_key`): larger is preempted sooner: the lowest priority,
  then the most blocks held (one preemption frees the most), the most work left, the latest
  arrival.
- **Room** (`preempting_makes_room`): a waiting request preempts only if preempting every
  request that yields to it would make room under the admission rules: nobody is preempted for
  nothing.
"""

from __future__ import annotations

from batchinfer.core.request import Request


def yields_to(running: Request, waiting: Request) -> bool:
    """Whether a running request gives way to a waiting one (its prefill chunk is deferred;
    under block pressure it may be preempted): it has a higher base priority, and it was
    not admitted at the waiting one's level by aging (that one keeps its place)."""
    return running.priority > waiting.priority and running.admitted_rank > waiting.priority


def priority_victim_key(
    request: Request, num_blocks_held: int, num_tokens_left: int
) -> tuple[int, int, int, float]:
    """Larger = preempted sooner: lowest priority, then most blocks held, most work left,
    latest arrival."""
    return (request.priority, num_blocks_held, num_tokens_left, request.arrival_s)


def preempting_makes_room(
    *,
    take: int,
    whole: int,
    committed: int,
    num_free_blocks: int,
    num_freed: int,
    num_pending: int,
    limit: float,
    all_yield: bool,
) -> bool:
    """Whether preempting all the running requests that yield to a waiting one would let it in:
    its first chunk (`take` blocks) fits in the free blocks plus the `num_freed` blocks only they
    hold, and unless they are all that runs (then the machine empties, and an empty machine
    admits anything) its `whole` context on top of the `committed` blocks, less theirs (held
    and `num_pending`, still needed), stays under the admission watermark (`limit` blocks)."""
    if take > num_free_blocks + num_freed:
        return False
    return all_yield or committed - num_freed - num_pending + whole <= limit
