"""Pure-Python scheduling core: requests, sampling parameters, block manager, scheduler.

Nothing here imports torch (a test checks it), so the scheduler is tested step by step with a
fake runner in milliseconds.
"""

from batchinfer.core.config import EngineConfig
from batchinfer.core.outputs import (
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    TokenLogprobs,
)
from batchinfer.core.request import FinishReason, Request, RequestStatus
from batchinfer.core.sampling_params import SamplingParams

__all__ = [
    "EngineConfig",
    "FinishReason",
    "ModelRunnerOutput",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledSequence",
    "SchedulerOutput",
    "TokenLogprobs",
]
