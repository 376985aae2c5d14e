"""`LLMEngine`: the synchronous engine — processor, engine core and output processor in one
thread. `LLM.generate` drives it; `AsyncLLM` runs its core on a thread of its own and its
processors on the event loop, so both share one step path (`EngineCore.step`).

```python
def step(self) -> list[RequestOutput]:
    return self.process_outputs(self.core.step()).outputs
```
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import EngineCoreOutput
from batchinfer.core.preemption import PreemptionCosts
from batchinfer.core.request import RequestStatus, SchedulingOptions
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.core.scheduling.spec_depth import StepCosts
from batchinfer.engine.core import EngineCore, Runner
from batchinfer.engine.inputs import Prompt
from batchinfer.engine.output_processor import OutputProcessor, ProcessedOutputs
from batchinfer.engine.outputs import RequestOutput, RequestOutputKind
from batchinfer.engine.processor import EngineRequest, GrammarCompiler, Processor


class ModelWorker(Protocol):
    """What the engine needs of a loaded model (`runner.worker.Worker`, or a fake in tests)."""

    @property
    def runner(self) -> Runner: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def model_name(self) -> str: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def num_swap_blocks(self) -> int: ...

    @property
    def preemption_costs(self) -> PreemptionCosts | None: ...

    @property
    def step_costs(self) -> StepCosts | None: ...

    @property
    def kv_window(self) -> int | None:
        """The sliding window every layer attends over (None: some layer reads everything)."""
        ...

    @property
    def structured_outputs(self) -> GrammarCompiler | None: ...


class LLMEngine:
    """Add requests, step, read outputs. Build with `LLMEngine.from_config(config)`."""

    def __init__(
        self,
        config: EngineConfig,
        worker: ModelWorker,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config = config.fitted_to_cache(worker.num_blocks)
        self.config = config
        self.worker = worker
        self.clock = clock
        self.tokenizer = worker.tokenizer
        self.max_model_len = worker.max_model_len
        self.model_name = worker.model_name
        self.core = EngineCore(config, worker.runner, worker.num_blocks, worker.max_model_len,
                               clock, worker.num_swap_blocks, worker.preemption_costs,
                               worker.step_costs, worker.kv_window)
        self.processor = Processor(worker.tokenizer, worker.vocab_size, worker.max_model_len,
                                   worker.eos_token_ids, clock, config.special_tokens_in_chat,
                                   worker.structured_outputs, config.tool_call_parser)
        self.output_processor = OutputProcessor(worker.tokenizer)

    @classmethod
    def from_config(
        cls, config: EngineConfig, clock: Callable[[], float] = time.monotonic
    ) -> LLMEngine:
        """Load the model named by `config` (this is where torch is imported)."""
        from batchinfer.runner.worker import Worker

        return cls(config, Worker.from_config(config), clock)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> LLMEngine:
        return cls.from_config(EngineConfig.from_kwargs(**kwargs))

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
        kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        scheduling: SchedulingOptions | None = None,
    ) -> str:
        """Tokenize and queue a prompt; returns its request id. `ValueError` on bad input."""
        request = self.processor.process(prompt, params, request_id, arrival_s, scheduling)
        self.add_processed(request, kind)
        return request.request_id

    def add_processed(
        self, request: EngineRequest, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    ) -> None:
        """Queue a request the processor built; `ValueError` leaves nothing queued."""
        self.output_processor.add_request(request, kind)
        try:
            self.core.add_requests(request.sequences)
        except ValueError:
            self.output_processor.abort(request.request_id)
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; returns its final output (None if unknown)."""
        self.core.abort(self.output_processor.child_ids(request_id))
        outputs = self.output_processor.abort(request_id).outputs
        return outputs[0] if outputs else None

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the requests that changed (by their
        output kinds)."""
        return self.process_outputs(self.core.step()).outputs

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Detokenize one step's core outputs and finish, in the core, what the output side
        ended (stop strings; the other sequences of a failed request)."""
        processed = self.output_processor.process(core_outputs)
        for child_id, stop_string in processed.stopped:
            self.core.finish([child_id], RequestStatus.FINISHED_STOPPED, stop_string)
        self.core.abort(processed.to_abort)
        return processed
