"""Deferral of prefill chunks: a running request that yields to the best waiting request (by
the policy: under `priority`, one of worse base priority not aged to the waiting one's level)
has its next prefill chunk deferred until waiting requests are admitted, so a long batch prompt
being prefilled never delays an interactive request's first token by more than one step.
Decodes are never deferred; fcfs defers nothing (nobody yields)."""

from __future__ import annotations

from batchinfer.core.policy import WaitingQueue
from batchinfer.core.request import Request
from batchinfer.core.scheduling.policies import SchedulingPolicy


def deferral_target(waiting: WaitingQueue, continuous: bool) -> Request | None:
    """The waiting request prefill chunks may be deferred for: the first in policy order, and
    only in the continuous form (the others admit nothing while requests run)."""
    return waiting.first() if continuous and waiting else None


def is_deferred(request: Request, target: Request | None, policy: SchedulingPolicy) -> bool:
    """Whether a running request's chunk waits for `target`: it is a prefill chunk (more than
    one token left to compute) and the request yields to `target`."""
    remaining = request.num_tokens - request.num_computed_tokens
    return target is not None and remaining > 1 and policy.yields_to(request, target)
