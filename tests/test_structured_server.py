"""Structured outputs over real HTTP with the `openai` client: `response_format` (json_schema,
json_object, structural_tag), vLLM's `guided_*` and `structured_outputs` extensions, and
`logit_bias`, on both endpoints, streamed and not; every bad spec is a 400 naming the field
the client wrote, and leaves the server serving the next request."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from batchinfer.core.config import EngineConfig
from batchinfer.server.app import ServerConfig, build_app
from tests.test_server import ENGINE, run_server
from tests.tiny_models import make_tiny_llama

USER = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


class Person(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=4)


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("structured-server"))
    app = build_app(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE),
                    ServerConfig(served_model_name="tiny"))
    with run_server(app) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                    "strict": True}}


def test_json_schema_outputs_validate_streamed_or_not_on_both_endpoints(client):
    chat = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=300, temperature=0.8, seed=1, n=3,
        response_format=json_schema_format(SCHEMA))
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    completion = client.completions.create(
        model="tiny", prompt="A person:", max_tokens=300, temperature=0,
        extra_body={"response_format": json_schema_format(SCHEMA)})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)
    stream = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=300, temperature=0, stream=True,
        response_format=json_schema_format(SCHEMA))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    whole = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=300, temperature=0,
        response_format=json_schema_format(SCHEMA))
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_pydantic_parse(client):
    out = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=200, temperature=0, seed=3,
        response_format={"type": "json_object"}, extra_body={"top_k": 5})
    assert out.choices[0].message.content.startswith("{")
    if out.choices[0].finish_reason == "stop":  # a free object may also run to max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    parsed = client.chat.completions.parse(model="tiny", messages=USER, max_tokens=200,
                                           temperature=0, response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.kind in ("cat", "dog") and 0 <= person.legs <= 4


def test_vllm_extensions_constrain_the_output(client):
    regex = client.completions.create(model="tiny", prompt="code:", max_tokens=30, temperature=0,
                                      extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", regex.choices[0].text)
    choice = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=10, temperature=0,
        extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    grammar = client.completions.create(
        model="tiny", prompt="sum:", max_tokens=30, temperature=0,
        extra_body={"guided_grammar": 'root ::= num " + " num\nnum ::= [1-9] [0-9]?'})
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", grammar.choices[0].text)
    nested = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=300, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    jsonschema.validate(json.loads(nested.choices[0].message.content), SCHEMA)
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "json_schema", "json_schema": {"type": "object", "properties": {
            "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}]}}
    tagged = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30,
                                            temperature=0, response_format=tag)
    text = tagged.choices[0].message.content
    assert text.startswith("Answer: ") and json.loads(text[8:]) in ({"ok": True}, {"ok": False})


def test_logit_bias_moves_the_output_and_bans_tokens(client, url):
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0,
                                      logprobs=1)
    first = plain.choices[0].logprobs.tokens[0]
    ids = httpx.post(f"{url}/tokenize", json={"prompt": first}).json()["tokens"]
    assert len(ids) == 1
    banned = client.completions.create(model="tiny", prompt="hello", max_tokens=5,
                                       temperature=0, logprobs=1,
                                       logit_bias={str(ids[0]): -100})
    assert first not in banned.choices[0].logprobs.tokens
    forced = client.completions.create(model="tiny", prompt="hello", max_tokens=4,
                                       temperature=0, logit_bias={"97": 100})
    token = httpx.post(f"{url}/detokenize", json={"tokens": [97]}).json()["prompt"]
    assert forced.choices[0].text == token * 4


BAD = [
    # (body fields, param, words in the message)
    ({"response_format": json_schema_format({"type": "object", "properties": {
        "a": {"type": "array", "uniqueItems": True}}})}, "response_format", "uniqueItems"),
    ({"response_format": json_schema_format({"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^a+$", "maxLength": 3}}})}, "response_format",
     "maxLength beside pattern"),
    ({"guided_json": {"type": "object", "properties": {"a": {"format": "iri"}}}},
     "guided_json", "format 'iri'"),
    ({"response_format": json_schema_format({"type": "nonsense"})}, "response_format",
     "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format", "name"),
    ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "admits no output"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "cannot be combined"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "json_schema",
                                                                "json_schema": {"not": {}}}}},
     "response_format", "not"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "[0, 300)"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": "up"}}, "logit_bias", "numbers"),
]


@pytest.mark.parametrize(("fields", "param", "says"), BAD)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_specs_are_400s_naming_the_field(url, fields, param, says, path):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": USER}
    response = httpx.post(f"{url}{path}", json={**body, "max_tokens": 8, **fields}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    ok = httpx.post(f"{url}{path}", json={**body, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text  # the server goes on


def test_a_stream_with_a_constraint_ends_with_done(url):
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "messages": USER, "max_tokens": 200, "stream": True,
            "response_format": json_schema_format(SCHEMA)}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                   for line in lines[:-1])
    jsonschema.validate(json.loads(text), SCHEMA)
