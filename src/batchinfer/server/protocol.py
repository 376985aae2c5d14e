"""Request schemas of the OpenAI-compatible API, and their conversion to `SamplingParams`.

Fields are OpenAI's names. Every field of OpenAI's request schemas is honoured, refused with a
400 naming it, or accepted and ignored because it cannot change the output (`user`, `store`,
`metadata`, ...): docs/server.md has the table, field by field. Extensions: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`; scheduling: `priority` (int, lower first), `service_tier`
(`interactive` | `batch`, or OpenAI's `auto` / `default` / `priority` / `flex`; also the
`X-Service-Tier` header) and `timeout` (seconds a request may wait in the queue). Other unknown
fields are ignored, as OpenAI-compatible servers do, except the extensions other servers use to
change the output (`guided_json`, `structured_outputs`, ...), which are refused by name.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field

from batchinfer.core.request import SchedulingOptions
from batchinfer.core.sampling_params import SamplingParams
from batchinfer.core.validation import ParamError
from batchinfer.server.errors import UnicodeChecked
from batchinfer.server.output_form import (
    ToolUse,
    logit_bias_of,
    structured_output_of,
    tool_use_of,
)

# Bounds of the request body, so one request cannot ask for unbounded work.
MAX_N = 16
MAX_PROMPTS = 256
MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]
MAX_STOP = 64  # stop strings (or ids) per request: each is checked at every step
# `service_tier` values -> priority class (None: the class the request's priority falls in).
SERVICE_TIERS: dict[str, str | None] = {
    "interactive": "interactive", "batch": "batch",
    "auto": None, "default": None, "priority": "interactive", "flex": "batch",
}


# Fields that would change the output and that batchinfer does not honour (yet): given with
# any value but their no-op ones, they are refused by name. OpenAI's own first, then the
# extensions other servers take for token filtering and beam search.
REFUSED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "moderation": (None,),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "logits_processors": (None, []),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
}
# Fields that only mean something with another field (OpenAI's rules): refused without it.
NEEDS: dict[str, tuple[str, str]] = {"tool_choice": ("tools", "tools are given"),
                                     "parallel_tool_calls": ("tools", "tools are given"),
                                     "stream_options": ("stream", "stream is true")}


class _Schema(UnicodeChecked):
    # Strict types: "8" or true is no max_tokens and "yes" no stream flag; a client that sends
    # them has a bug that coercion would hide. (Integers are still taken for float fields.)
    # NaN and infinities are no value of any field.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Schema):
    include_usage: bool = False


class _SamplingFields(_Schema):
    """Fields shared by `/v1/completions` and `/v1/chat/completions`."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int | None = None
    service_tier: str | None = None
    timeout: float | None = Field(default=None, ge=0.0)
    # the output's form (server/output_form.py): checked there, in our words
    logit_bias: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # refused (REFUSED, NEEDS): declared so that their presence is seen
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    logits_processors: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None

    def check_supported(self) -> None:
        """`ParamError` naming the first field given that batchinfer cannot honour."""
        for name, no_ops in REFUSED.items():
            value = getattr(self, name)
            if name in self.model_fields_set and not any(value == v for v in no_ops):
                raise ParamError(f"{name} is not supported by this server", name)
        for name, (needed, when) in NEEDS.items():
            if getattr(self, name) is not None and not getattr(self, needed):
                raise ParamError(f"{name} is only allowed when {when}", name)

    @property
    def constraint_field(self) -> str | None:
        """The field that constrains the output (`response_format`, `guided_json`, ...)."""
        return structured_output_of(self)[1]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def scheduling(self, header_tier: str | None = None) -> SchedulingOptions:
        """The request's scheduling options; the body's `service_tier` wins over the header's.
        `ParamError` for an unknown tier."""
        tier, param = self.service_tier, "service_tier"
        if tier is None and header_tier is not None:
            tier, param = header_tier.strip().lower(), "X-Service-Tier"
        if tier is not None and tier not in SERVICE_TIERS:
            raise ParamError(f"{param} must be one of {', '.join(SERVICE_TIERS)}; got {tier!r}",
                             "service_tier")
        try:
            return SchedulingOptions(
                priority=self.priority,
                service_tier=SERVICE_TIERS[tier] if tier is not None else None,
                timeout_s=self.timeout,
                max_tokens_fixed=bool({"max_tokens", "max_completion_tokens"}
                                      & self.model_fields_set),
            )
        except ValueError as exc:
            raise ParamError(str(exc), _param_of(str(exc))) from None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self.check_supported()
        structured_output, _ = structured_output_of(self)
        values: dict[str, Any] = {
            "n": self.n,
            "structured_output": structured_output,
            "logit_bias": logit_bias_of(self.logit_bias),
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise ParamError(str(exc), _param_of(str(exc))) from None


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`: `prompt` is a string, a list of strings, a list of token ids or a
    list of such lists (one choice group per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list; `ParamError` if empty or too many."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts: list[Any] = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise ParamError("prompt must not be empty", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ParamError(f"prompt: at most {MAX_PROMPTS} prompts per request", "prompt")
        return prompts

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise ParamError("echo is not supported", "echo")
        if self.suffix:  # "" appends nothing
            raise ParamError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of is not supported (only best_of == n)", "best_of")
        if self.tools:
            raise ParamError("tools are taken by /v1/chat/completions only", "tools")
        return self._sampling_params(self.max_tokens, self.logprobs)


class ContentPart(_Schema):
    type: str
    text: str | None = None


class ChatMessage(_Schema):
    # "function" is OpenAI's legacy role: taken here so that its refusal can say so.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # passed to the chat template, which renders it if it knows how
    tool_call_id: str | None = None
    tool_calls: Any = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None


def render_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as `{"role", "content"[, "name", "tool_calls", "tool_call_id"]}` dicts for the
    chat template; text parts only. An assistant's `tool_calls` are OpenAI's function calls;
    a `tool` message answers one of them by `tool_call_id` (and gets its function's `name`).
    `ParamError` (param `messages`) for what the template cannot be given."""
    chat: list[dict[str, Any]] = []
    called: dict[str, str] = {}  # ids of the calls made so far -> their functions' names
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role == "function":
            raise ParamError(f"{where}: the role 'function' (legacy function calling) is not "
                             "supported", "messages")
        for name in ("function_call", "audio", "refusal"):
            if getattr(message, name) is not None:
                raise ParamError(f"{where}.{name} is not supported by this server", "messages")
        if message.tool_calls is not None and message.role != "assistant":
            raise ParamError(f"{where}.tool_calls: only an assistant message makes tool calls",
                             "messages")
        if message.role == "tool" and message.tool_call_id not in called:
            what = ("needs its tool_call_id" if message.tool_call_id is None
                    else "must answer a tool call of a preceding assistant message")
            raise ParamError(f"{where}: a tool message {what}", "messages")
        content = message.content
        if content is None and message.role != "assistant":  # an empty assistant turn is ""
            raise ParamError(f"{where}.content is required for a {message.role} message",
                             "messages")
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise ParamError(f"{where}.content: only text parts are supported", "messages")
            content = "\n".join(part.text or "" for part in content)
        rendered: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            rendered["name"] = message.name
        if message.tool_calls is not None:
            rendered["tool_calls"] = _tool_calls(where, message.tool_calls)
            called.update((c["id"], c["function"]["name"]) for c in rendered["tool_calls"])
        if message.role == "tool" and message.tool_call_id is not None:
            rendered["tool_call_id"] = message.tool_call_id
            rendered.setdefault("name", called[message.tool_call_id])
        chat.append(rendered)
    return chat


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant's `tool_calls` as OpenAI writes them, checked."""
    if not isinstance(calls, list) or not calls:
        raise ParamError(f"{where}.tool_calls must be a non-empty list", "messages")
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and isinstance(call.get("id"), str)
                and call.get("type", "function") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)):
            raise ParamError(f'{where}.tool_calls[{j}] must be {{"id", "type": "function", '
                             '"function": {"name", "arguments"}} with strings', "messages")
        checked.append({"id": call["id"], "type": "function",
                        "function": {"name": function["name"],
                                     "arguments": function["arguments"]}})
    return checked


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`: the model's chat template renders `messages`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def chat(self) -> list[dict[str, Any]]:
        """The messages for the chat template (`render_messages`); the request's other fields
        are checked by `sampling_params`, which the handler calls first."""
        return render_messages(self.messages)

    def tool_use(self) -> ToolUse | None:
        """The request's tools and tool choice, checked (`ParamError` naming the field)."""
        return tool_use_of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        try:
            return self._sampling_params(max_tokens, logprobs)
        except ParamError as exc:
            renamed = {"logprobs": "top_logprobs"}
            if self.max_completion_tokens is not None:
                renamed["max_tokens"] = "max_completion_tokens"
            exc.param = renamed.get(exc.param or "", exc.param)
            raise


class TokenizeRequest(_Schema):
    """`POST /tokenize` (vLLM's shape): a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: Any = None  # rendered with the messages, as a chat request's are
    add_special_tokens: bool = True


class DetokenizeRequest(_Schema):
    model: str | None = None
    tokens: list[int]


def _param_of(message: str) -> str | None:
    """The field a `SamplingParams` error names (its messages start with the field's name)."""
    match = re.match(r"[a-z_]+", message)
    return match.group(0) if match else None
