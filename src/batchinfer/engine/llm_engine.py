"""The synchronous generative engine: add requests, step, read outputs.

One step = schedule, run the model once over a flat batch, update the scheduler, turn the new
tokens into outputs. Everything about *which* tokens run lives in `core.scheduler`; everything
about tensors lives in `runner/`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable

import torch

from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from batchinfer.core.request import Request, RequestStatus
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.core.scheduler import RequestUpdate, Scheduler
from batchinfer.engine.inputs import Prompt, tokenize_prompt
from batchinfer.engine.output_processor import OutputProcessor
from batchinfer.engine.outputs import RequestOutput
from batchinfer.models.loader import load_model, resolve_dtype
from batchinfer.models.prepack import prepack_supported
from batchinfer.runner.kv_cache import kv_cache_budget_bytes, num_kv_blocks, resolve_kv_dtype
from batchinfer.runner.model_runner import ModelRunner


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    return torch.device(name)


class LLMEngine:
    """Loads the model, sizes the KV cache, and runs the step loop."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.loaded = load_model(config.model, self.dtype, self.device)
        if config.prepack_weights and prepack_supported(self.device, self.dtype):
            self.loaded.model.prepack_weights()
        self.spec = self.loaded.spec
        self.tokenizer = self.loaded.tokenizer
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        budget = kv_cache_budget_bytes(
            self.device, config.kv_cache_memory, config.gpu_memory_utilization
        )
        num_blocks = num_kv_blocks(self.spec, config.block_size, kv_dtype, budget)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes hold no KV block of {config.block_size} tokens"
            )
        self.max_model_len = self._max_model_len(num_blocks * config.block_size)
        self.runner = ModelRunner(
            self.loaded.model,
            self.spec,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=self.device,
            kv_dtype=kv_dtype,
            eos_token_ids=self.loaded.eos_token_ids,
            seed=config.seed,
        )
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len, clock)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def _max_model_len(self, kv_capacity_tokens: int) -> int:
        model_max = self.spec.max_position_embeddings
        if self.spec.sliding_window is not None:
            # Attention over a sliding window is not implemented; within it, full attention is
            # exact, so cap the length there rather than compute something else.
            model_max = min(model_max, self.spec.sliding_window)
        wanted = self.config.max_model_len
        if wanted is None:
            return min(model_max, kv_capacity_tokens)
        if wanted > model_max:
            raise ValueError(f"max_model_len {wanted} exceeds the model's maximum {model_max}")
        if wanted > kv_capacity_tokens:
            raise ValueError(
                f"max_model_len {wanted} needs more KV cache than kv_cache_memory holds "
                f"({kv_capacity_tokens} tokens); raise kv_cache_memory or lower max_model_len"
            )
        return wanted

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
        priority: int = 0,
    ) -> str:
        """Tokenize and queue a prompt; returns its request id. `ValueError` on bad input."""
        params = params or SamplingParams()
        text, token_ids = tokenize_prompt(self.tokenizer, prompt, self.spec.vocab_size)
        return self.add_tokenized(text, token_ids, params, request_id, arrival_s, priority)

    def add_tokenized(
        self,
        prompt: str | None,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_s: float | None = None,
        priority: int = 0,
    ) -> str:
        request_id = request_id or uuid.uuid4().hex
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival_s = self.clock() if arrival_s is None else arrival_s
        children = [self._child(params, i) for i in range(params.n)]
        child_ids = self.output_processor.add_request(
            request_id, prompt, token_ids, params, arrival_s
        )
        added: list[str] = []
        try:
            for child_id, child_params in zip(child_ids, children, strict=True):
                request = Request(
                    child_id,
                    list(token_ids),
                    child_params,
                    arrival_s=arrival_s,
                    eos_token_ids=self.loaded.eos_token_ids,
                    priority=priority,
                )
                self.scheduler.add_request(request)
                added.append(child_id)
        except ValueError:
            for child_id in added:
                self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort(request_id)
            raise
        return request_id

    def make_requests(
        self,
        child_ids: list[str],
        token_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
        priority: int = 0,
    ) -> list[Request]:
        """The scheduler-side `Request`s of one request's `n` sequences (not queued yet): what
        `add_tokenized` queues, for a caller that queues them from another thread."""
        return [
            Request(
                child_id,
                list(token_ids),
                self._child(params, i),
                arrival_s=arrival_s,
                eos_token_ids=self.loaded.eos_token_ids,
                priority=priority,
            )
            for i, child_id in enumerate(child_ids)
        ]

    @staticmethod
    def _child(params: SamplingParams, index: int) -> SamplingParams:
        # Sequences of one request draw different samples; with a seed, still reproducibly.
        seed = params.seed + index if params.seed is not None and index else params.seed
        return dataclasses.replace(params, n=1, seed=seed)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its KV blocks are free before the next step."""
        for child_id in self.output_processor.child_ids(request_id):
            self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the requests that changed."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        runner_output = self.runner.execute(scheduler_output)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self.process_updates(updates)

    def process_updates(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        outputs, stops = self.output_processor.process(updates)
        for child_id, stop_string in stops:
            self.scheduler.finish_request(child_id, RequestStatus.FINISHED_STOPPED, stop_string)
        return outputs

    # ----------------------------------------------------------------- the step, split
    def step_core(self) -> tuple[SchedulerOutput, list[RequestUpdate], dict[str, str]]:
        """The engine-thread half of `step()`: schedule, execute, update; no detokenization.

        Returns the step's scheduler output, the token updates (for `process_updates` or an
        `OutputProcessor` elsewhere) and the requests that failed inside the runner
        (child id -> message); those are already finished as aborted, and nothing else is.
        """
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return scheduler_output, [], {}
        runner_output, failed = self._execute_isolated(scheduler_output)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        return scheduler_output, updates, failed

    def _execute_isolated(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[ModelRunnerOutput, dict[str, str]]:
        """Run the step; if the runner raises, rerun each sequence alone once so that only the
        ones that fail again are failed (and finished), and the rest of the batch goes on."""
        try:
            return self.runner.execute(scheduler_output), {}
        except Exception:  # one request's failure must not stop the engine
            pass
        sampled: list[int | None] = []
        logprobs: list[TokenLogprobs | None] = []
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
                continue
            sampled.append(out.sampled_token_ids[0])
            logprobs.append(out.logprobs[0] if out.logprobs else None)
        for request_id in failed:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs), failed
