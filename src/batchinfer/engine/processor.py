"""Input processing: a user's prompt and parameters in, the scheduler's `Request`s out.

Tokenizes (text, token ids or chat messages with the model's template), validates against the
model (vocabulary, `max_model_len`), compiles a structured output's grammar (so a schema that
does not compile is a `ParamError` before anything is queued; the compiled grammar stays in the
runner's cache) and fans a request with `n` sequences out into `n` scheduler requests. It reads only immutable model facts, so the server runs it off the event
loop, on any thread; nothing here touches the scheduler.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from batchinfer.core.request import Request, SchedulingOptions
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.core.structured_output import StructuredOutput
from batchinfer.core.validation import ParamError
from batchinfer.engine.inputs import Prompt, tokenize_prompt
from batchinfer.engine.tools import tool_format_of


@dataclass(slots=True)
class EngineRequest:
    """One user request, processed: what the output processor registers and the engine queues."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    # One per `n`. Their scheduler ids are `{request_id}@{serial}` (and `#{index}` for n > 1),
    # unique for the process's life: a request id reused after an abort, or one that looks like
    # another request's sequence id, can never receive another request's tokens.
    sequences: list[Request]
    priority_class: str = "interactive"


class GrammarCompiler(Protocol):
    """What the processor needs of the runner's structured outputs (`StructuredOutputs`)."""

    def compile(self, spec: StructuredOutput) -> object:
        """Compile (or find cached) `spec`'s grammar; `ParamError` if it cannot be."""
        ...


class Processor:
    """Turns prompts into `EngineRequest`s; `ValueError` names what is wrong. `grammars`
    compiles structured outputs (None: a request that asks for one is refused)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Collection[int],
        clock: Callable[[], float],
        special_tokens_in_chat: bool = False,
        grammars: GrammarCompiler | None = None,
        tool_call_parser: str = "auto",
    ) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        # The syntax of this model's tool calls (engine/tools.py).
        self.tool_format = tool_call_parser if tool_call_parser != "auto" else \
            tool_format_of(getattr(tokenizer, "chat_template", None))
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.special_tokens_in_chat = special_tokens_in_chat
        self._serials = itertools.count()  # next() is atomic: process() runs on many threads

    def tokenize(
        self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) as the engine will see them; `tools` (OpenAI's
        function tools) are rendered with a chat."""
        return tokenize_prompt(self.tokenizer, prompt, self.vocab_size,
                               self.special_tokens_in_chat, tools)

    def process(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
        scheduling: SchedulingOptions | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> EngineRequest:
        """Tokenize, validate and fan out one request (not queued yet)."""
        params = params or SamplingParams()
        scheduling = scheduling or SchedulingOptions()
        self._check_against_model(params)
        text, token_ids = self.tokenize(prompt, tools)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        request_id = request_id or uuid.uuid4().hex
        arrival_s = self.clock() if arrival_s is None else arrival_s
        base_id = f"{request_id}@{next(self._serials)}"
        sequences = [
            Request(
                base_id if params.n == 1 else f"{base_id}#{index}",
                list(token_ids),
                _child_params(params, index),
                arrival_s=arrival_s,
                eos_token_ids=self.eos_token_ids,
            )
            for index in range(params.n)
        ]
        for sequence in sequences:
            sequence.apply(scheduling)
        return EngineRequest(request_id, text, token_ids, params, arrival_s, sequences,
                             scheduling.priority_class)


    def _check_against_model(self, params: SamplingParams) -> None:
        """Token ids within the vocabulary; a structured output's grammar compiled."""
        for name, what, ids in (("stop_token_ids", "stop_token_ids", params.stop_token_ids),
                                ("logit_bias", "logit_bias keys", list(params.logit_bias))):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ParamError(f"{what} must be in [0, {self.vocab_size}), got {bad[0]}",
                                 name)
        spec = params.structured_output
        if spec is None:
            return
        if self.grammars is None:
            raise ParamError("structured_output is not supported by this engine",
                             "structured_output")
        self.grammars.compile(spec)


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    # Sequences of one request draw different samples; with a seed, still reproducibly.
    seed = params.seed + index if params.seed is not None and index else params.seed
    return dataclasses.replace(params, n=1, seed=seed)
