"""Iteration-level scheduler: which requests compute which tokens in the next step.

Each step gives running requests their next tokens first (a decode = 1 token, an unfinished
prefill = its next chunk), then admits waiting requests, within the step's token budget
(`max_num_batched_tokens`), `max_num_seqs` and the free KV blocks. The batching form only changes
*when* waiting requests may be admitted:

- `continuous`: at every step, as budget, sequences and the KV admission watermark allow;
- `dynamic`: a whole batch, only when nothing runs, once `max_batch_size` requests wait or the
  oldest has waited `max_batch_delay_ms`;
- `static`: a whole batch, only when nothing runs, once `max_batch_size` requests wait (a partial
  batch only after `close_input()`: no more requests are coming).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from batchinfer.core.block_manager import BlockManager, cdiv
from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from batchinfer.core.request import Request, RequestStatus


class Scheduler:
    """Owns the waiting queue, the running set and the block manager."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.clock = clock
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.waiting: deque[Request] = deque()
        # Admission order; preemption victims are taken from the end (latest arrival).
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.input_closed = False
        self.num_preemptions_total = 0
        self._left_ids: list[str] = []

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a request; `ValueError` if it can never fit (never left hanging)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt must not be empty")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                f"{self.max_model_len}, which leaves no room to generate"
            )
        blocks = cdiv(request.num_prompt_tokens + 1, self.block_manager.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt needs {blocks} KV blocks but the whole cache has "
                f"{self.block_manager.num_blocks}; raise kv_cache_memory"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> EngineCoreOutput | None:
        """End a request (abort, stop string, failure) wherever it is; returns its last output
        (no new tokens), or None if it is unknown or already finished."""
        if not status.is_finished:
            raise RuntimeError(f"finish_request needs a finished status, got {status!r}")
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.stop_reason = stop_reason if stop_reason is not None else request.stop_reason
        self._finish(request, status)
        return self._output(request, [], [], error)

    def close_input(self) -> None:
        """No more requests will come: the static form may run a partial last batch."""
        self.input_closed = True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def next_dispatch_s(self) -> float | None:
        """When a waiting batch becomes due (dynamic form), for a caller with nothing to run."""
        if self.config.batching != "dynamic" or self.running or not self.waiting:
            return None
        return self.waiting[0].arrival_s + self.config.max_batch_delay_ms / 1000.0

    # ----------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and tokens; allocates their KV blocks."""
        output = SchedulerOutput(finished_request_ids=self._left_ids)
        self._left_ids = []
        self._admit_batch()
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(output, budget)
        if not preempted and self.config.batching == "continuous":
            self._schedule_waiting(output, budget)
        if output.is_empty and output.finished_request_ids:
            # No step runs: keep the ids for the next one, so the runner still hears of them.
            self._left_ids = output.finished_request_ids + self._left_ids
            output.finished_request_ids = []
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Record computed tokens and sampled ones; finish requests that hit a stop condition.
        Returns one output per sequence that gained a token (a sequence the runner failed has
        `None` for its token and is left to the caller)."""
        now = self.clock()
        logprobs = runner_output.logprobs or [None] * len(scheduler_output.sequences)
        outputs = []
        finished: list[Request] = []
        for seq, token_id, token_logprobs in zip(
            scheduler_output.sequences, runner_output.sampled_token_ids, logprobs, strict=True
        ):
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += seq.num_tokens
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            metrics = request.metrics
            if metrics.first_token_s is None:
                metrics.first_token_s = now
            metrics.last_token_s = now
            status = self._stop_status(request, token_id)
            if status is not None:
                finished.append(request)
                self._finish(request, status)
            outputs.append(
                self._output(request, [token_id], [token_logprobs] if token_logprobs else [])
            )
        if finished:
            # One pass instead of one `list.remove` per finished request.
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]
        return outputs

    def stats(self, scheduler_output: SchedulerOutput | None = None) -> SchedulerStats:
        """The state after the step that ran `scheduler_output` (None: no step ran)."""
        return SchedulerStats(
            time_s=self.clock(),
            num_scheduled_tokens=scheduler_output.num_scheduled_tokens if scheduler_output else 0,
            num_scheduled_seqs=len(scheduler_output.sequences) if scheduler_output else 0,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions_total=self.num_preemptions_total,
        )

    @staticmethod
    def _output(
        request: Request,
        new_token_ids: list[int],
        new_logprobs: list[TokenLogprobs],
        error: str | None = None,
    ) -> EngineCoreOutput:
        metrics = request.metrics
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            error=error,
            num_preemptions=metrics.num_preemptions,
            first_scheduled_s=metrics.first_scheduled_s,
            first_token_s=metrics.first_token_s,
            last_token_s=metrics.last_token_s,
            finished_s=metrics.finished_s,
        )

    # ----------------------------------------------------------------- admission
    def _admit_batch(self) -> None:
        """dynamic / static: move a whole batch to running when nothing runs and it is due."""
        if self.config.batching == "continuous" or self.running or not self.waiting:
            return
        size = min(self.config.max_batch_size, self.config.max_num_seqs)
        if not self._batch_due(size):
            return
        now = self.clock()
        for _ in range(min(size, len(self.waiting))):
            self._start(self.waiting.popleft(), now)

    def _batch_due(self, size: int) -> bool:
        if len(self.waiting) >= size or self.input_closed:
            return True
        if any(r.status == RequestStatus.PREEMPTED for r in self.waiting):
            return True  # a preempted batch member resumes as soon as the machine is free
        if self.config.batching == "dynamic":
            due = self.next_dispatch_s()
            return due is not None and self.clock() >= due
        return False

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """continuous: admit waiting requests in order while budget, seats and blocks allow."""
        bm = self.block_manager
        limit_blocks = self.config.kv_admission_watermark * bm.num_blocks
        now = self.clock()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            needed = bm.num_blocks_needed(request.request_id, num_new)
            # Above the watermark, admit only into an empty machine (the hard limit is all
            # blocks), so running requests keep room to grow and preemption stays rare.
            if self.running and bm.num_used_blocks + needed > limit_blocks:
                break
            table = bm.allocate(request.request_id, request.num_computed_tokens + num_new)
            if table is None:
                break
            self.waiting.popleft()
            self._start(request, now)
            output.sequences.append(self._sequence(request, num_new, table))
            budget -= num_new

    def _start(self, request: Request, now: float) -> None:
        request.status = RequestStatus.RUNNING
        if request.metrics.first_scheduled_s is None:
            request.metrics.first_scheduled_s = now
        self.running.append(request)

    # ----------------------------------------------------------------- running + preemption
    def _schedule_running(self, output: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Give each running request its next tokens; preempt from the end when blocks run out.
        Returns the budget left and whether anything was preempted."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            table = self.block_manager.allocate(
                request.request_id, request.num_computed_tokens + num_new
            )
            while table is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                table = self.block_manager.allocate(
                    request.request_id, request.num_computed_tokens + num_new
                )
            if table is None:
                break
            output.sequences.append(self._sequence(request, num_new, table))
            budget -= num_new
            i += 1
        return budget, preempted

    def _preempt(self, request: Request) -> None:
        """Recompute: drop the request's KV and requeue it at the front; its output so far is
        kept and re-prefilled with the prompt, so the text it produces does not change."""
        self.block_manager.free(request.request_id)
        self._left_ids.append(request.request_id)
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _sequence(self, request: Request, num_new: int, table: list[int]) -> ScheduledSequence:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        num_prompt = request.num_prompt_tokens
        if start >= num_prompt:
            offset = start - num_prompt
            token_ids = request.output_token_ids[offset : offset + num_new]
        elif start + num_new <= num_prompt:
            token_ids = request.prompt_token_ids[start : start + num_new]
        else:  # a recomputed request: prompt tail + the output it had produced
            token_ids = request.all_token_ids[start : start + num_new]
        # The token history goes down only when a penalty reads it: copying prompt + output
        # for every sequence every step would make host work quadratic in the output length.
        history = sample and request.sampling_params.needs_penalties
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_table=list(table),
            sample=sample,
            sampling_params=request.sampling_params,
            num_prompt_tokens=request.num_prompt_tokens,
            all_token_ids=request.all_token_ids if history else None,
            sample_index=request.num_output_tokens,
        )

    # ----------------------------------------------------------------- stopping
    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.block_manager.free(request.request_id)
        self._left_ids.append(request.request_id)
        request.status = status
        request.metrics.finished_s = self.clock()
        del self.requests[request.request_id]
