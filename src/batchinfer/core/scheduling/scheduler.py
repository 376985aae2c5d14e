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

Under pressure the rules live in units of their own (docs/scheduling.md, "Where each rule
lives"), each testable without a Scheduler: the policy's order and victims (`policies`,
`victims`), admission and the watermarks (`admission`), deferred prefill chunks (`deferral`),
queue deadlines (`deadlines`), elastic max_tokens (`elastic`) and the preemption mode
(`core.preemption`). This class holds the state they read (the queue, the running set, the
block manager, the swap pool) and applies what they decide, in the order `schedule()` reads.
The per-request KV cap (`max_blocks_per_request`) is checked here, when a request is added.
Under a sliding window on every layer (`kv_window`), a request's blocks before its window are
dropped as it goes, and the block counts are what it holds at once (`window`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import replace

from batchinfer.core.block_manager import BlockManager, cdiv
from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import (
    QUEUE_TIMEOUT,
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from batchinfer.core.policy import WaitingQueue
from batchinfer.core.preemption import (
    HostBlockPool,
    PreemptionCosts,
    fits_swap_in,
    plan_kept_kv,
)
from batchinfer.core.request import Request, RequestStatus
from batchinfer.core.scheduling.admission import (
    AdmissionSize,
    Watermarks,
    admission_size,
    batch_due,
)
from batchinfer.core.scheduling.deadlines import QueueDeadlines
from batchinfer.core.scheduling.deferral import deferral_target, is_deferred
from batchinfer.core.scheduling.elastic import ElasticCaps
from batchinfer.core.scheduling.policies import make_policy
from batchinfer.core.scheduling.prefix_sharing import PrefixSharing
from batchinfer.core.scheduling.spec_depth import StepCosts
from batchinfer.core.scheduling.speculation import Speculation
from batchinfer.core.scheduling.victims import preempting_makes_room
from batchinfer.core.scheduling.window import KVWindow

# The preemption rate is preemptions per 100 steps over this many of the last steps that ran.
PREEMPTION_WINDOW_STEPS = 200
PREEMPTION_REASONS = ("kv_full", "priority")
PREEMPTED_KV = ("recompute", "swap")  # what a preempted request's KV became


class Scheduler:
    """Owns the waiting queue, the running set and the block manager."""

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        num_swap_blocks: int = 0,
        preemption_costs: PreemptionCosts | None = None,
        step_costs: StepCosts | None = None,
        kv_window: int | None = None,
    ) -> None:
        """`num_swap_blocks`: host blocks of the swap space (preemption_mode swap / auto);
        `preemption_costs`: what auto compares (measured by the worker); `step_costs`: what
        speculative_depth auto weighs (measured by the worker); `kv_window`: the sliding window
        every layer of the model attends over (None: some layer reads the whole context)."""
        self.config = config
        self.max_model_len = max_model_len
        self.clock = clock
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.window = KVWindow(kv_window, config.block_size, config.max_num_batched_tokens)
        # Prefix cache: tokens looked up and found at admission (vLLM's counters), and the
        # block keys of waiting requests (their tokens do not change while they wait).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_sharing = PrefixSharing(self.block_manager)
        self.policy = make_policy(config.scheduling_policy, config.priority_aging_ms / 1000.0)
        self.waiting: WaitingQueue = self.policy.new_queue()
        self.watermarks = Watermarks(
            max_num_seqs=config.max_num_seqs,
            kv_admission_watermark=config.kv_admission_watermark,
            kv_soft_watermark=config.kv_soft_watermark,
            short_request_tokens=config.short_request_tokens,
            whole_prompt=self.policy.watermark_whole_prompt,
        )
        self.deadlines = QueueDeadlines(config.max_queue_time_ms)
        self.elastic = ElasticCaps(config.elastic_max_tokens, config.kv_soft_watermark,
                                   config.elastic_min_tokens)
        # Ordered by the policy each step so that block-shortage victims are taken from the end.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.input_closed = False
        # Tokens one sequence may hold: the context, capped by `max_blocks_per_request`.
        self.token_limit = max_model_len
        if config.max_blocks_per_request is not None:
            self.token_limit = min(max_model_len,
                                   config.max_blocks_per_request * config.block_size)
        self.num_preemptions_total = 0
        self.preemptions = {(r, m): 0 for r in PREEMPTION_REASONS for m in PREEMPTED_KV}
        self._init_swap(num_swap_blocks, preemption_costs)
        self.speculation = (Speculation(config, step_costs)
                            if config.speculative_method != "none" else None)
        self._recent_preemptions: deque[int] = deque(maxlen=PREEMPTION_WINDOW_STEPS)
        self._step_preemptions = 0
        self._left_ids: list[str] = []
        # Outputs of requests the scheduler itself ended (queue timeouts), for the next step's.
        self._ended: list[EngineCoreOutput] = []

    def _init_swap(self, num_swap_blocks: int, costs: PreemptionCosts | None) -> None:
        mode = self.config.preemption_mode
        if mode != "recompute" and num_swap_blocks < 1:
            raise ValueError(f"preemption_mode {mode} needs a swap space of at least one KV "
                             "block; raise swap_space")
        if mode == "auto" and costs is None:
            raise ValueError("preemption_mode auto needs the preemption costs measured at "
                             "start-up")
        self.swap_pool = HostBlockPool(num_swap_blocks if mode != "recompute" else 0)
        self.preemption_costs = costs
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self.recomputed_tokens = 0
        # This step's copies: (device, host) pairs out; per resumed request, (host, device) in.
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: dict[str, list[tuple[int, int]]] = {}

    @property
    def preemptions_by_reason(self) -> dict[str, int]:
        return {r: sum(self.preemptions[r, m] for m in PREEMPTED_KV) for r in PREEMPTION_REASONS}

    @property
    def preemptions_by_mode(self) -> dict[str, int]:
        return {m: sum(self.preemptions[r, m] for r in PREEMPTION_REASONS) for m in PREEMPTED_KV}

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
        self._check_block_cap(request)
        blocks = self.window.blocks_held(request.num_prompt_tokens + 1)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt needs {blocks} KV blocks but the whole cache has "
                f"{self.block_manager.num_blocks}; raise kv_cache_memory"
            )
        request.status = RequestStatus.WAITING
        request.wait_start_s = self.clock()
        self.requests[request.request_id] = request
        self.deadlines.track(request)
        self.waiting.add(request)

    def _check_block_cap(self, request: Request) -> None:
        cap = self.config.max_blocks_per_request
        if cap is None:
            return
        max_tokens = request.sampling_params.max_tokens
        need = request.num_prompt_tokens + (max_tokens if max_tokens is not None else 1)
        if need > cap * self.config.block_size:
            what = f"prompt ({request.num_prompt_tokens} tokens)"
            if max_tokens is not None:
                what += f" + max_tokens ({max_tokens})"
            raise ValueError(
                f"{what} need {cdiv(need, self.config.block_size)} KV blocks of "
                f"{self.config.block_size} tokens; max_blocks_per_request is {cap}"
            )

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus,
        stop_reason: int | str | None = None,
        error: str | None = None,
        error_code: str | None = None,
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
        return self._output(request, [], [], error, error_code)

    def swaps_done(self) -> None:
        """The step's block copies ran: host blocks its swap-ins read are free again."""
        self.swap_pool.end_step()

    def take_ended(self) -> list[EngineCoreOutput]:
        """Outputs of the requests the scheduler ended itself (queue timeouts) since the last
        call."""
        ended, self._ended = self._ended, []
        return ended

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
        """When something changes for a caller with nothing to run: a waiting batch becomes
        due (dynamic form) or a waiting request's queue time runs out."""
        due = [self.deadlines.earliest_s(self.waiting)]
        if self.config.batching == "dynamic" and not self.running and self.waiting:
            due.append(self.waiting.first().arrival_s + self.config.max_batch_delay_ms / 1000)
        times = [t for t in due if t is not None]
        return min(times) if times else None

    # ----------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and tokens; allocates their KV blocks. The rules run in
        the order of docs/scheduling.md, "The step, in order"."""
        output = self._begin_step()
        now = self.clock()
        self._expire_waiting(now)
        self._apply_elastic_caps()
        self._admit_batch(now)
        continuous = self.config.batching == "continuous"
        self.policy.order_running(self.running, self._num_blocks_held, self._work_left)
        defer_for = deferral_target(self.waiting, continuous)
        deferred: list[Request] = []
        budget, preempted = self._schedule_running(
            output, self.config.max_num_batched_tokens, defer_for, deferred)
        if not preempted and continuous:
            budget = self._schedule_waiting(output, budget, now)
        self._schedule_deferred(output, budget, deferred)
        if output.is_empty and self.running:
            # The deferred chunks found no blocks and nothing could be admitted: run them as
            # usual (preempting if need be), so a step never stalls while requests run.
            self._schedule_running(output, self.config.max_num_batched_tokens, None, [])
        if self.speculation is not None and not output.is_empty:
            self.speculation.plan(output, self.requests, self.block_manager,
                                  self.config.max_num_batched_tokens
                                  - output.num_scheduled_tokens, self._work_left,
                                  len(self.running))
        self._end_step(output)
        return output

    def _begin_step(self) -> SchedulerOutput:
        """A new step's output, carrying the ids of requests that left since the last one."""
        output = SchedulerOutput(finished_request_ids=self._left_ids)
        self._left_ids = []
        self._step_preemptions = 0
        self._swap_out, self._swap_in = [], {}
        return output

    def _end_step(self, output: SchedulerOutput) -> None:
        """The step's block copies into `output`; the preemption window, if a step runs."""
        output.blocks_to_swap_out = self._swap_out
        output.blocks_to_swap_in = [pair for pairs in self._swap_in.values() for pair in pairs]
        self.swapped_in_blocks += len(output.blocks_to_swap_in)
        if output.is_empty and output.finished_request_ids:
            # No step runs: keep the ids for the next one, so the runner still hears of them.
            self._left_ids = output.finished_request_ids + self._left_ids
            output.finished_request_ids = []
        if not output.is_empty:
            self._recent_preemptions.append(self._step_preemptions)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        failed: Collection[str] = (),
    ) -> list[EngineCoreOutput]:
        """Record computed tokens and sampled ones; finish requests that hit a stop condition.
        Returns one output per sequence that gained a token. A sequence the runner failed
        (`failed`: its id; its token is `None`) is left to the caller, and its blocks never
        enter the prefix cache: their KV may not have been written."""
        now = self.clock()
        n = len(scheduler_output.sequences)
        logprobs = runner_output.logprobs or [None] * n
        accepted = runner_output.accepted_token_ids or [[] for _ in range(n)]
        accepted_logprobs = runner_output.accepted_logprobs or [[] for _ in range(n)]
        outputs = []
        finished: list[Request] = []
        for seq, token_id, token_logprobs, drafts, draft_logprobs in zip(
            scheduler_output.sequences, runner_output.sampled_token_ids, logprobs, accepted,
            accepted_logprobs, strict=True
        ):
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if seq.request_id in failed:
                continue
            if token_id is None:
                self._computed(request, seq.num_tokens)
                continue
            if self.speculation is not None and seq.num_spec_tokens:
                self.speculation.record(request, seq.num_spec_tokens, len(drafts))
            new_ids, status = self._append_tokens(request, [*drafts, token_id])
            # The chunk and every new token but the last are computed (the accepted proposals).
            self._computed(request, seq.num_tokens + len(new_ids) - 1)
            metrics = request.metrics
            if metrics.first_token_s is None:
                metrics.first_token_s = now
            metrics.last_token_s = now
            if status is not None:
                finished.append(request)
                self._finish(request, status)
            elif seq.num_spec_tokens:
                self.block_manager.trim(request.request_id, request.num_tokens)
            new_logprobs = [*draft_logprobs, token_logprobs] if token_logprobs else []
            outputs.append(self._output(request, new_ids, new_logprobs[: len(new_ids)]))
        if finished:
            # One pass instead of one `list.remove` per finished request.
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]
        return outputs

    def _computed(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` more of the request's tokens have their KV computed: full blocks enter
        the prefix cache."""
        bm = self.block_manager
        before = request.num_computed_tokens
        request.num_computed_tokens += num_tokens
        if bm.enable_prefix_caching and (
                request.num_computed_tokens // bm.block_size > before // bm.block_size):
            bm.cache_blocks(request.request_id, request.all_token_ids,
                            request.num_computed_tokens)

    def _append_tokens(self, request: Request, token_ids: list[int]
                       ) -> tuple[list[int], RequestStatus | None]:
        """Append new output tokens up to the first that stops the request (a stop id, EOS,
        max_tokens, the context): the tokens kept and the finished status, if any."""
        for i, token_id in enumerate(token_ids):
            request.output_token_ids.append(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                return token_ids[: i + 1], status
        return token_ids, None

    def stats(self, scheduler_output: SchedulerOutput | None = None) -> SchedulerStats:
        """The state after the step that ran `scheduler_output` (None: no step ran)."""
        recent = self._recent_preemptions
        return SchedulerStats(
            time_s=self.clock(),
            num_scheduled_tokens=scheduler_output.num_scheduled_tokens if scheduler_output else 0,
            num_scheduled_seqs=len(scheduler_output.sequences) if scheduler_output else 0,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions_total=self.num_preemptions_total,
            preemptions=dict(self.preemptions),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            preemption_rate=100.0 * sum(recent) / len(recent) if recent else 0.0,
            swap_usage=self.swap_pool.usage,
            swapped_out_blocks=self.swapped_out_blocks,
            swapped_in_blocks=self.swapped_in_blocks,
            recomputed_tokens=self.recomputed_tokens,
            spec_decode=(replace(self.speculation.stats, accepted_per_position=list(
                self.speculation.stats.accepted_per_position))
                if self.speculation is not None else None),
        )

    @staticmethod
    def _output(
        request: Request,
        new_token_ids: list[int],
        new_logprobs: list[TokenLogprobs],
        error: str | None = None,
        error_code: str | None = None,
    ) -> EngineCoreOutput:
        metrics = request.metrics
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            error=error,
            error_code=error_code,
            elastic_cap=request.max_tokens_cap if request.elastic_truncated else None,
            num_preemptions=metrics.num_preemptions,
            first_scheduled_s=metrics.first_scheduled_s,
            first_token_s=metrics.first_token_s,
            last_token_s=metrics.last_token_s,
            finished_s=metrics.finished_s,
        )

    # ----------------------------------------------------------------- pressure rules
    def _num_blocks_held(self, request: Request) -> int:
        return len(self.block_manager.block_table(request.request_id))

    def _num_blocks_pending(self, request: Request) -> int:
        """Blocks a running request still takes for the tokens it already has (under a
        sliding window, up to what it holds at once)."""
        needed = self.block_manager.num_blocks_needed(request.request_id, request.num_tokens)
        bound = self.window.max_held_blocks
        return needed if bound is None else max(0, min(needed,
                                                       bound - self._num_blocks_held(request)))

    def _output_limit(self, request: Request) -> int:
        """The most output tokens the request may produce (max_tokens, context, KV cap)."""
        limit = self.token_limit - request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        if request.max_tokens_cap is not None:
            limit = min(limit, request.max_tokens_cap)
        return limit

    def _work_left(self, request: Request) -> int:
        return self._output_limit(request) - request.num_output_tokens

    def _expire_waiting(self, now: float) -> None:
        """Requests whose queue time ran out leave with a queue_timeout error."""
        expired = self.deadlines.expired(self.waiting, now)
        self.waiting.remove_all(expired)  # one pass: under overload thousands leave at once
        for request in expired:
            request.waited_s = waited = request.time_waiting_s(now)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._ended.append(self._output(
                request, [], [],
                f"the request waited {waited:.3f} s in the queue, longer than its limit; "
                "the server is overloaded, retry later",
                QUEUE_TIMEOUT,
            ))

    def _apply_elastic_caps(self) -> None:
        """Under pressure, cap batch-class requests that did not choose max_tokens."""
        if not self.elastic.under_pressure(len(self.waiting), self.block_manager.usage):
            return
        for request in self.running:
            cap = self.elastic.cap_for(request, self._output_limit(request))
            if cap is not None:
                request.max_tokens_cap = cap

    def _committed_blocks(self) -> int:
        """Blocks in use plus those running requests need for the tokens they already have
        (prefills under way): what the soft watermark compares against."""
        pending = sum(self._num_blocks_pending(r) for r in self.running)
        return self.block_manager.num_used_blocks + pending

    # ----------------------------------------------------------------- admission
    def _admit_batch(self, now: float) -> None:
        """dynamic / static: move a whole batch to running when nothing runs and it is due."""
        if self.config.batching == "continuous" or self.running or not self.waiting:
            return
        size = min(self.config.max_batch_size, self.config.max_num_seqs)
        if not batch_due(self.waiting, size, batching=self.config.batching,
                         input_closed=self.input_closed,
                         max_batch_delay_ms=self.config.max_batch_delay_ms, clock=self.clock):
            return
        for _ in range(min(size, len(self.waiting))):
            request = self.waiting.first()
            self.waiting.remove(request)
            self._start(request, now)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, now: float) -> int:
        """continuous: admit waiting requests in policy order while budget, seats and blocks
        allow. Above the soft watermark, requests it does not exempt are passed over (they
        wait; the ones behind may go) unless nothing runs. Returns the budget left."""
        bm = self.block_manager
        committed = self._committed_blocks()
        prefilling = self.prefix_sharing.prefilling_by_first_block(self.running)
        for request in list(self.waiting):
            if budget <= 0:
                break
            if request.swap_blocks and not self._swap_in_fits(request):
                return budget  # in order: it resumes next step, within the swap cap
            size = self._admission_size(request, budget)
            if self.prefix_sharing.waits_for_a_running_prefill(request, size.cached, prefilling):
                continue  # it waits for that prefill, then takes its blocks from the cache
            if (self.watermarks.above_soft(committed + size.whole, len(self.running),
                                           bm.num_blocks)
                    and not self.watermarks.soft_exempt(
                        request, self._work_left(request),
                        self.policy.aged_to_interactive(request, now))):
                continue
            while not self.watermarks.admissible(size.take, committed + size.whole,
                                                 len(self.running), bm):
                refund = self._preempt_for(request, size.take, committed, size.whole, output)
                if refund is None:
                    return budget  # in order: nothing behind it jumps a request that waits
                budget += refund
                committed = self._committed_blocks()
                size = self._admission_size(request, budget)  # a victim's blocks may have left
            start, num_new = size.start, size.num_new
            bm.share(request.request_id, size.cached, size.first_block)
            table = bm.allocate(request.request_id, start + num_new)
            if table is None:  # not reached: `admissible` checked the free blocks
                raise RuntimeError("admission allocated more blocks than were free")
            self.waiting.remove(request)
            self.prefix_sharing.admitted(request, prefilling)
            if request.swap_blocks:
                self._swap_in_to(request, table)
            else:
                request.num_computed_tokens = start
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += start
            self._start(request, now)
            output.sequences.append(self._sequence(request, num_new, table))
            budget -= num_new
            committed += size.whole
        return budget

    def _admission_size(self, request: Request, budget: int) -> AdmissionSize:
        """What admitting a waiting request takes now (see `AdmissionSize`)."""
        bm = self.block_manager
        cached = self.prefix_sharing.cached_prefix(request)
        first = (request.swap_first_block if request.swap_blocks
                 else self.window.first_block(len(cached) * bm.block_size))
        return admission_size(request, budget, cached, bm.num_idle(cached[first:]),
                              bm.block_size, first, self.window.max_held_blocks)

    def _preempt_for(
        self, request: Request, take: int, committed: int, whole: int, output: SchedulerOutput
    ) -> int | None:
        """Preempt one running request that yields to the waiting `request` (by the policy),
        if preempting all of them would make room by the admission rules (`take` blocks now;
        `whole` on top of the `committed` ones under the watermark). Returns the budget it
        gives back (its tokens scheduled in this step), or None when nothing is preempted."""
        lower = [r for r in self.running if self.policy.yields_to(r, request)]
        if not lower:
            return None
        bm = self.block_manager
        if not preempting_makes_room(
            take=take, whole=whole, committed=committed, num_free_blocks=bm.num_free_blocks,
            num_freed=bm.num_freed_by([r.request_id for r in lower]),  # blocks only they hold
            num_pending=sum(self._num_blocks_pending(r) for r in lower),
            limit=self.config.kv_admission_watermark * bm.num_blocks,
            all_yield=len(lower) == len(self.running),
        ):
            return None
        victim = self.policy.choose_victim(lower, self._num_blocks_held, self._work_left)
        refund = 0
        for i, seq in enumerate(output.sequences):
            if seq.request_id == victim.request_id:
                refund = seq.num_tokens
                del output.sequences[i]
                break
        self.running.remove(victim)
        self._preempt(victim, "priority")
        return refund

    def _start(self, request: Request, now: float) -> None:
        request.status = RequestStatus.RUNNING
        request.waited_s += now - request.wait_start_s
        request.admitted_rank = self.policy.rank(request, now)
        if request.metrics.first_scheduled_s is None:
            request.metrics.first_scheduled_s = now
        self.running.append(request)

    # ----------------------------------------------------------------- running + preemption
    def _schedule_running(
        self,
        output: SchedulerOutput,
        budget: int,
        defer_for: Request | None,
        deferred: list[Request],
    ) -> tuple[int, bool]:
        """Give each running request its next tokens; preempt from the end when blocks run
        out. The prefill chunk of a request that yields to `defer_for` (the best waiting
        request) is deferred until waiting requests are admitted. Returns the budget left and
        whether anything was preempted."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.swap_blocks and not self._swap_in_fits(request):
                i += 1  # resumed by a whole-batch admission: it swaps in next step
                continue
            if is_deferred(request, defer_for, self.policy):
                deferred.append(request)
                i += 1
                continue
            num_new, table = self._grow(request, budget)
            while table is None:
                victim = self.running.pop()
                self._preempt(victim, "kv_full")
                preempted = True
                if victim is request:
                    break
                num_new, table = self._grow(request, budget)
            if table is None:
                break
            output.sequences.append(self._sequence(request, num_new, table))
            budget -= num_new
            i += 1
        return budget, preempted

    def _schedule_deferred(
        self, output: SchedulerOutput, budget: int, deferred: list[Request]
    ) -> None:
        """The deferred prefill chunks, with what budget is left; never preempts for them."""
        for request in deferred:
            if budget <= 0:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted meanwhile
            if request.swap_blocks and not self._swap_in_fits(request):
                continue
            num_new, table = self._grow(request, budget)
            if table is None:
                continue
            output.sequences.append(self._sequence(request, num_new, table))
            budget -= num_new

    def _grow(self, request: Request, budget: int) -> tuple[int, list[int] | None]:
        """The request's next chunk within `budget`, and its block table grown to hold it
        (None when the blocks are not free; blocks before its window are dropped either
        way)."""
        bm = self.block_manager
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if not request.swap_blocks:
            bm.drop_blocks_before(request.request_id,
                                  self.window.first_block(request.num_computed_tokens))
        elif not bm.block_table(request.request_id):  # resumes: its table starts where the
            bm.share(request.request_id, [], request.swap_first_block)  # swapped blocks do
        table = bm.allocate(request.request_id, request.num_computed_tokens + num_new)
        if table is not None and request.swap_blocks:
            self._swap_in_to(request, table)
        return num_new, table

    def _preempt(self, request: Request, reason: str) -> None:
        """Take a running request back to the waiting queue (fcfs: at the front). Its KV is
        swapped out or dropped (`_keep_kv`); its output so far is kept, and what was dropped
        is prefilled again with the prompt, so the text it produces does not change."""
        undone = self._swap_in.pop(request.request_id, None)
        if undone is not None:
            # Resumed in this step and taken back before its swap-in ran: its KV is still in
            # the host blocks. (Not reached under today's rules, kept for safety: a request
            # admitted earlier in a step never yields to one admitted later, and kv_full
            # victims are never requests already scheduled in the step.)
            request.swap_blocks = [host for host, _ in undone]
            self.swap_pool.keep(request.swap_blocks)
            mode = "swap"
        elif request.swap_blocks:
            # Moved to running by a whole-batch admission but never resumed: nothing to undo.
            self._requeue(request)
            return
        else:
            mode = self._keep_kv(request)
        self.block_manager.free(request.request_id)
        self._left_ids.append(request.request_id)
        request.metrics.num_preemptions += 1
        self.num_preemptions_total += 1
        self.preemptions[reason, mode] += 1
        self._step_preemptions += 1
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        request.status = RequestStatus.PREEMPTED
        request.wait_start_s = self.clock()
        self.waiting.requeue(request)

    def _keep_kv(self, request: Request) -> str:
        """Swap a victim's computed blocks out or drop them, by `plan_kept_kv` (the preemption
        mode, this step's swap cap, the free host blocks, the costs). Returns the mode used;
        `num_computed_tokens` becomes what was kept."""
        computed = request.num_computed_tokens
        bm = self.block_manager
        # What lies before its window now is not worth a copy: dropped first.
        bm.drop_blocks_before(request.request_id, self.window.first_block(computed))
        dropped = bm.num_dropped_blocks(request.request_id)
        plan = plan_kept_kv(self.config.preemption_mode, computed, bm.block_size,
                            self.swap_pool.num_free,
                            self.config.max_swap_blocks_per_step - len(self._swap_out),
                            self.preemption_costs, dropped)
        n = plan.num_swap_blocks
        self.recomputed_tokens += computed - plan.num_kept_tokens
        request.num_computed_tokens = plan.num_kept_tokens
        if n:
            table = bm.block_table(request.request_id)
            request.swap_first_block = dropped
            request.swap_blocks = self.swap_pool.allocate(n)
            self._swap_out.extend(zip(table[:n], request.swap_blocks, strict=True))
            self.swapped_out_blocks += n
        return plan.mode

    def _swap_in_fits(self, request: Request) -> bool:
        """Whether a swapped-out request's blocks fit in what this step may still copy in."""
        copied = sum(len(pairs) for pairs in self._swap_in.values())
        return fits_swap_in(copied, len(request.swap_blocks), self.config.max_swap_blocks_per_step)

    def _swap_in_to(self, request: Request, table: list[int]) -> None:
        """Resume a swapped-out request into its new blocks: its host blocks are copied into
        the first of them before the step runs, and free again after it."""
        self._swap_in[request.request_id] = list(zip(request.swap_blocks, table, strict=False))
        self.swap_pool.release(request.swap_blocks)
        request.swap_blocks = []

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
        # The token history goes down only when a penalty or a grammar reads it: copying
        # prompt + output for every sequence every step would make host work quadratic in the
        # output length. (The runner's grammar matchers replay it after a preemption.)
        params = request.sampling_params
        history = sample and (params.needs_penalties or params.structured_output is not None)
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
            num_dropped_blocks=self.block_manager.num_dropped_blocks(request.request_id),
        )

    # ----------------------------------------------------------------- stopping
    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if token_id in request.eos_token_ids and (
            # Under a grammar, an end-of-sequence token is allowed only where the grammar is
            # complete: it ends the output whatever ignore_eos and min_tokens say.
            params.structured_output is not None
            or (not params.ignore_eos and num_output >= params.min_tokens)
        ):
            return RequestStatus.FINISHED_STOPPED
        if num_output >= params.min_tokens and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.token_limit:
            return RequestStatus.FINISHED_LENGTH
        if request.max_tokens_cap is not None and num_output >= request.max_tokens_cap:
            request.elastic_truncated = True
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.block_manager.free(request.request_id)
        if request.swap_blocks:  # ended while swapped out
            self.swap_pool.free(request.swap_blocks)
            request.swap_blocks = []
        self.prefix_sharing.forget(request.request_id)
        self._left_ids.append(request.request_id)
        request.status = status
        request.metrics.finished_s = self.clock()
        del self.requests[request.request_id]
        self.deadlines.untrack(request)

