"""`batchinfer run-batch` on a tiny model: OpenAI's output format in input order, per-line
parameters, bad lines answered alone, duplicate custom_ids refused, resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchinfer.cli.main import main
from tests.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("run-batch"))


def request(custom_id: str, url: str = "/v1/completions", **body: object) -> str:
    body.setdefault("model", "default")
    if url == "/v1/completions":
        body.setdefault("prompt", f"prompt of {custom_id}")
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def flags(model: Path) -> list[str]:
    return ["--model", str(model), "--no-progress", "--max-num-seqs", "4", "--seed", "0"]


def test_answers_in_input_order_with_each_lines_params(tmp_path: Path, model: Path) -> None:
    lines = [request(f"r{i}", max_tokens=1 + i % 5, temperature=0, ignore_eos=True)
             for i in range(12)]
    lines.insert(3, "{not json")
    lines.insert(5, request("unknown-url", url="/v1/images"))
    lines.insert(6, request("streams", stream=True))
    lines.insert(7, request("bad-param", max_tokens=-1))
    lines.append(request("chat", url="/v1/chat/completions",
                         messages=[{"role": "user", "content": "hi"}], max_tokens=3))
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n\n")
    assert main(["run-batch", "-i", str(source), "-o", str(target), "--max-in-flight", "3",
                 *flags(model)]) == 0
    rows = read(target)
    want_ids = [json.loads(x).get("custom_id") if x.startswith("{\"") else None for x in lines]
    assert [r["custom_id"] for r in rows] == want_ids
    assert all(r["id"].startswith("batch_req_") and r["error"] is None for r in rows)
    by_id = {r["custom_id"]: r["response"] for r in rows}
    for i in range(12):
        response = by_id[f"r{i}"]
        assert response["status_code"] == 200 and response["request_id"]
        assert response["body"]["usage"]["completion_tokens"] == 1 + i % 5
    assert by_id["chat"]["body"]["object"] == "chat.completion"
    for custom_id, param in (("unknown-url", "url"), ("streams", "body.stream")):
        assert by_id[custom_id]["status_code"] == 400
        assert by_id[custom_id]["body"]["error"]["param"] == param
    # A line the server itself refuses gets the server's own 400 body.
    assert by_id["bad-param"]["status_code"] == 400
    assert by_id["bad-param"]["body"]["error"]["param"] == "max_tokens"
    (bad_json,) = [r for r in rows if r["custom_id"] is None]
    assert "line 4 is not valid JSON" in bad_json["response"]["body"]["error"]["message"]


def test_duplicate_custom_id_refused_before_any_work(tmp_path: Path, model: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join([request("a"), request("b"), request("a")]) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(target), *flags(model)]) == 2
    assert "custom_id 'a' appears on lines 1 and 3" in capsys.readouterr().err
    assert not target.exists()


def test_resume_after_a_kill_skips_answered_lines(tmp_path: Path, model: Path) -> None:
    lines = [request(f"r{i}", max_tokens=12, temperature=0, ignore_eos=True)
             for i in range(40)]
    lines.insert(3, "[1, 2]")  # a line without custom_id must not be answered twice
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "batchinfer.cli.main", "run-batch", "-i", str(source),
               "-o", str(target), "--max-in-flight", "2", *flags(model),
               "--max-num-seqs", "2"]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (target.exists() and len(target.read_text().splitlines()) >= 6):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(30)
    first = read(target)
    assert 6 <= len(first) < len(lines)
    with open(target, "a") as f:  # as if the kill landed mid-write
        f.write('{"id": "batch_req_x", "custom_')
    assert main(["run-batch", "-i", str(source), "-o", str(target), *flags(model)]) == 0
    rows = read(target)
    want_ids = [json.loads(x)["custom_id"] if x.startswith("{") else None for x in lines]
    assert [r["custom_id"] for r in rows] == want_ids  # each once, in input order
    assert rows[:len(first)] == first
    # The resumed answers equal an uninterrupted run's (greedy).
    fresh = tmp_path / "fresh.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(fresh), *flags(model)]) == 0
    texts = [r["response"]["body"].get("choices", [{}])[0].get("text") for r in rows]
    assert texts == [r["response"]["body"].get("choices", [{}])[0].get("text")
                     for r in read(fresh)]
    # Rerunning a finished output answers nothing more.
    assert main(["run-batch", "-i", str(source), "-o", str(target), *flags(model)]) == 0
    assert read(target) == rows


def test_embeddings_lines_load_the_encoder(tmp_path: Path, model: Path) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join([
        request("vec", url="/v1/embeddings", input=["a cat", "a dog"]),
        request("text", max_tokens=2)]) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(target), *flags(model)]) == 0
    vec, text = read(target)
    data = vec["response"]["body"]["data"]
    assert vec["response"]["status_code"] == 200 and [len(d["embedding"]) for d in data] == \
        [384, 384]
    assert text["response"]["body"]["usage"]["completion_tokens"] == 2


def test_lines_json_cannot_carry_are_answered_alone(tmp_path: Path, model: Path) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join([
        '{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", "body": {}}',
        request("nan", temperature=float("nan")),  # json.dumps writes NaN
        request("fine", max_tokens=2)]) + "\n")
    assert main(["run-batch", "-i", str(source), "-o", str(target), *flags(model)]) == 0
    surrogate, nan, fine = read(target)
    assert surrogate["response"]["status_code"] == 400 and surrogate["custom_id"] is None
    assert "NaN" in nan["response"]["body"]["error"]["message"]
    assert fine["response"]["body"]["usage"]["completion_tokens"] == 2


def test_a_failing_write_stops_the_run_and_is_raised() -> None:
    """A full disk must not pass for a finished run: the error surfaces, nothing after it
    is written, and the run does not hang with lines in flight."""
    import asyncio

    from batchinfer.batch.executor import run_lines
    from batchinfer.batch.lines import parse_line

    lines = [parse_line(i, request(f"w{i}")) for i in range(12)]
    written: list[str] = []

    async def handler(url: str, body: dict) -> tuple[int, dict, str]:
        await asyncio.sleep(0.001)
        return 200, {"usage": {"completion_tokens": 1}}, "rid"

    def write(line, result) -> None:
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        written.append(line.custom_id)

    async def run() -> None:
        await asyncio.wait_for(run_lines(iter(lines), handler, write, 2), timeout=10)

    with pytest.raises(OSError, match="No space left"):
        asyncio.run(run())
    assert written == ["w0", "w1", "w2"]
