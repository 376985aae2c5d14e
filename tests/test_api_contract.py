"""The API's contract over real HTTP: every OpenAI request field is honoured, refused with a 400
naming it, or documented as ignored; integers are bounded; error bodies name their `param` in
our words; a tiny temperature is greedy, not a token outside the vocabulary."""

from __future__ import annotations

import json
import math
import re
import typing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
)
from openai.types.chat import completion_create_params as chat_create_params

from batchinfer.core.config import EngineConfig
from batchinfer.server.app import ServerConfig, build_app
from batchinfer.server.protocol import NEEDS, REFUSED
from tests.test_server import ENGINE, run_server
from tests.tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
USER = [{"role": "user", "content": "hi"}]
ROUTES = {"completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
          "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 2})}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, int]]:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("contract"))
    app = build_app(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE),
                    ServerConfig(served_model_name="tiny", batch_api=True,
                                 batch_dir=str(tmp_path_factory.mktemp("batches"))))
    with run_server(app) as url:
        yield url, app.state.server.llm.engine.processor.vocab_size


def post(url: str, path: str, body: dict | list | str, headers: dict | None = None
         ) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, timeout=120,
                      headers={"content-type": "application/json", **(headers or {})})


def refused(response: httpx.Response, param: str) -> str:
    """The message of a 400 that names `param`; the body is OpenAI's, in one line of ours."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    message = error["message"]
    assert "\n" not in message and "pydantic" not in message and "Input should" not in message
    return message


# ----------------------------------------------------------------- tiny temperatures (1)
def test_a_tiny_temperature_is_greedy_not_a_token_outside_the_vocabulary(server):
    url, vocab = server
    body = {"prompt": "The capital of France is", "max_tokens": 6, "logprobs": 1}
    greedy = post(url, "/v1/completions", {**body, "temperature": 0})
    assert greedy.status_code == 200, greedy.text
    for temperature in (1e-300, 5e-324, 1e-6):
        tiny = post(url, "/v1/completions", {**body, "temperature": temperature})
        assert tiny.status_code == 200, tiny.text
        choice, expected = tiny.json()["choices"][0], greedy.json()["choices"][0]
        assert choice["text"] == expected["text"]
        assert choice["logprobs"]["tokens"] == expected["logprobs"]["tokens"]
        assert all(math.isfinite(lp) for lp in choice["logprobs"]["token_logprobs"])
        assert tiny.json()["usage"]["completion_tokens"] == 6
    # Without logprobs the old failure was silent: empty text for 6 "completion tokens".
    without = post(url, "/v1/completions", {**body, "logprobs": None, "temperature": 1e-300})
    assert without.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_extreme_sampling_fields_beside_a_greedy_request_leave_it_unharmed(server):
    url, _ = server
    body = {"prompt": "hello there", "max_tokens": 8}
    alone = post(url, "/v1/completions", {**body, "temperature": 0}).json()
    # n=8 sequences of one request share every step with hostile parameters.
    hostile = {"prompt": "hello there", "max_tokens": 8, "n": 8, "temperature": 2,
               "top_p": 1e-300, "top_k": 1, "min_p": 1, "presence_penalty": 2,
               "frequency_penalty": -2, "repetition_penalty": 1e-300, "logprobs": 20}
    # Sent together, so they usually share steps (the sampler's own test batches them surely).
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(2) as pool:
        hostile_future = pool.submit(client.post, f"{url}/v1/completions", json=hostile)
        greedy_future = pool.submit(client.post, f"{url}/v1/completions",
                                    json={**body, "temperature": 0})
        hostile_response, greedy_response = hostile_future.result(), greedy_future.result()
    assert hostile_response.status_code == 200, hostile_response.text
    for choice in hostile_response.json()["choices"]:
        assert all(math.isfinite(lp) and lp >= -9999 for lp in choice["logprobs"]["token_logprobs"])
    assert greedy_response.json()["choices"][0]["text"] == alone["choices"][0]["text"]


# ----------------------------------------------------------------- fields (2)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_refused_field_is_refused_by_name_and_taken_in_its_no_op_form(server, route, name):
    url, _ = server
    path, body = ROUTES[route]
    assert refused(post(url, path, {**body, name: {"surely": "not a no-op"}}), name) \
        .startswith(name)
    for no_op in REFUSED[name]:
        response = post(url, path, {**body, name: no_op})
        assert response.status_code == 200, (name, no_op, response.text)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", sorted(NEEDS))
def test_a_field_without_the_one_it_depends_on_is_refused(server, route, name):
    url, _ = server
    path, body = ROUTES[route]
    value = {"include_usage": True} if name == "stream_options" else "auto"
    assert "only allowed when" in refused(post(url, path, {**body, name: value}), name)


def test_stream_options_with_stream_is_honoured(server):
    url, _ = server
    body = {**ROUTES["completions"][1], "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("messages", "says"), [
    ([{"role": "tool", "content": "42"}], "needs its tool_call_id"),
    ([*USER, {"role": "tool", "content": "42", "tool_call_id": "call_1"}], "must answer"),
    ([{"role": "function", "name": "f", "content": "42"}], "legacy function calling"),
    ([{"role": "user", "content": "x", "tool_calls": [{"id": "call_1", "type": "function",
                                                       "function": {"name": "f",
                                                                    "arguments": "{}"}}]}],
     "only an assistant message makes tool calls"),
    ([{"role": "assistant", "tool_calls": [{"id": "call_1", "function": {"name": "f"}}]},
      *USER], "tool_calls[0] must be"),
    ([{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "1",
                                              "tool_call_id": "call_2"}], "must answer"),
    ([{"role": "assistant", "content": "no", "refusal": "I can't"}, *USER], "refusal"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "only text parts"),
    ([{"role": "user", "content": None}], "content is required"),
])
def test_chat_messages_that_cannot_be_rendered_are_refused(server, messages, says):
    url, _ = server
    for path in ("/v1/chat/completions", "/tokenize"):
        assert says in refused(post(url, path, {"messages": messages, "max_tokens": 2}),
                               "messages")


def test_ignored_fields_change_nothing(server):
    url, _ = server
    body = {"messages": USER, "max_tokens": 4, "temperature": 0}
    plain = post(url, "/v1/chat/completions", body)
    ignored = post(url, "/v1/chat/completions", {
        **body, "user": "u-1", "safety_identifier": "s", "store": True, "metadata": {"k": "v"},
        "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k",
        "prompt_cache_retention": "24h"})
    assert plain.status_code == ignored.status_code == 200, ignored.text
    assert ignored.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def _fields(typed_dict: typing.Any) -> set[str]:
    return set(typed_dict.__annotations__)


def test_the_docs_table_covers_every_field_of_openais_request_types():
    text = (ROOT / "docs" / "server.md").read_text()
    rows: dict[tuple[str, str], str] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2] in ("honoured", "refused", "ignored"):
            for route in cells[0].split(", "):
                for name in re.findall(r"`([a-z_]+)`", cells[1]):
                    rows[route, name] = cells[2]
    wanted = {
        "completions": _fields(completion_create_params.CompletionCreateParamsBase) | {"stream"},
        "chat": _fields(chat_create_params.CompletionCreateParamsBase) | {"stream"},
        "chat message": (_fields(ChatCompletionUserMessageParam)
                         | _fields(ChatCompletionAssistantMessageParam)
                         | _fields(ChatCompletionToolMessageParam)),
        "embeddings": _fields(embedding_create_params.EmbeddingCreateParams),
    }
    missing = [(route, name) for route, names in wanted.items() for name in sorted(names)
               if (route, name) not in rows]
    assert not missing, f"docs/server.md's field table misses {missing}"
    # What the table calls refused is refused by the code, and the other way round.
    for name in REFUSED:
        documented = {rows.get((route, name)) for route in ("completions", "chat")} - {None}
        assert documented in ({"refused"}, set()), (name, documented)
        assert documented or f"`{name}`" in text, f"docs/server.md never names {name}"


# ----------------------------------------------------------------- integers (3)
@pytest.mark.parametrize(("field", "value", "says"), [
    ("seed", 1 << 64, "64-bit"),
    ("seed", -(1 << 63) - 1, "64-bit"),
    ("top_k", 1 << 70, "64-bit"),
    ("min_tokens", 1 << 70, "64-bit"),
    ("max_tokens", 1 << 70, "64-bit"),
    ("priority", 1 << 40, "[-2147483648, 2147483647]"),
    ("stop_token_ids", "vocab", "stop_token_ids must be in [0, "),
    ("stop_token_ids", [1] * 65, "at most 64"),
    ("stop", ["x"] * 65, "at most 64"),
])
def test_integers_are_bounded(server, field, value, says):
    url, vocab = server
    if value == "vocab":
        value = [vocab]
    body = {**ROUTES["completions"][1], field: value}
    assert says in refused(post(url, "/v1/completions", body), field)


def test_integers_at_their_bounds_are_taken(server):
    url, vocab = server
    for extra in ({"seed": (1 << 63) - 1}, {"seed": -(1 << 63)}, {"priority": -(1 << 31)},
                  {"stop_token_ids": [vocab - 1, 0]}, {"top_k": (1 << 63) - 1}):
        response = post(url, "/v1/completions", {**ROUTES["completions"][1], **extra})
        assert response.status_code == 200, (extra, response.text)


# ----------------------------------------------------------------- error bodies (4)
@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature",
     "temperature must be a finite number"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
     "top_p", "top_p must be a finite number"),
    ("/v1/completions", '{"prompt": "x", "timeout": Infinity}', "timeout",
     "timeout must be a finite number"),
    ("/tokenize", {"messages": []}, "messages", "messages must hold at least 1 item"),
    ("/v1/completions", {"prompt": [[1], "a"]}, "prompt",
     "prompt must be a string, a list of strings, a list of integers or a list of lists of "
     "integers"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages",
     "messages[0].content must be a string or a list of objects"),
    ("/v1/chat/completions", {"messages": [{"role": "boss", "content": "x"}]}, "messages",
     "messages[0].role must be 'system', 'developer', 'user', 'assistant', 'tool' or "
     "'function'"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n must be >= 1"),
    ("/v1/completions", {"max_tokens": 2}, "prompt", "prompt is required"),
])
def test_error_bodies_name_the_param_in_our_words(server, path, body, param, message):
    url, _ = server
    assert refused(post(url, path, body), param) == message


def test_a_query_parameter_error_names_the_parameter(server):
    url, _ = server
    response = httpx.get(f"{url}/v1/batches", params={"limit": "many"}, timeout=60)
    assert refused(response, "limit") == "limit must be an integer"


def test_a_body_that_is_no_object_is_refused_in_our_words(server):
    url, _ = server
    response = post(url, "/v1/completions", [1, 2])
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the request body must be a JSON object"


@pytest.mark.parametrize("request_id", ["a" * 129, "two words", "id@engine", "quote\"d", "ünï"])
def test_a_request_id_out_of_bounds_is_refused_and_never_echoed(server, request_id):
    url, _ = server
    raw = request_id.encode("latin-1", "replace")
    response = httpx.post(f"{url}/v1/completions", json=ROUTES["completions"][1],
                          headers=[(b"x-request-id", raw)], timeout=60)
    refused(response, "X-Request-Id")
    echoed = response.headers["x-request-id"]
    assert echoed != request_id and re.fullmatch(r"[0-9a-f]{32}", echoed)


def test_a_plain_request_id_is_echoed(server):
    url, _ = server
    request_id = "Trace-1.2:3/4+5=6_" + "x" * 110
    response = post(url, "/v1/completions", ROUTES["completions"][1],
                    headers={"x-request-id": request_id})
    assert response.status_code == 200 and response.headers["x-request-id"] == request_id
