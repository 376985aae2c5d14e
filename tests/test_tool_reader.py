"""Reading tool calls out of a model's text (engine/tools.py): whole, and fed in pieces of any
size as a stream is, the two give the same content and calls; the streamed argument deltas add
up to the whole call's arguments; what is not a call stays content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.tools import (
    ToolCallReader,
    read_tool_calls,
    render_tool_messages,
    tool_format_of,
)

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n'
          "</tool_call>")
CASES = [
    # (syntax, text, content, [(name, arguments)])
    ("hermes", HERMES, "Let me look.\n",
     [("get_weather", '{"city": "Paris", "days": 3}'), ("noop", "{}")]),
    ("hermes", "plain text with <tool but no call", "plain text with <tool but no call", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call> after",
     "<tool_call>\nnot json\n</tool_call> after", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, \\"}\\"]}"}</tool_call>',
     "", [("f", '{"a": [1, "}"]}')]),  # arguments written as a JSON string
    ("hermes", '<tool_call>\n{"arguments": {"x": "{"}, "name": "late"}\n</tool_call>', "",
     [("late", '{"x": "{"}')]),  # the name after the arguments
    ("hermes", '<tool_call>\n{"name": "cut", "arguments": {"a": [1, 2', "",
     [("cut", '{"a": [1, 2')]),  # cut short (finish_reason length): a call with what it has
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
     "", [("f", '{"x": 1}'), ("g", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"q": "a b"}}', "",
     [("f", '{"q": "a b"}')]),
    ("llama3_json", 'Hello {"name": "f", "parameters": {}}',
     'Hello {"name": "f", "parameters": {}}', []),  # calls only from the start
]


@pytest.mark.parametrize(("syntax", "text", "content", "calls"), CASES)
def test_whole_outputs_split_into_content_and_calls(syntax, text, content, calls):
    got_content, got_calls = read_tool_calls(text, syntax)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    assert all(c.id.startswith("call_") for c in got_calls)


def _streamed(syntax: str, text: str, cuts: list[int]) -> tuple[str, dict, dict, dict]:
    reader = ToolCallReader(syntax)
    content, names, ids, arguments = [], {}, {}, {}
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        piece, deltas = reader.feed(text[start:end], final=end == len(text))
        content.append(piece)
        for delta in deltas:
            if delta.id is not None:
                assert delta.index not in names, "a call is announced once"
                names[delta.index], ids[delta.index] = delta.name, delta.id
            else:
                assert delta.index in names, "arguments come after the call's announcement"
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    return "".join(content), names, ids, arguments


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=40))
def test_any_split_into_pieces_gives_what_the_whole_text_gives(case, cuts):
    syntax, text, content, calls = case
    got_content, names, ids, arguments = _streamed(syntax, text, cuts)
    assert got_content == content
    assert [names[i] for i in sorted(names)] == [name for name, _ in calls]
    assert [arguments[i] for i in sorted(arguments)] == [args for _, args in calls]


def test_content_is_not_held_back_longer_than_a_marker_could_need():
    reader = ToolCallReader("hermes")
    assert reader.feed("Sure, <tool")[0] == "Sure, "  # "<tool" may begin "<tool_call>"
    assert reader.feed("box> here")[0] == "<toolbox> here"
    piece, deltas = reader.feed('<tool_call>\n{"name": "f", "arguments": {"a"')
    assert piece == "" and [(d.name, d.arguments) for d in deltas] == [("f", ""), (None, '{"a"')]


def test_template_syntax_and_fallback_rendering():
    assert tool_format_of(None) == "hermes"
    assert tool_format_of("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"
    assert tool_format_of("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_format_of('{% if tools %}{"name": ..., "parameters": ...}{% endif %}') \
        == "llama3_json"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'}}]},
               {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"}]
    fallback = render_tool_messages(history, tools, template_takes_them=False)
    assert fallback[0]["role"] == "system" and '"name": "f"' in fallback[0]["content"]
    assert fallback[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "f", '
                           '"arguments": {"a": 1}}\n</tool_call>'}
    assert fallback[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    own = render_tool_messages(history, tools, template_takes_them=True)
    assert own[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # as templates want
    assert own[2] == history[2]
    assert json.loads(json.dumps(own))  # plain data
