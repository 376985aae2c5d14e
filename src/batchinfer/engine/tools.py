"""Tool calling around the chat template: rendering tools and earlier tool turns, and reading
the calls back out of a model's text, whole or as it streams.

- **Rendering.** A template that takes `tools` (Qwen 2.5 / 3, Hermes, Llama 3.1+, ... : its
  source names the variable) renders them itself, with assistant `tool_calls` and `tool`
  results as the messages carry them. A template that does not (the embedded SmolLM2's) gets
  `FALLBACK_SYSTEM_PROMPT`, a system turn listing the tools and the `hermes` syntax, and the
  earlier tool turns written in that syntax: calls as `<tool_call>` blocks in the assistant's
  text, results as `<tool_response>` blocks in a user turn.
- **Syntaxes** (`TOOL_FORMATS`): `hermes` — `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`, any number, text before them; `llama3_json` — `{"name": ..., "parameters":
  {...}}` objects (Llama 3.1 - 3.3, optionally after `<|python_tag|>`, `;`-separated).
  `tool_format_of(template)` picks one from the template's text.
- **Reading.** `ToolCallReader` takes the output as it grows and splits it into content and
  calls: text outside calls is content; inside a call, the name is given once complete and the
  arguments' JSON text as it arrives (what OpenAI streams as `function.arguments` deltas), so
  the deltas of a stream add up to the whole response's calls. A call that never becomes a
  JSON object with a name is given back as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_FORMATS = ("hermes", "llama3_json")
FALLBACK_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_PYTHON_TAG = "<|python_tag|>"


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders a `tools` list itself."""
    return template is not None and "tools" in template


def tool_format_of(template: str | None) -> str:
    """The tool-call syntax a chat template teaches: `llama3_json` where it writes Llama 3's
    `"parameters"` objects or `<|python_tag|>`, else `hermes` (also this module's fallback)."""
    if template is None or "<tool_call>" in template or not template_takes_tools(template):
        return "hermes"
    if _PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def render_tool_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_takes_them: bool,
) -> list[dict[str, Any]]:
    """The messages as the template is given them: as they are for a template that takes tools
    (assistant `tool_calls` with their arguments as objects, as templates expect), else with
    the fallback system prompt and the tool turns written in the `hermes` syntax."""
    if template_takes_them:
        return [_with_argument_objects(m) for m in messages]
    rendered: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_hermes_block(call) for call in message["tool_calls"]]
            text = "\n".join(filter(None, [message.get("content") or "", *blocks]))
            rendered.append({"role": "assistant", "content": text})
        elif role == "tool":
            rendered.append({"role": "user", "content": "<tool_response>\n"
                             f"{message.get('content') or ''}\n</tool_response>"})
        else:
            rendered.append({k: v for k, v in message.items() if k != "tool_calls"})
    if tools:
        listing = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
        prompt = FALLBACK_SYSTEM_PROMPT.format(tools=listing)
        if rendered and rendered[0].get("role") in ("system", "developer"):
            rendered[0] = dict(rendered[0], content=f"{rendered[0]['content']}\n\n{prompt}")
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def _arguments_object(arguments: Any) -> Any:
    """A call's `arguments` JSON text as an object where it is one (templates write it with
    `tojson`), else as it is."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def _with_argument_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [
            dict(call, function=dict(call["function"],
                                     arguments=_arguments_object(call["function"]["arguments"])))
            for call in message["tool_calls"]]
    return out


def _hermes_block(call: Mapping[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": _arguments_object(function["arguments"])}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


# --------------------------------------------------------------------------- reading calls
@dataclass(slots=True)
class ToolCallDelta:
    """What one call gained: its `id` and `name` come once, in its first delta."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class _Syntax:
    begin: str  # what opens a call ("" : the call is the JSON object itself)
    end: str  # what closes it after its object
    argument_keys: tuple[str, ...]
    separators: str  # what may stand between two calls


_SYNTAXES = {
    "hermes": _Syntax("<tool_call>", "</tool_call>", ("arguments",), " \t\r\n"),
    "llama3_json": _Syntax("", "", ("parameters", "arguments"), " \t\r\n;"),
}


@dataclass(slots=True)
class _ObjectScan:
    """How far a call's JSON object has been read: its name once its string is complete, the
    span of its arguments' value, its end."""

    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None
    end: int | None = None
    broken: bool = False


def _scan_object(text: str, start: int, argument_keys: tuple[str, ...]) -> _ObjectScan:
    """Read the JSON object that starts at `text[start]` ("{") as far as it goes."""
    scan = _ObjectScan()
    depth = 0
    in_string = escaped = False
    key: str | None = None
    string_start = 0
    expecting = "key"  # at depth 1: "key", "colon", "value", "comma"
    i = start
    while i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 1:
                    literal = text[string_start : i + 1]
                    if expecting == "key":
                        key, expecting = _json_string(literal), "colon"
                    elif expecting == "value":
                        if key == "name":
                            scan.name = _json_string(literal)
                        elif key in argument_keys:
                            scan.arguments_end = i + 1
                        expecting = "comma"
        elif ch == '"':
            in_string = True
            string_start = i
            if depth == 1 and expecting == "value" and key in argument_keys:
                scan.arguments_start = i
        elif ch in "{[":
            if depth == 1 and expecting == "value" and key in argument_keys:
                scan.arguments_start = i
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 1 and expecting == "value":  # a container value closed
                if key in argument_keys:
                    scan.arguments_end = i + 1
                expecting = "comma"
            elif depth == 0:
                if ch != "}" or expecting not in ("comma", "key", "scalar"):
                    scan.broken = True
                _close_scalar(scan, text, key, i, argument_keys, expecting)
                scan.end = i + 1
                return scan
        elif depth == 1:
            if ch == ":" and expecting == "colon":
                expecting = "value"
            elif ch == ",":
                _close_scalar(scan, text, key, i, argument_keys, expecting)
                expecting = "key"
            elif ch not in " \t\r\n" and expecting == "value":
                if key in argument_keys:  # a number, true, false or null
                    scan.arguments_start = i
                expecting = "scalar"
            elif ch not in " \t\r\n" and expecting not in ("scalar",):
                scan.broken = True
                return scan
        i += 1
    return scan


def _close_scalar(scan: _ObjectScan, text: str, key: str | None, end: int,
                  argument_keys: tuple[str, ...], expecting: str) -> None:
    """A number, true, false or null value ends at `end` (a comma or the closing brace)."""
    if expecting == "scalar" and key in argument_keys:
        scan.arguments_end = len(text[:end].rstrip())


def _json_string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


@dataclass(slots=True)
class _OpenCall:
    index: int
    start: int  # where its JSON object starts in the text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    announced: bool = False
    arguments_sent: int = 0  # characters of the arguments given so far


class ToolCallReader:
    """Splits one choice's growing output into content and tool calls (`feed` each new piece
    of text; `final=True` with the last). Calls are numbered from 0 in order."""

    def __init__(self, tool_format: str) -> None:
        if tool_format not in _SYNTAXES:
            raise ValueError(f"tool_format must be one of {', '.join(TOOL_FORMATS)}, got "
                             f"{tool_format!r}")
        self.syntax = _SYNTAXES[tool_format]
        self.text = ""
        self.calls: list[ToolCall] = []
        self._position = 0  # the text before it has been given out (as content or calls)
        self._open: _OpenCall | None = None

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The content and call deltas that `text` (appended to the output) completes."""
        self.text += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            call = self._open
            if call is None:
                call = self._open_next(content, final)
                if call is None:
                    break
            if not self._advance(call, deltas, content, final):
                break
        return "".join(content), deltas

    # ---- between calls
    def _open_next(self, content: list[str], final: bool) -> _OpenCall | None:
        """Give out the content before the next call and open it; None when no call has
        begun (the content that cannot be the start of one is given out)."""
        begin = self._next_begin()
        if begin is None:
            content.append(self._take_content(final))
            return None
        before = self.text[self._position : begin]
        if not (self.calls and _is_separator(before, self.syntax)):  # not content
            content.append(before)
        self._position = begin
        body = self._body_start(begin)
        if body is None:  # its opening is not all here yet
            if final:
                content.append(self._take_content(True))
            return None
        self._open = _OpenCall(len(self.calls), body)
        return self._open

    def _next_begin(self) -> int | None:
        """Where the next call begins at or after the position, if it has begun."""
        head = self.text[self._position :]
        if self.syntax.begin:
            found = head.find(self.syntax.begin)
            return None if found < 0 else self._position + found
        # llama3_json: an output is calls only when it starts with one (after the python tag)
        if self.calls or self._position == 0:
            stripped = head.lstrip(self.syntax.separators)
            body = stripped
            if body.startswith(_PYTHON_TAG) and not self.calls:
                body = body[len(_PYTHON_TAG) :].lstrip()
            if body.startswith("{"):
                return len(self.text) - len(stripped)
        return None

    def _take_content(self, final: bool) -> str:
        """Text from the position that can no longer begin a call; the rest waits."""
        end = len(self.text)
        head = self.text[self._position :]
        if not final:
            if self.syntax.begin:
                end -= _partial_suffix(head, self.syntax.begin)
            elif self.calls or self._position == 0:  # llama3_json: a call may still start
                stripped = head.lstrip(self.syntax.separators)
                if _PYTHON_TAG.startswith(stripped) or (
                        not self.calls and stripped.startswith(_PYTHON_TAG)
                        and not stripped[len(_PYTHON_TAG) :].strip()):
                    end = self._position
        piece = self.text[self._position : end]
        if self.calls and piece and _is_separator(piece, self.syntax):  # after a call
            if not final:
                return ""
            piece = ""
        self._position = end
        return piece

    def _body_start(self, begin: int) -> int | None:
        """Where a call's JSON object starts (the first non-space after its opening), or None
        while it has not arrived."""
        i = begin + len(self.syntax.begin)
        if not self.syntax.begin and self.text.startswith(_PYTHON_TAG, i):
            i += len(_PYTHON_TAG)
        while i < len(self.text) and self.text[i] in " \t\r\n":
            i += 1
        return i if i < len(self.text) else None

    # ---- inside a call
    def _advance(self, call: _OpenCall, deltas: list[ToolCallDelta], content: list[str],
                 final: bool) -> bool:
        """Give out what the open call has gained; True when it closed and more may follow."""
        scan = _scan_object(self.text, call.start, self.syntax.argument_keys) \
            if self.text[call.start] == "{" else _ObjectScan(broken=True)
        if scan.broken or (final and (scan.end is None or scan.name is None)):
            end = len(self.text) if scan.end is None else scan.end
            if call.announced or scan.name is not None:  # named: a call, cut short or not
                self._finish(call, scan, deltas)
            else:  # never a call: its text is content
                content.append(self.text[self._position : end])
            self._position = end
            self._open = None
            return end < len(self.text)
        if scan.name is not None and not call.announced:
            call.announced = True
            deltas.append(ToolCallDelta(call.index, "", call.id, scan.name))
        start = scan.arguments_start
        if call.announced and start is not None and self.text[start] != '"':
            upto = scan.arguments_end if scan.arguments_end is not None else len(self.text)
            piece = self.text[start + call.arguments_sent : upto]
            if piece:
                deltas.append(ToolCallDelta(call.index, piece))
                call.arguments_sent += len(piece)
        if scan.end is None:
            return False
        end = scan.end
        closing = self.syntax.end
        if closing:
            rest = self.text[end:]
            stripped = rest.lstrip()
            if stripped.startswith(closing):
                end += len(rest) - len(stripped) + len(closing)
            elif not final and closing.startswith(stripped):
                return False  # the closing marker is still arriving
        self._finish(call, scan, deltas)
        self._position = end
        self._open = None
        return True

    def _finish(self, call: _OpenCall, scan: _ObjectScan, deltas: list[ToolCallDelta]) -> None:
        """Close a call: announce it if it was not, give out the rest of its arguments."""
        if not call.announced:
            deltas.append(ToolCallDelta(call.index, "", call.id, scan.name or ""))
            call.announced = True
        arguments = "{}"
        if scan.arguments_start is not None:
            end = scan.arguments_end if scan.arguments_end is not None else len(self.text)
            arguments = self.text[scan.arguments_start : end]
            if arguments.startswith('"'):  # arguments written as a JSON string of JSON
                decoded = _json_string(arguments)
                arguments = decoded if decoded is not None else arguments
        rest = arguments[call.arguments_sent :]
        if rest:
            deltas.append(ToolCallDelta(call.index, rest))
        self.calls.append(ToolCall(call.id, scan.name or "", arguments))


def _is_separator(text: str, syntax: _Syntax) -> bool:
    return not text.strip(syntax.separators)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def read_tool_calls(text: str, tool_format: str) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls (what `ToolCallReader` gives out, at once)."""
    reader = ToolCallReader(tool_format)
    content, _ = reader.feed(text, final=True)
    return content, reader.calls
