"""`batchinfer run-batch` on a tiny model: OpenAI's output format in input order, per-line
parameters, bad lines answered alone, duplicate custom_ids refused, a run killed mid-way and
rerun equal to an uninterrupted one."""

from __future__ import annotations

import json
import os
import re
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
    """The answers in `path`, each a whole line: split at "\\n" only (answers keep characters
    such as U+2028 raw, which splitlines() cuts), a last line cut short by a kill left out."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n")[:-1]]


def flags(model: Path) -> list[str]:
    return ["--model", str(model), "--no-progress", "--max-num-seqs", "4", "--seed", "0",
            "--kv-cache-memory", "64M"]


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


# Answers are written in input order, at most --max-in-flight (2) lines at once: while line
# HOLD runs its LONG tokens, the output holds exactly the HOLD answers before it (the next
# line's answer waits behind it, the one after cannot start). A kill seen there lands mid-run.
HOLD, LONG = 6, 480


def content(row: dict) -> tuple:
    """What an answer says, without what differs from run to run (ids, timestamps)."""
    response = row["response"]
    body = response["body"]
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("id", "created")}
    return row["custom_id"], response["status_code"], json.dumps(body, sort_keys=True)


def summary(err: str) -> tuple[int, int, int, int]:
    """(lines, already answered, completed, failed) from run-batch's last line on stderr."""
    found = re.search(r"run-batch: (\d+) lines, (\d+) already answered, (\d+) completed, "
                      r"(\d+) failed", err)
    assert found, err
    return int(found[1]), int(found[2]), int(found[3]), int(found[4])


def test_a_run_killed_mid_way_then_rerun_equals_an_uninterrupted_run(
        tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL mid-run, then the same command again: the output equals an uninterrupted
    run's line for line (same custom_ids in input order, each once, same greedy answers);
    the answers written before the kill stay as they were and their lines do not run again."""
    lines = [request(f"r{i}", max_tokens=LONG if i == HOLD else 2 + i % 5, temperature=0,
                     ignore_eos=True) for i in range(40)]
    lines.insert(3, "[1, 2]")  # a line without custom_id must not be answered twice
    lines.append(request("chat", url="/v1/chat/completions", max_tokens=3, temperature=0,
                         messages=[{"role": "user", "content": "hi"}]))
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    same = [*flags(model), "--max-num-seqs", "2", "--num-threads", "1"]
    run = ["run-batch", "-i", str(source), "-o", str(target), "--max-in-flight", "2", *same]
    process = subprocess.Popen([sys.executable, "-m", "batchinfer.cli.main", *run],
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not (target.exists() and len(read(target)) >= HOLD + 1):  # "[1, 2]" included
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(30)
    kept = read(target)
    assert HOLD + 1 <= len(kept) < len(lines), "the kill came after the run had finished"
    with open(target, "a") as f:  # as if the kill landed mid-write
        f.write('{"id": "batch_req_x", "custom_')
    capsys.readouterr()
    assert main(run) == 0
    num_lines, skipped, completed, failed = summary(capsys.readouterr().err)
    assert (num_lines, skipped) == (len(lines), len(kept))
    assert completed + failed == len(lines) - len(kept)  # only the lines not written ran
    rows = read(target)
    assert rows[:len(kept)] == kept
    fresh = tmp_path / "fresh.jsonl"
    assert main(["run-batch", "-i", str(source), "-o", str(fresh), "--max-in-flight", "2",
                 *same]) == 0
    assert [content(r) for r in rows] == [content(r) for r in read(fresh)]
    want_ids = [json.loads(x)["custom_id"] if x.startswith("{") else None for x in lines]
    assert [r["custom_id"] for r in rows] == want_ids  # each once, in input order
    # Rerunning a finished output answers nothing more.
    capsys.readouterr()
    assert main(run) == 0
    assert summary(capsys.readouterr().err)[1:] == (len(lines), 0, 0)
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
