"""Workloads: length specs, synthetic / shared-prefix / JSONL prompts, request bodies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchinfer.bench.client import request_body
from batchinfer.bench.workload import (
    jsonl_workload,
    parse_length_spec,
    shared_prefix_workload,
    synthetic_workload,
)


def test_length_specs() -> None:
    rng = np.random.default_rng(0)
    assert parse_length_spec("128", "--input-len").sample(rng, 3) == [128, 128, 128]
    uniform = parse_length_spec("64:512", "--input-len").sample(rng, 2000)
    assert min(uniform) >= 64 and max(uniform) <= 512
    assert np.mean(uniform) == pytest.approx(288, rel=0.05)
    normal = parse_length_spec("normal:200,20", "--input-len").sample(rng, 2000)
    assert np.mean(normal) == pytest.approx(200, rel=0.03)
    assert np.std(normal) == pytest.approx(20, rel=0.15)


def test_histogram_spec(tmp_path: Path) -> None:
    path = tmp_path / "hist.txt"
    path.write_text("# length weight\n10 1\n100 3\n")
    lengths = parse_length_spec(f"hist:{path}", "--input-len").sample(np.random.default_rng(0),
                                                                      4000)
    assert set(lengths) == {10, 100}
    assert lengths.count(100) / len(lengths) == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize("text, cause", [
    ("512:64", "greater than"), ("0:10", ">= 1"), ("0", ">= 1"), ("a:b", "not a number"),
    ("normal:0,1", "MEAN >= 1"), ("normal:5", "normal:MEAN,STD"),
    ("hist:/nonexistent", "cannot read"),
])
def test_impossible_lengths_raise(text: str, cause: str) -> None:
    with pytest.raises(ValueError, match=cause) as info:
        parse_length_spec(text, "--input-len")
    assert "--input-len" in str(info.value)


def test_synthetic_is_reproducible_and_sized() -> None:
    spec_in, spec_out = parse_length_spec("20:40", "i"), parse_length_spec("5:9", "o")
    first = synthetic_workload(50, spec_in, spec_out, seed=3)
    assert first == synthetic_workload(50, spec_in, spec_out, seed=3)
    assert first != synthetic_workload(50, spec_in, spec_out, seed=4)
    for request in first:
        assert 20 <= request.num_prompt_tokens_est <= 40
        assert len(request.prompt.split()) == request.num_prompt_tokens_est
        assert 5 <= request.max_tokens <= 9
    # tokens_per_word = 2 halves the words for the same token target.
    halved = synthetic_workload(5, spec_in, spec_out, seed=3, tokens_per_word=2.0)
    assert len(halved[0].prompt.split()) == round(first[0].num_prompt_tokens_est / 2)


def test_shared_prefix() -> None:
    requests = shared_prefix_workload(6, 30, 2, parse_length_spec("10", "i"),
                                      parse_length_spec("4", "o"), seed=0)
    assert len({r.system_prompt for r in requests}) == 2
    assert requests[0].system_prompt == requests[2].system_prompt
    assert len(requests[0].system_prompt.split()) == 30
    assert len({r.prompt for r in requests}) == 6


def test_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 7}\n\n'
                    '{"messages": [{"role": "user", "content": "hi"}]}\n')
    requests = jsonl_workload(path, 3, parse_length_spec("5", "o"), seed=0)
    assert [r.max_tokens for r in requests] == [7, 5, 7]
    assert requests[1].messages == ({"role": "user", "content": "hi"},)
    body = json.loads(request_body(requests[0], "chat", "m"))
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    with pytest.raises(ValueError, match="--endpoint chat"):
        request_body(requests[1], "completions", "m")


@pytest.mark.parametrize("line, cause", [
    ("{bad", "malformed JSON"), ('{"max_tokens": 3}', "prompt"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"), ("[1, 2]", "JSON object"),
])
def test_jsonl_bad_line_names_the_line(tmp_path: Path, line: str, cause: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=cause) as info:
        jsonl_workload(path, None, parse_length_spec("5", "o"), seed=0)
    assert f"{path}:2" in str(info.value)


def test_request_body_completions() -> None:
    request = shared_prefix_workload(1, 3, 1, parse_length_spec("2", "i"),
                                     parse_length_spec("4", "o"), seed=0)[0]
    body = json.loads(request_body(request, "completions", "m"))
    assert body["prompt"] == f"{request.system_prompt}\n{request.prompt}"
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    chat = json.loads(request_body(request, "chat", "m", ignore_eos=False))
    assert [m["role"] for m in chat["messages"]] == ["system", "user"]
    assert "ignore_eos" not in chat
