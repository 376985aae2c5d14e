"""What the generative endpoints do between parsing and the wire: run the prompts on `AsyncLLM`,
stream SSE chunks or build the final body, abort on disconnect, map engine errors to HTTP.

Streams carry the engine's DELTA outputs straight to the wire (each token's text is handled
once); a client that reads slower than the engine steps gets fewer, larger chunks and never a
backlog. Non-streamed requests ask the engine for one FINAL_ONLY output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchinfer.core.request import SchedulingOptions
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.core.structured_output import StructuredOutput
from batchinfer.core.validation import ParamError
from batchinfer.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    QueueFullError,
    QueueTimeoutError,
    RequestFailedError,
)
from batchinfer.engine.inputs import Prompt
from batchinfer.engine.outputs import RequestOutput, RequestOutputKind
from batchinfer.engine.processor import EngineRequest
from batchinfer.runner.structured import tool_call_tag
from batchinfer.server.disconnect import unless_disconnected
from batchinfer.server.errors import APIError, to_api_error
from batchinfer.server.output_form import OutputForm, ToolUse, tool_use_of
from batchinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    render_messages,
)
from batchinfer.server.rendering import Event, Kind, Renderer, sse_line

logger = logging.getLogger(__name__)
_ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}
RETRY_AFTER_S = 1


class OpenAIServing:
    """The completions and chat endpoints of one served model."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self._token_texts: dict[int, str] = {}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        params = _checked(body.sampling_params)
        prompts: list[Prompt] = list(_checked(body.prompts))
        scheduling = _checked(lambda: body.scheduling(request.headers.get("x-service-tier")))
        form = OutputForm(params.structured_output, _checked(lambda: body.constraint_field))
        return await self._run("completion", prompts, params, scheduling, body.stream,
                               body.include_usage, "max_tokens", request, form)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        params = _checked(body.sampling_params)
        chat = _checked(body.chat)
        tools = _checked(body.tool_use)
        scheduling = _checked(lambda: body.scheduling(request.headers.get("x-service-tier")))
        form = OutputForm(params.structured_output, _checked(lambda: body.constraint_field),
                          tools)
        if tools is not None and tools.forced:
            params, form = self._forced_tool_call(params, form, tools)
        max_tokens_param = "max_tokens"
        if body.max_completion_tokens is not None:
            max_tokens_param = "max_completion_tokens"
        return await self._run("chat", [chat], params, scheduling, body.stream,
                               body.include_usage, max_tokens_param, request, form)

    def _forced_tool_call(
        self, params: SamplingParams, form: OutputForm, tools: ToolUse
    ) -> tuple[SamplingParams, OutputForm]:
        """`tool_choice` required or a named function: the grammar of a call in the model's
        tool syntax constrains the output."""
        if form.structured_output is not None:
            raise APIError(400, f"tool_choice {tools.choice} cannot be combined with "
                           f"{form.param}: the tool call is the output's form", param="tool_choice")
        try:
            tag = tool_call_tag(self.tool_format, tools.tools, tools.tool_choice, tools.parallel)
            spec = StructuredOutput(structural_tag=json.dumps(tag))
        except ValueError as exc:
            raise APIError(400, f"tool_choice: {exc}", param="tool_choice") from None
        return dataclasses.replace(params, structured_output=spec), \
            OutputForm(spec, "tools", tools)

    @property
    def tool_format(self) -> str:
        return self.llm.engine.processor.tool_format

    async def _run(
        self,
        kind: Kind,
        prompts: list[Prompt],
        params: SamplingParams,
        scheduling: SchedulingOptions,
        stream: bool,
        include_usage: bool,
        max_tokens_param: str,
        request: Request,
        form: OutputForm,
    ) -> Response:
        response_id = f"{_ID_PREFIX[kind]}-{uuid.uuid4().hex}"
        ids = [response_id]
        if len(prompts) > 1:
            ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        # Every prompt is tokenized and validated (off the loop) before any is queued.
        requests = await asyncio.to_thread(self._process, prompts, params, scheduling, ids,
                                         max_tokens_param, form)
        self._check_capacity(requests)
        output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        events = _merge(self.llm.generate_many(requests, output_kind))
        reads_calls = form.tools is not None and form.tools.choice != "none"
        render = Renderer(kind, response_id, self.model_name, params.n, self.token_text,
                           self.tool_format if reads_calls else None)
        if not stream:
            try:
                finals = await _unless_disconnected(_last_per_prompt(events), request)
            finally:
                await events.aclose()  # aborts what has not finished
            if finals is None:  # the client left: nobody reads this
                return Response(status_code=499)
            return JSONResponse(render.response(finals))
        try:
            # The first output (or error) before the headers: a rejected request gets its
            # status. A client that leaves meanwhile (queued, or prefilling) aborts it.
            first = await _unless_disconnected(anext(events), request)
        except BaseException:
            await events.aclose()
            raise
        if first is None:
            await events.aclose()
            return Response(status_code=499)
        return StreamingResponse(
            self._sse(render, first, events, include_usage, request),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
        )

    async def _sse(
        self,
        render: Renderer,
        first: Event,
        events: AsyncGenerator[Event, None],
        include_usage: bool,
        request: Request,
    ) -> AsyncIterator[bytes]:
        try:
            yield render.chunks(first)
            async for event in events:
                data = render.chunks(event)
                if data:
                    yield data
            if include_usage:
                yield render.usage_chunk()
        except Exception as exc:  # after the 200: the error goes in the stream
            error = _api_error(exc, request)
            if error.status_code >= 500:
                logger.error("stream %s failed: %s", render.response_id, exc)
            yield sse_line({"error": error.body()["error"]})
        finally:
            await events.aclose()
        yield b"data: [DONE]\n\n"

    def _process(
        self, prompts: list[Prompt], params: SamplingParams, scheduling: SchedulingOptions,
        ids: list[str], max_tokens_param: str, form: OutputForm,
    ) -> list[EngineRequest]:
        processor = self.llm.engine.processor
        max_model_len = self.llm.max_model_len
        tools = form.tools.tools if form.tools is not None else None
        requests = []
        for i, (prompt, request_id) in enumerate(zip(prompts, ids, strict=True)):
            where = f"prompt[{i}]: " if len(prompts) > 1 else ""
            try:
                request = processor.process(prompt, params, request_id, scheduling=scheduling,
                                            tools=tools)
            except ValueError as exc:  # the prompt's, or a field checked against the model
                param = getattr(exc, "param", "prompt")
                if param == "structured_output" and form.param is not None:
                    param = form.param  # the field the client wrote
                    exc = ValueError(str(exc).replace("structured_output", form.param, 1))
                prefix = where if param == "prompt" else ""
                raise APIError(400, f"{prefix}{exc}", param=param) from None
            num_prompt = len(request.prompt_token_ids)
            if params.max_tokens is not None and num_prompt + params.max_tokens > max_model_len:
                # vLLM's rule: refuse rather than silently cut the output short.
                raise APIError(400, f"{where}{max_tokens_param} {params.max_tokens} + the prompt's "
                               f"{num_prompt} tokens exceed max_model_len {max_model_len}; "
                               f"at most {max_model_len - num_prompt} can be generated",
                               param=max_tokens_param)
            requests.append(request)
        return requests

    def _check_capacity(self, requests: list[EngineRequest]) -> None:
        """400 for a request with more sequences (prompts x n) than the server can ever hold
        at once (`max_num_seqs` running + `max_num_queued_requests` waiting): a 429 would
        invite retries that can never succeed."""
        limit = self.llm.max_num_queued_requests
        if limit is None:
            return
        capacity = limit + self.llm.engine.config.max_num_seqs
        num_sequences = sum(len(r.sequences) for r in requests)
        if num_sequences > capacity:
            raise APIError(400, f"the request holds {num_sequences} sequences (prompts x n) but "
                           f"this server holds at most {capacity} at once (max_num_seqs + "
                           "max_num_queued_requests); split it", param="prompt")

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's `/tokenize`: `{"tokens", "count", "max_model_len"}`."""
        if (messages := body.messages) is not None:
            chat = _checked(lambda: render_messages(messages))
            tools = _checked(lambda: tool_use_of(body.tools, None, None))
            _, token_ids = self.llm.tokenize(chat, tools.tools if tools is not None else None)
        elif body.prompt is not None:
            tokenizer = self.llm.tokenizer
            token_ids = list(tokenizer.encode(body.prompt,
                                              add_special_tokens=body.add_special_tokens))
        else:
            raise APIError(400, "give a prompt or messages", param="prompt")
        return {"tokens": token_ids, "count": len(token_ids),
                "max_model_len": self.llm.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's `/detokenize`: `{"prompt": text}`."""
        vocab_size = self.llm.engine.processor.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab_size}), got {bad[0]}",
                           param="tokens")
        return {"prompt": self.llm.tokenizer.decode(body.tokens)}

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.llm.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text


# --------------------------------------------------------------------------- errors
def _checked(build: Any) -> Any:
    """Call a schema's converter; its `ParamError` becomes a 400 naming the field."""
    try:
        return build()
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None


async def _engine_call(awaitable: Any, request: Request) -> Any:
    try:
        return await awaitable
    except (QueueFullError, QueueTimeoutError, RequestFailedError, EngineDeadError) as exc:
        raise _api_error(exc, request) from None


def _api_error(exc: Exception, request: Request) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full",
                        headers={"retry-after": str(RETRY_AFTER_S)})
    if isinstance(exc, QueueTimeoutError):
        return APIError(503, str(exc), code="queue_timeout",
                        headers={"retry-after": str(RETRY_AFTER_S)})
    if isinstance(exc, RequestFailedError):
        header_id = request.headers.get("x-request-id")
        where = f" (X-Request-Id {header_id})" if header_id else ""
        return APIError(500, f"{exc}{where}", code="engine_error")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    return to_api_error(exc, request.headers.get("x-request-id"))


# --------------------------------------------------------------------------- streams
async def _merge(
    streams: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[Event, None]:
    """One stream of (prompt index, output) from the streams of several prompts. Closing it
    closes them all (which aborts whatever has not finished)."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output, None))
            queue.put_nowait((index, None, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, maybe_output, error = await queue.get()
            if error is not None:
                raise error
            if maybe_output is None:
                remaining -= 1
            else:
                yield index, maybe_output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _last_per_prompt(events: AsyncIterator[Event]) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for index, output in events:
        finals[index] = output
    return finals


async def _unless_disconnected(work: Any, request: Request) -> Any:
    """Await `work` (a generation, or a stream's first event) with engine errors mapped to
    HTTP; None, with `work` cancelled, if the client disconnects first."""
    return await unless_disconnected(_engine_call(work, request), request)
