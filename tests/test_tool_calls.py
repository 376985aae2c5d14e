"""Tool calling over real HTTP with the `openai` client, on tiny random models with three kinds
of chat template: one that takes no tools (the fallback system prompt, `hermes` syntax), a
Qwen-style one that renders tools and `<tool_call>` turns itself, and a Llama-3-style one
(`{"name", "parameters"}` objects). A named `tool_choice` always gives that call with arguments
valid against its schema, `required` at least one call, `auto` reads the model's own calls
(here made by a constraint on the text); streamed calls add up to the whole response's; tool
results go back through the template; bad tools are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from batchinfer.core.config import EngineConfig
from batchinfer.server.app import ServerConfig, build_app
from tests.test_server import ENGINE, run_server
from tests.tiny_models import make_tiny_llama

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}\n</tools>\nAnswer with <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}{%- for message in messages %}{%- if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- elif message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n{%- else %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nRespond with {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.\n{%- for tool in tools %}{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{%- endif %}{%- for message in messages %}<|im_start|>"
    "{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(folder: Path, template: str) -> Path:
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["fallback", "qwen", "llama3"])
def served(request, tmp_path_factory) -> Iterator[tuple[str, str]]:
    # A byte-level vocabulary of 300 spells the tools prompt in ~900 tokens.
    folder = make_tiny_llama(tmp_path_factory.mktemp(f"tools-{request.param}"),
                             max_position_embeddings=2048)
    if request.param != "fallback":
        with_template(folder, QWEN_TEMPLATE if request.param == "qwen" else LLAMA_TEMPLATE)
    app = build_app(EngineConfig.from_kwargs(model=str(folder), **ENGINE),
                    ServerConfig(served_model_name="tiny"))
    with run_server(app) as url:
        yield url, request.param


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)


def check_calls(message, names=None) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_tool_choice_always_gives_that_call_with_valid_arguments(client):
    for seed in range(4):
        out = client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, max_tokens=120, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message, {"get_weather"})


def test_required_gives_at_least_one_valid_call(client):
    out = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=200, temperature=0.7, seed=5,
        tool_choice="required", parallel_tool_calls=False, n=3)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: one call
        check_calls(choice.message)


def test_a_streamed_call_adds_up_to_the_whole_response(client):
    body = dict(model="tiny", messages=USER, tools=TOOLS, max_tokens=120, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**body).choices[0]
    names, arguments, finish = {}, {}, None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            if call.id is not None:
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert names == {0: "get_weather"}
    assert arguments[0] == whole.message.tool_calls[0].function.arguments


def _forced_text(syntax: str, calls: list[tuple[str, dict]], before: str = "") -> str:
    if syntax == "llama3":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return before + "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n"
                            "</tool_call>" for n, a in calls)


def test_auto_reads_the_models_own_calls_and_leaves_text_as_content(client, served):
    syntax = served[1]
    calls = [("get_weather", {"city": "Paris", "unit": "celsius", "days": 2}),
             ("get_time", {"zone": "CET"})]
    text = _forced_text(syntax, calls, before="Let me check.\n")
    # The model is made to write `text` by a one-choice constraint: what it writes is read.
    body = dict(model="tiny", messages=USER, tools=TOOLS, max_tokens=200, temperature=0,
                extra_body={"guided_choice": [text]})
    out = client.chat.completions.create(**body).choices[0]
    assert out.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in out.message.tool_calls] == calls
    assert out.message.content == (None if syntax == "llama3" else "Let me check.")
    streamed, arguments = [], {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
            if call.id is not None:
                streamed.append(call.function.name)
    assert streamed == [name for name, _ in calls]
    assert [json.loads(arguments[i]) for i in sorted(arguments)] == [a for _, a in calls]
    plain = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=40, temperature=0,
        extra_body={"guided_choice": ["It is sunny."]}).choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None
    assert plain.message.content == "It is sunny."
    none = client.chat.completions.create(**body, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content == text


def test_tool_results_go_back_through_the_template(client, served):
    url, kind = served
    history = [*USER,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_7", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_7", "content": "18 degrees, sunny"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                         max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    ids = httpx.post(f"{url}/tokenize", json={"messages": history, "tools": TOOLS}).json()
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert "18 degrees, sunny" in text and '"get_weather"' in text
    if kind == "llama3":
        assert "Respond with" in text  # the template's own tool prompt
    else:
        assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
        assert ("You may call one or more functions" in text) == (kind == "fallback")


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", '"type": "function"'),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"if": {}}}}}}]}, "tools", "if"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "tools", "does not compile"),
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
]


@pytest.mark.parametrize(("fields", "param", "says"), BAD)
def test_bad_tools_are_400s_naming_the_field(served, fields, param, says):
    url = served[0]
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": USER, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_tools_on_completions_are_refused(served):
    response = httpx.post(f"{served[0]}/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 4, "tools": TOOLS})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
