"""Scheduling policies (`scheduling_policy`): the order waiting requests are admitted in, what
they are ranked by, who yields to them, and which running request is a block shortage's victim.

- `fcfs`: arrival order; a preempted request goes back to the front. Nobody yields; the victim
  is the latest admitted.
- `priority`: effective priority with aging (`core.policy`), then arrival. A running request
  of worse priority yields to a waiting one (`victims.yields_to`); the victim is the lowest
  priority, then the most blocks held, most work left, latest arrival. The admission watermark
  holds for a request's whole prompt.

Adding a policy is adding a `SchedulingPolicy` here and its name to `POLICIES`, which
`EngineConfig` validates `scheduling_policy` against; the scheduler reads only this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from batchinfer.core.policy import (
    FCFSQueue,
    PriorityQueue,
    WaitingQueue,
    effective_priority,
)
from batchinfer.core.request import INTERACTIVE_PRIORITY, Request
from batchinfer.core.scheduling import victims

# What a victim choice reads of a running request besides itself: blocks held, tokens left.
Measure = Callable[[Request], int]


class SchedulingPolicy(ABC):
    """The rules that differ between policies; everything else the scheduler does alike."""

    name: ClassVar[str]
    # The admission watermark holds for a request's whole prompt on top of what running
    # prefills still need (True), or only for its first chunk (False, as vLLM does).
    watermark_whole_prompt: ClassVar[bool]

    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s

    @abstractmethod
    def new_queue(self) -> WaitingQueue:
        """An empty waiting queue in this policy's admission order."""

    @abstractmethod
    def rank(self, request: Request, now: float) -> float:
        """What priority decisions compare (lower first); a request keeps the rank it was
        admitted with as `admitted_rank`."""

    @abstractmethod
    def aged_to_interactive(self, request: Request, now: float) -> bool:
        """Whether a waiting request ranks with interactive ones now (soft watermark exemption)."""

    @abstractmethod
    def yields_to(self, running: Request, waiting: Request) -> bool:
        """Whether a running request gives way to a waiting one: its prefill chunk is deferred,
        and it may be preempted for it."""

    @abstractmethod
    def order_running(self, running: list[Request], held: Measure, left: Measure) -> None:
        """Order the running set in place so that the next block-shortage victims come last."""

    @abstractmethod
    def choose_victim(self, candidates: list[Request], held: Measure, left: Measure) -> Request:
        """The one of `candidates` (running, in running order) to preempt first."""


class FCFSPolicy(SchedulingPolicy):
    """Arrival order; priorities are not read; the victim is the latest admitted."""

    name = "fcfs"
    watermark_whole_prompt = False

    def new_queue(self) -> WaitingQueue:
        return FCFSQueue()

    def rank(self, request: Request, now: float) -> float:
        return 0.0

    def aged_to_interactive(self, request: Request, now: float) -> bool:
        return False  # nothing ages

    def yields_to(self, running: Request, waiting: Request) -> bool:
        return False

    def order_running(self, running: list[Request], held: Measure, left: Measure) -> None:
        pass  # admission order: the latest admitted is already last

    def choose_victim(self, candidates: list[Request], held: Measure, left: Measure) -> Request:
        return candidates[-1]


class PriorityPolicy(SchedulingPolicy):
    """Effective priority with aging, then arrival; worse priorities yield and are victims."""

    name = "priority"
    watermark_whole_prompt = True

    def new_queue(self) -> WaitingQueue:
        return PriorityQueue(self.aging_s)

    def rank(self, request: Request, now: float) -> float:
        return effective_priority(request, now, self.aging_s)

    def aged_to_interactive(self, request: Request, now: float) -> bool:
        return self.rank(request, now) <= INTERACTIVE_PRIORITY

    def yields_to(self, running: Request, waiting: Request) -> bool:
        return victims.yields_to(running, waiting)

    def order_running(self, running: list[Request], held: Measure, left: Measure) -> None:
        running.sort(key=lambda r: victims.priority_victim_key(r, held(r), left(r)))

    def choose_victim(self, candidates: list[Request], held: Measure, left: Measure) -> Request:
        return max(candidates, key=lambda r: victims.priority_victim_key(r, held(r), left(r)))


POLICIES: dict[str, type[SchedulingPolicy]] = {
    policy.name: policy for policy in (FCFSPolicy, PriorityPolicy)
}


def make_policy(name: str, aging_s: float) -> SchedulingPolicy:
    """The policy `scheduling_policy` names (EngineConfig has validated it)."""
    return POLICIES[name](aging_s)
