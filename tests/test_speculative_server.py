"""Speculative decoding behind the HTTP server: streams of several tokens a step end as plain
decoding's do, a client that leaves mid-stream stops its work, and `/metrics` and
`/dashboard/data` show the proposals and the depth chosen."""

from __future__ import annotations

import httpx
import openai
import pytest

from batchinfer import LLM, SamplingParams
from batchinfer.core.config import EngineConfig
from batchinfer.server.app import ServerConfig, build_app
from tests.test_server import metric, run_server, slow_steps, wait_for
from tests.tiny_models import make_tiny_llama

ENGINE = {"dtype": "float32", "kv_cache_memory": 16 << 20}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("spec-server")))


@pytest.fixture(scope="module")
def served(model_dir):
    # The model drafts for itself: every proposal is accepted, so every step after the first
    # hands the stream several tokens at once.
    config = EngineConfig.from_kwargs(model=model_dir, speculative_method="draft",
                                      speculative_model=model_dir, speculative_depth=4,
                                      **ENGINE)
    app = build_app(config, ServerConfig(served_model_name="tiny"))
    with run_server(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def base_url(served) -> str:
    return served[0]


def test_a_stream_of_several_tokens_a_step_ends_as_plain_decoding(base_url, model_dir):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    want = LLM(model_dir, **ENGINE).generate(
        ["Hello world, the quick brown fox"], SamplingParams(max_tokens=30, temperature=0,
                                                             ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    stream = client.completions.create(model="tiny", prompt="Hello world, the quick brown fox",
                                       max_tokens=30, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # 30 tokens in fewer deltas than tokens: steps hand out up to 5 at once.
    assert len([c for c in chunks if c.choices[0].text]) < 30
    drafted = metric(base_url, "batchinfer_spec_decode_num_draft_tokens_total")
    accepted = metric(base_url, "batchinfer_spec_decode_num_accepted_tokens_total")
    assert accepted == drafted > 0
    assert metric(base_url, 'batchinfer_spec_decode_num_accepted_tokens_per_pos_total'
                            '{position="0"}') > 0
    data = httpx.get(f"{base_url}/dashboard/data").json()
    assert data["limits"]["speculative_method"] == "draft"
    assert max(v for v in data["series"]["spec_depth"] if v is not None) > 0
    assert max(v for v in data["series"]["spec_acceptance"] if v is not None) == 1.0


def test_a_client_that_leaves_mid_stream_stops_its_work(served):
    base_url, app = served
    runner = app.state.server.llm.engine.core.runner
    slow_steps(app, 0.02)  # 480 tokens take seconds: the client surely leaves first
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 480, "ignore_eos": True,
            "temperature": 0, "stream": True}
    generated_before = metric(base_url, "batchinfer_generation_tokens_total")
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        wait_for(lambda: metric(base_url, "batchinfer_kv_cache_usage_perc") > 0)
    # Leaving the block closed the connection mid-stream: the sequence is aborted, its
    # blocks (proposals' included) are free, and it stops long before its 480 tokens.
    wait_for(lambda: metric(base_url, "batchinfer_kv_cache_usage_perc") == 0.0)
    assert metric(base_url, "batchinfer_num_requests_running") == 0
    assert metric(base_url, 'batchinfer_request_success_total{finished_reason="abort"}') >= 1
    assert metric(base_url, "batchinfer_generation_tokens_total") - generated_before < 480
    del runner.execute  # the class's own again
