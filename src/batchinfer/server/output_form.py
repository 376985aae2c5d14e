"""What a request asks of its output's form: structured outputs (`response_format`, and the
extensions vLLM users send: `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, `structured_outputs`), tool calling (`tools`, `tool_choice`,
`parallel_tool_calls`) and `logit_bias`, read from a request body into plain values.

Each reader raises `ParamError` naming the field the client wrote; the engine's own checks
(a schema that does not compile) name `structured_output`, which `OutputForm.param` maps back
to the field the request used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchinfer.core.structured_output import StructuredOutput
from batchinfer.core.validation import ParamError

# Fields that constrain the output, each on its own (at most one per request).
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs")
# `structured_outputs` (vLLM's object): its constraint keys -> ours; options that change
# nothing here (our JSON never has free whitespace and is strict about extra properties).
_STRUCTURED_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
                    "choice": "choice", "grammar": "grammar", "structural_tag": "structural_tag"}
_STRUCTURED_NO_OPS = ("disable_fallback", "disable_any_whitespace",
                      "disable_additional_properties")
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 300  # tokens per request, as OpenAI allows
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(slots=True)
class ToolUse:
    """A chat request's tools: `tools` as OpenAI's function tools (what the template gets),
    `choice` one of `TOOL_CHOICES` or `"function"` with `function` the forced name."""

    tools: list[dict[str, Any]]
    choice: str
    function: str | None
    parallel: bool

    @property
    def forced(self) -> bool:
        """A call is required (`required` or a named function): the grammar makes it."""
        return self.choice in ("required", "function")

    @property
    def tool_choice(self) -> Any:
        """`tool_choice` as OpenAI writes it."""
        if self.function is not None:
            return {"type": "function", "function": {"name": self.function}}
        return self.choice


@dataclass(slots=True)
class OutputForm:
    """A request's constraint (or None) and the field it came from; its tools (or None)."""

    structured_output: StructuredOutput | None = None
    param: str | None = None
    tools: ToolUse | None = None


def structured_output_of(body: Any) -> tuple[StructuredOutput | None, str | None]:
    """The constraint a body's fields ask for and the field that asked; `ParamError` for a bad
    value or for two constraints at once."""
    given = [name for name in CONSTRAINT_FIELDS
             if getattr(body, name, None) is not None and not _is_text_format(body, name)]
    if not given:
        return None, None
    if len(given) > 1:
        raise ParamError(f"{given[1]} cannot be combined with {given[0]}: give one constraint "
                         "on the output", given[1])
    name = given[0]
    value = getattr(body, name)
    try:
        return _read_constraint(name, value), name
    except ValueError as exc:
        message = str(exc).replace("structured_output.", f"{name}: ", 1) \
            if str(exc).startswith("structured_output.") else str(exc)
        raise ParamError(message, name) from None


def _is_text_format(body: Any, name: str) -> bool:
    return name == "response_format" and body.response_format == {"type": "text"}


def _read_constraint(name: str, value: Any) -> StructuredOutput:
    if name == "response_format":
        return _response_format(value)
    if name == "guided_json":
        return StructuredOutput(json_schema=value)
    if name == "guided_regex":
        return StructuredOutput(regex=value)
    if name == "guided_choice":
        return StructuredOutput(choice=value)
    if name == "guided_grammar":
        return StructuredOutput(grammar=value)
    return _structured_outputs(value)


def _response_format(value: Any) -> StructuredOutput:
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) \
                or not _TOOL_NAME.fullmatch(spec["name"]):
            raise ValueError("response_format.json_schema must be an object with a name (1-64 "
                             'of a-z, A-Z, 0-9, "_", "-") and a schema')
        if "schema" not in spec:
            raise ValueError("response_format.json_schema.schema is required")
        if spec.get("strict") not in (None, True, False):
            raise ValueError("response_format.json_schema.strict must be true or false")
        return StructuredOutput(json_schema=spec["schema"])
    if kind == "structural_tag":
        return StructuredOutput(structural_tag=json.dumps(value))
    raise ValueError("response_format.type must be one of text, json_object, json_schema, "
                     f"structural_tag; got {kind!r}")


def _structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, Mapping):
        raise ValueError("structured_outputs must be an object")
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS) - set(_STRUCTURED_NO_OPS))
    if unknown:
        raise ValueError(f"structured_outputs.{unknown[0]} is not supported; its keys are "
                         f"{', '.join(_STRUCTURED_KEYS)}")
    given = {ours: value[key] for key, ours in _STRUCTURED_KEYS.items()
             if value.get(key) not in (None, False)}
    if len(given) != 1:
        raise ValueError("structured_outputs needs exactly one of "
                         f"{', '.join(_STRUCTURED_KEYS)}")
    return StructuredOutput(**given)


# --------------------------------------------------------------------------- tools
def tool_use_of(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolUse | None:
    """A chat request's tools, checked: `ParamError` naming `tools`, `tool_choice` or
    `parallel_tool_calls`. None without tools (`tool_choice` is then refused earlier)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ParamError(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    checked = [_tool(i, tool) for i, tool in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise ParamError(f"tools: the function names must differ; {_first_repeat(names)!r} "
                         "is given twice", "tools")
    if parallel_tool_calls not in (None, True, False):
        raise ParamError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in TOOL_CHOICES:
        return ToolUse(checked, tool_choice or "auto", None, parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not (isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function"
            and isinstance(function, Mapping) and isinstance(function.get("name"), str)):
        raise ParamError("tool_choice must be none, auto, required or "
                         '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if function["name"] not in names:
        raise ParamError(f"tool_choice names the function {function['name']!r}, which is not "
                         "among tools", "tool_choice")
    return ToolUse(checked, "function", function["name"], parallel)


def _tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(tool, Mapping) or tool.get("type") != "function" \
            or not isinstance(function, Mapping):
        raise ParamError(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ParamError(f'{where}.function.name must be 1-64 of a-z, A-Z, 0-9, "_", "-"; got '
                         f"{name!r}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ParamError(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is not None:
        try:
            StructuredOutput(json_schema=parameters)
        except ValueError as exc:
            raise ParamError(str(exc).replace("structured_output.json_schema",
                                              f"{where}.function.parameters"), "tools") from None
    out: dict[str, Any] = {"name": name}
    if description is not None:
        out["description"] = description
    if parameters is not None:
        out["parameters"] = dict(parameters)
    return {"type": "function", "function": out}


def _first_repeat(names: list[str]) -> str:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return ""


# --------------------------------------------------------------------------- logit_bias
def logit_bias_of(value: Any) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as JSON object keys, so strings) as ids -> biases;
    `ParamError` naming `logit_bias`. The biases' range is `SamplingParams`' check."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ParamError("logit_bias must map token ids to biases", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise ParamError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        if not isinstance(key, str) or not key.isdigit() or len(key) > 18:
            raise ParamError(f"logit_bias keys must be token ids, got {json.dumps(key)}",
                             "logit_bias")
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise ParamError(f"logit_bias values must be numbers, got {json.dumps(amount)}",
                             "logit_bias")
        bias[int(key)] = float(amount)
    return bias
