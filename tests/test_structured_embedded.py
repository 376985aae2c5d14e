"""Structured outputs and tools from the embedded model (SmolLM2-135M-Instruct) over real HTTP
with the `openai` client: twenty schemas of the kinds extraction jobs send (nested objects,
arrays, enums, required fields, bounded numbers, patterns, formats) in one batch of 32 beside
unconstrained requests, all valid; `chat.completions.parse` with a pydantic model; a named
`tool_choice` always a parseable call with valid arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from batchinfer.core.config import EngineConfig
from batchinfer.server.app import build_app
from tests.test_server import run_server

pytestmark = pytest.mark.slow  # the embedded model's start-up and a 32-request burst

SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "data"
                      / "json_schemas.json").read_text())
FREE_PROMPTS = ["Tell me a joke.", "What is 2 + 2?", "Name a color.", "Say hello in French.",
                "Write one line about the sea.", "What is the capital of Italy?"]


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: float = Field(ge=0, le=50)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with run_server(build_app(EngineConfig()), timeout_s=600) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


def _constrained(client: openai.OpenAI, spec: dict) -> None:
    out = client.chat.completions.create(
        model="default", max_tokens=256, temperature=0,
        messages=[{"role": "user", "content": f"{spec['prompt']} Answer in JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": spec["name"], "schema": spec["schema"],
                                         "strict": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", (spec["name"], choice.message.content)
    jsonschema.validate(json.loads(choice.message.content), spec["schema"],
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def _free(client: openai.OpenAI, prompt: str) -> None:
    out = client.chat.completions.create(model="default", max_tokens=48, temperature=0,
                                         messages=[{"role": "user", "content": prompt}])
    assert out.choices[0].message.content


def test_twenty_schemas_in_one_batch_of_32_beside_unconstrained_requests(client):
    jobs = [(_constrained, spec) for spec in SCHEMAS]
    jobs += [(_free, FREE_PROMPTS[i % len(FREE_PROMPTS)]) for i in range(32 - len(jobs))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for future in [pool.submit(fn, client, arg) for fn, arg in jobs]:
            future.result()


def test_parse_with_a_pydantic_model(client):
    parsed = client.chat.completions.parse(
        model="default", max_tokens=128, temperature=0, response_format=City,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City)


def test_a_named_tool_choice_always_gives_a_valid_call(client):
    weather = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather,
                                               "description": "Current weather in a city"}}]
    for seed in range(3):
        out = client.chat.completions.create(
            model="default", max_tokens=96, temperature=0.7, seed=seed, tools=tools,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            messages=[{"role": "user", "content": "What is the weather like in Rome?"}])
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), weather)
