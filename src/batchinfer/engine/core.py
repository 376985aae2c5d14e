"""`EngineCore`: the scheduler and the runner, and the only thing that touches them.

It runs on one thread (the caller's for `LLM.generate`, the engine thread behind `AsyncLLM`).
What it hands out are plain `EngineCoreOutput`s and `SchedulerStats`: no live `Request` leaves
it, so a consumer on another thread never reads state the engine is changing.

Failure isolation lives here and only here: when the runner raises on a step, the exception is
logged once with its traceback, each sequence of the step is rerun alone, and only the ones that
fail again are finished (with `error` set); the rest of the batch goes on as if nothing happened.
When every sequence of a step of several fails alone too, the fault is not the requests' (out of
memory, a broken device): `EngineStepError` is raised, which stops the engine rather than fail
every request that comes, one by one, forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import (
    ENGINE_ERROR,
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from batchinfer.core.preemption import PreemptionCosts
from batchinfer.core.request import Request, RequestStatus
from batchinfer.core.scheduling.scheduler import Scheduler
from batchinfer.core.scheduling.spec_depth import StepCosts

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """Every sequence of a step failed, alone as well as together: the engine cannot go on."""


class Runner(Protocol):
    """What the engine needs of a model runner (`runner.ModelRunner`, or a fake in tests)."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def swap_blocks(
        self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]
    ) -> None:
        """Copy (device, host) block pairs out to the swap space, then (host, device) in."""
        ...


class EngineCore:
    """`add_requests`, `finish`, `step`; everything else is read-only state for stats."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        num_blocks: int,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        num_swap_blocks: int = 0,
        preemption_costs: PreemptionCosts | None = None,
        step_costs: StepCosts | None = None,
        kv_window: int | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.clock = clock
        self.scheduler = Scheduler(config, num_blocks, max_model_len, clock, num_swap_blocks,
                                   preemption_costs, step_costs, kv_window)
        self.last_scheduler_output: SchedulerOutput | None = None
        self.swap_time_s = 0.0  # spent copying blocks to and from the swap space

    # ----------------------------------------------------------------- requests in and out
    def add_requests(self, requests: list[Request]) -> None:
        """Queue the sequences of one request, all or none: `ValueError` (a prompt that can
        never fit, a duplicate id) leaves nothing queued."""
        added: list[str] = []
        try:
            for request in requests:
                self.scheduler.add_request(request)
                added.append(request.request_id)
        except ValueError:
            self.finish(added, RequestStatus.FINISHED_ABORTED)
            raise

    def finish(
        self,
        request_ids: Iterable[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
        stop_reason: str | None = None,
    ) -> None:
        """End sequences wherever they are (abort, stop string): their KV blocks are free
        before the next step. Unknown or finished ids are ignored."""
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, status, stop_reason)

    def abort(self, request_ids: Iterable[str]) -> None:
        self.finish(request_ids, RequestStatus.FINISHED_ABORTED)

    def close_input(self, closed: bool = True) -> None:
        """No more requests are coming (True): the static form may run a partial last batch."""
        self.scheduler.input_closed = closed

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    def next_dispatch_s(self) -> float | None:
        """When something changes for a caller with nothing to run (a dynamic batch becomes
        due, a queue time limit runs out)."""
        return self.scheduler.next_dispatch_s()

    def stats(self) -> SchedulerStats:
        """The scheduler's state after the last step (`last_scheduler_output`)."""
        stats = self.scheduler.stats(self.last_scheduler_output)
        stats.swap_time_s = self.swap_time_s
        return stats

    # ----------------------------------------------------------------- the step
    def step(self) -> list[EngineCoreOutput]:
        """Run one iteration; returns an output per sequence that gained a token or failed."""
        scheduler_output = self.scheduler.schedule()
        self.last_scheduler_output = scheduler_output
        ended = self.scheduler.take_ended()  # queue timeouts found while scheduling
        if scheduler_output.has_swaps:
            # Before the step: swapped-out blocks may be written by it once copied.
            start_s = time.perf_counter()
            self.runner.swap_blocks(scheduler_output.blocks_to_swap_out,
                                    scheduler_output.blocks_to_swap_in)
            self.swap_time_s += time.perf_counter() - start_s
            self.scheduler.swaps_done()
        if scheduler_output.is_empty:
            return ended
        runner_output, failed = self._execute(scheduler_output)
        outputs = ended + self.scheduler.update_from_output(scheduler_output, runner_output,
                                                            failed)
        for request_id, message in failed.items():
            output = self.scheduler.finish_request(
                request_id, RequestStatus.FINISHED_ABORTED, error=message, error_code=ENGINE_ERROR
            )
            if output is not None:
                outputs.append(output)
        return outputs

    def _execute(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[ModelRunnerOutput, dict[str, str]]:
        """Run the step; if the runner raises, rerun each sequence alone once, so that only the
        ones that fail again are failed. Returns the output and the failed ids -> messages."""
        try:
            return self.runner.execute(scheduler_output), {}
        except Exception:  # one request's failure must not stop the engine
            logger.exception(
                "a step of %d sequences failed; rerunning each alone",
                len(scheduler_output.sequences),
            )
        sampled: list[int | None] = []
        logprobs: list[TokenLogprobs | None] = []
        accepted: list[list[int]] = []
        accepted_logprobs: list[list[TokenLogprobs]] = []
        failed: dict[str, str] = {}
        left_ids = scheduler_output.finished_request_ids
        for seq in scheduler_output.sequences:
            # KV writes are idempotent (same tokens, same slots), so a rerun is exact.
            single = SchedulerOutput(sequences=[seq], finished_request_ids=left_ids)
            left_ids = []
            try:
                out = self.runner.execute(single)
            except Exception as exc:
                failed[seq.request_id] = f"{type(exc).__name__}: {exc}"
                sampled.append(None)
                logprobs.append(None)
                accepted.append([])
                accepted_logprobs.append([])
                continue
            sampled.append(out.sampled_token_ids[0])
            logprobs.append(out.logprobs[0] if out.logprobs else None)
            accepted.append(out.accepted_token_ids[0] if out.accepted_token_ids else [])
            accepted_logprobs.append(out.accepted_logprobs[0] if out.accepted_logprobs else [])
        if len(failed) == len(scheduler_output.sequences) > 1:
            raise EngineStepError(
                f"all {len(failed)} sequences of a step failed, each alone too: {failed}"
            )
        if failed:
            logger.error("failed alone too, finished with an error: %s", failed)
        return ModelRunnerOutput(sampled, logprobs, accepted, accepted_logprobs), failed
