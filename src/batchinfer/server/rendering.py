"""The JSON of one completions or chat response: streamed chunks from successive outputs, or
the final body. A chat request with tools (and `tool_choice` not `none`) has each choice's text
read by `ToolCallReader` in the model's tool syntax: calls become OpenAI's `tool_calls` (streamed
as a call's id and name, then `function.arguments` deltas), the rest stays `content`, and a
choice that called a tool and stopped ends with `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from batchinfer.core.outputs import TokenLogprobs
from batchinfer.engine.outputs import CompletionOutput, RequestOutput
from batchinfer.engine.tools import ToolCall, ToolCallDelta, ToolCallReader

Kind = Literal["completion", "chat"]
Event = tuple[int, RequestOutput]  # (prompt index, output)
_OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
_CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}
# JSON has no -inf: a token masked out by top-k / top-p reports this (as vLLM does).
_MIN_LOGPROB = -9999.0


@dataclass(slots=True)
class _ChoiceState:
    num_tokens: int = 0
    finished: bool = False
    role_sent: bool = False
    reader: ToolCallReader | None = field(default=None)


class Renderer:
    """Builds the JSON of one response: streamed chunks from successive outputs, or the final
    body; tracks what each choice has sent and the usage."""

    def __init__(
        self,
        kind: Kind,
        response_id: str,
        model: str,
        n: int,
        token_text: Any,
        tool_format: str | None = None,
    ) -> None:
        self.kind = kind
        self.tool_format = tool_format  # the tool syntax to read; None: text is content
        self.response_id = response_id
        self.model = model
        self.n = n
        self.token_text = token_text
        self.created = int(time.time())
        self.choices: dict[int, _ChoiceState] = {}
        self.prompt_tokens: dict[int, int] = {}

    # ---- streaming (DELTA outputs: each carries only what is new)
    def chunks(self, event: Event) -> bytes:
        prompt_index, output = event
        self.prompt_tokens[prompt_index] = output.num_prompt_tokens
        lines = []
        for completion in output.outputs:
            choice = self._delta(prompt_index * self.n + completion.index, completion)
            if choice is not None:
                lines.append(sse_line(self._envelope(_CHUNK_OBJECT[self.kind], [choice])))
        return b"".join(lines)

    def _delta(self, index: int, completion: CompletionOutput) -> dict[str, Any] | None:
        state = self.choices.setdefault(index, _ChoiceState())
        if state.finished:
            return None
        text = completion.text
        logprobs = completion.logprobs or []
        finished = completion.finish_reason is not None
        state.num_tokens += len(completion.token_ids)
        calls: list[ToolCallDelta] = []
        if self.kind == "chat" and self.tool_format is not None:
            if state.reader is None:
                state.reader = ToolCallReader(self.tool_format)
            text, calls = state.reader.feed(text, final=finished)
        if not text and not calls and not logprobs and not finished \
                and (state.role_sent or self.kind != "chat"):
            return None
        state.finished = finished
        has_logprobs = completion.logprobs is not None
        if self.kind == "completion":
            return self._completion_choice(index, text, logprobs if has_logprobs else None,
                                           completion)
        delta: dict[str, Any] = {"content": text} if text or not calls else {}
        if not state.role_sent:
            delta = {"role": "assistant", **delta}
            state.role_sent = True
        if calls:
            delta["tool_calls"] = [_call_delta(call) for call in calls]
        called = state.reader is not None and bool(state.reader.calls)
        return _with_extensions({
            "index": index,
            "delta": delta,
            "logprobs": self._chat_logprobs(logprobs) if has_logprobs else None,
            "finish_reason": _finish_reason(completion.finish_reason, called),
            "stop_reason": completion.stop_reason,
        }, completion)

    def usage_chunk(self) -> bytes:
        num_completion = sum(s.num_tokens for s in self.choices.values())
        body = self._envelope(_CHUNK_OBJECT[self.kind], [])
        body["usage"] = _usage(sum(self.prompt_tokens.values()), num_completion)
        return sse_line(body)

    # ---- whole response
    def response(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        choices = []
        num_prompt = num_completion = 0
        for prompt_index in sorted(finals):
            output = finals[prompt_index]
            num_prompt += output.num_prompt_tokens
            for completion in output.outputs:
                num_completion += len(completion.token_ids)
                index = prompt_index * self.n + completion.index
                logprobs = completion.logprobs
                if self.kind == "completion":
                    choices.append(self._completion_choice(index, completion.text, logprobs,
                                                           completion))
                    continue
                message, called = self._message(completion.text)
                choices.append(_with_extensions({
                    "index": index,
                    "message": message,
                    "logprobs": self._chat_logprobs(logprobs) if logprobs is not None else None,
                    "finish_reason": _finish_reason(completion.finish_reason, called),
                    "stop_reason": completion.stop_reason,
                }, completion))
        body = self._envelope(_OBJECT[self.kind], choices)
        body["usage"] = _usage(num_prompt, num_completion)
        return body

    def _message(self, text: str) -> tuple[dict[str, Any], bool]:
        """A whole chat choice's message, and whether it called a tool."""
        if self.tool_format is None:
            return {"role": "assistant", "content": text}, False
        reader = ToolCallReader(self.tool_format)
        content, _ = reader.feed(text, final=True)
        if not reader.calls:
            return {"role": "assistant", "content": content}, False
        return {"role": "assistant", "content": content.strip() or None,
                "tool_calls": [_call(call) for call in reader.calls]}, True

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}

    def _completion_choice(
        self,
        index: int,
        text: str,
        logprobs: Sequence[TokenLogprobs] | None,
        completion: CompletionOutput,
    ) -> dict[str, Any]:
        return _with_extensions({
            "index": index,
            "text": text,
            "logprobs": self._completion_logprobs(logprobs) if logprobs is not None else None,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }, completion)

    def _completion_logprobs(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [{self.token_text(t): _finite(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        return {"content": [
            dict(self._chat_token(e.token_id, e.logprob),
                 top_logprobs=[self._chat_token(t, lp) for t, lp in e.top])
            for e in entries
        ]}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _with_extensions(choice: dict[str, Any], completion: CompletionOutput) -> dict[str, Any]:
    """`elastic_max_tokens`: the cap that ended the choice ("length") when it was an elastic
    cap under KV pressure rather than the request's own max_tokens."""
    if completion.elastic_max_tokens is not None:
        choice["elastic_max_tokens"] = completion.elastic_max_tokens
    return choice


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that called a tool and stopped (not cut at `length`) ends with `tool_calls`."""
    return "tool_calls" if called and reason == "stop" else reason


def _call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


def _usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


def _finite(logprob: float) -> float:
    return logprob if logprob > _MIN_LOGPROB else _MIN_LOGPROB


def sse_line(body: dict[str, Any]) -> bytes:
    """One server-sent event holding `body` as JSON."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"
