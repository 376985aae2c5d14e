"""`LLM`: offline generation over many prompts with one copy of the weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm  # type: ignore[import-untyped]

from batchinfer.core.config import EngineConfig
from batchinfer.core.request import SchedulingOptions
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.engine.inputs import Chat, Prompt, is_chat, is_token_ids
from batchinfer.engine.llm_engine import LLMEngine
from batchinfer.engine.outputs import RequestOutput, RequestOutputKind
from batchinfer.engine.processor import EngineRequest


class LLM:
    """`LLM(model, **engine_knobs)`; `generate()` returns results in input order.

    `model` is "default" (the embedded SmolLM2-135M-Instruct), a Hugging Face folder, a .gguf
    file or a Hugging Face Hub id such as "Qwen/Qwen2.5-0.5B-Instruct" (with `revision=`, and
    `gguf_file=` for one GGUF in the repo); every `EngineConfig` field is accepted as a keyword (`dtype="float32"`,
    `max_num_seqs=64`, `batching="static"`, ...).
    """

    def __init__(self, model: str = "default", **engine_knobs: Any) -> None:
        self.engine = LLMEngine.from_config(EngineConfig.from_kwargs(model=model, **engine_knobs))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list: strings, token-id lists or chat message lists.

        Results come in input order. A request the engine failed (the runner raised on it,
        alone) comes back finished with reason "abort" and `error` set; the others are exact.
        `priority` (one per prompt, lower first) is read by `scheduling_policy="priority"`.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} "
                             "prompts; give one per prompt")
        engine = self.engine
        # Process everything first so a bad prompt raises before anything is queued.
        requests = [
            _process(engine, prompt, params, i,
                     SchedulingOptions(priority=priority[i]) if priority is not None else None)
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True))
        ]
        request_ids: list[str] = []
        for i, request in enumerate(requests):
            try:
                engine.add_processed(request, RequestOutputKind.FINAL_ONLY)
            except ValueError as exc:
                for request_id in request_ids:  # all or nothing: leave no stray work queued
                    engine.abort_request(request_id)
                raise ValueError(f"prompts[{i}]: {exc}") from None
            request_ids.append(request.request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Chat | Sequence[Chat],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the model's chat template)."""
        chats = [messages] if is_chat(messages) else list(messages)
        return self.generate(chats, sampling_params, use_tqdm, priority)  # type: ignore[arg-type]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        engine.core.close_input()  # the static form may run its last, partial batch
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm)
        num_tokens = 0
        try:
            while engine.has_unfinished():
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        results[output.request_id] = output
                        num_tokens += output.num_generated_tokens
                        bar.update(1)
                        elapsed = max(bar.format_dict["elapsed"], 1e-9)
                        bar.set_postfix(out_tok_s=f"{num_tokens / elapsed:.1f}")
        finally:
            engine.core.close_input(False)
            bar.close()
        return [results[rid] for rid in request_ids]


def _process(
    engine: LLMEngine,
    prompt: Prompt,
    params: SamplingParams,
    index: int,
    scheduling: SchedulingOptions | None,
) -> EngineRequest:
    try:
        return engine.processor.process(prompt, params, scheduling=scheduling)
    except ValueError as exc:
        raise ValueError(f"prompts[{index}]: {exc}") from None


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, Sequence) and not isinstance(prompts, str) and len(prompts) == 0:
        return []
    if isinstance(prompts, str) or is_token_ids(prompts) or is_chat(prompts):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string or a list, got {type(prompts).__name__}")
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params_list = list(params)
    if len(params_list) != n:
        raise ValueError(
            f"sampling_params has {len(params_list)} entries for {n} prompts; give one or {n}"
        )
    return params_list
