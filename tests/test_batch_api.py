"""The Batch API over real HTTP with the official `openai` client: upload, create, poll,
results matched by custom_id, bad lines in the error file, duplicate custom_ids, cancel,
per-key ownership, pagination, and a server SIGKILLed or SIGTERMed mid-batch that resumes on
restart, each line answered and run once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from batchinfer.core.config import EngineConfig
from batchinfer.server.app import ServerConfig, build_app
from tests.test_server import ENGINE, free_port, metric, run_server, slow_steps, wait_for
from tests.tiny_models import make_tiny_llama

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("batch-api")))


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    app = build_app(EngineConfig.from_kwargs(model=model_dir, max_num_seqs=4, **ENGINE),
                    ServerConfig(api_key=",".join(KEYS), batch_api=True,
                                 batch_dir=str(tmp_path_factory.mktemp("batches"))))
    with run_server(app) as url:
        yield url, app


def client(url: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def line(custom_id: str, max_tokens: int = 4, url: str = "/v1/completions", **body) -> str:
    body = {"model": "default", "prompt": f"text of {custom_id}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def submit(api: openai.OpenAI, lines: list[str], **kwargs):
    upload = api.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()),
                              purpose="batch")
    return api.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                              completion_window="24h", **kwargs)


def wait_status(api: openai.OpenAI, batch_id: str, statuses: tuple[str, ...],
                timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = api.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.1)


def rows(api: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    # Split at "\n" only: answers keep characters such as U+2028 raw, which splitlines() cuts.
    return [json.loads(x) for x in api.files.content(file_id).text.split("\n")[:-1]]


def test_batch_end_to_end(server) -> None:
    url, _ = server
    api = client(url)
    lines = [line(f"r{i}", max_tokens=1 + i % 4) for i in range(10)]
    lines.insert(2, "{broken")
    lines.insert(4, line("elsewhere", url="/v1/chat/completions"))
    lines.insert(6, line("negative", max_tokens=-2))
    before = metric(url, 'batchinfer_e2e_request_latency_seconds_count{priority_class="batch"}')
    batch = submit(api, lines, metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_status(api, batch.id, ("completed", "failed"))
    assert done.status == "completed", done.errors
    assert done.request_counts.total == 13
    assert (done.request_counts.completed, done.request_counts.failed) == (10, 3)
    assert all(getattr(done, f"{s}_at") for s in ("in_progress", "finalizing", "completed"))
    output = rows(api, done.output_file_id)
    assert [r["custom_id"] for r in output] == [f"r{i}" for i in range(10)]  # input order
    for i, row in enumerate(output):
        body = row["response"]["body"]
        assert row["response"]["status_code"] == 200 and row["id"].startswith("batch_req_")
        assert body["usage"]["completion_tokens"] == 1 + i % 4
    # The same request sent directly gets the same greedy text.
    direct = api.completions.create(model="default", prompt="text of r3", max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert output[3]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    errors = {r["custom_id"]: r["response"] for r in rows(api, done.error_file_id)}
    assert errors[None]["status_code"] == 400 and "not valid JSON" in \
        errors[None]["body"]["error"]["message"]
    assert errors["elsewhere"]["body"]["error"]["param"] == "url"
    assert errors["negative"]["body"]["error"]["param"] == "max_tokens"
    # The lines ran in the background class.
    after = metric(url, 'batchinfer_e2e_request_latency_seconds_count{priority_class="batch"}')
    assert after - before == 10
    file = api.files.retrieve(done.output_file_id)
    assert file.purpose == "batch_output" and file.bytes > 0


def test_duplicate_custom_id_fails_the_batch(server) -> None:
    api = client(server[0])
    batch = submit(api, [line("a"), line("b"), line("a")])
    done = wait_status(api, batch.id, ("completed", "failed"))
    assert done.status == "failed" and done.output_file_id is None
    (error,) = done.errors.data
    assert error.code == "invalid_file" and error.line == 1
    assert "custom_id 'a' appears on lines 1 and 3" in error.message


def test_cancel_mid_run_keeps_what_finished(server) -> None:
    url, app = server
    api = client(url)
    engine = app.state.server.llm
    runner = engine.engine.core.runner
    execute = runner.execute
    slow_steps(app, 0.02)
    try:
        batch = submit(api, [line(f"c{i}", max_tokens=24) for i in range(40)])
        wait_for(lambda: api.batches.retrieve(batch.id).request_counts.completed >= 2)
        cancelling = api.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = wait_status(api, batch.id, ("cancelled",))
    finally:
        runner.execute = execute
    assert 2 <= done.request_counts.completed < 40
    assert done.cancelling_at and done.cancelled_at >= done.cancelling_at
    assert len(rows(api, done.output_file_id)) == done.request_counts.completed
    wait_for(lambda: engine.num_unfinished_requests == 0)  # in-flight aborted
    with pytest.raises(openai.ConflictError):
        api.batches.cancel(batch.id)


def test_objects_belong_to_their_key_and_list_pages(server) -> None:
    url, _ = server
    mine, theirs = client(url, KEYS[0]), client(url, KEYS[1])
    first = submit(theirs, [line("x")])
    second = submit(theirs, [line("y")])
    with pytest.raises(openai.NotFoundError):
        mine.batches.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        mine.files.retrieve(first.input_file_id)
    with pytest.raises(openai.BadRequestError):  # another key's file cannot be a batch input
        mine.batches.create(input_file_id=first.input_file_id, endpoint="/v1/completions",
                            completion_window="24h")
    page = theirs.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    assert [b.id for b in theirs.batches.list(limit=1, after=second.id).data] == [first.id]
    assert first.id not in [b.id for b in mine.batches.list(limit=100).data]
    for call in (lambda: mine.batches.cancel(first.id),
                 lambda: mine.files.content(first.input_file_id),
                 lambda: mine.files.delete(first.input_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    listed = [f.id for f in theirs.files.list(purpose="batch")]
    assert {first.input_file_id, second.input_file_id} <= set(listed)
    assert first.input_file_id not in [f.id for f in mine.files.list()]
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").batches.list()
    # An input file in use cannot be deleted; afterwards it can.
    wait_status(theirs, second.id, ("completed",))
    assert theirs.files.delete(second.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        theirs.files.content(second.input_file_id)


def test_bad_requests_get_openai_errors(server) -> None:
    url, _ = server
    api = client(url)
    upload = api.files.create(file=("x.jsonl", b'{"a": 1}\n'), purpose="batch")
    for kwargs, param in (({"endpoint": "/v1/images"}, "endpoint"),
                          ({"completion_window": "soon"}, "completion_window")):
        with pytest.raises(openai.BadRequestError) as caught:
            api.batches.create(**{"input_file_id": upload.id, "endpoint": "/v1/completions",
                                  "completion_window": "24h", **kwargs})
        assert caught.value.body["param"] == param
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    r = httpx.post(f"{url}/v1/files", headers=auth, data={"purpose": "fine-tune"},
                   files={"file": ("x.jsonl", b"{}\n")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = httpx.get(f"{url}/v1/batches?limit=0", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


# A job's lines answer in input order, at most --batch-max-in-flight (2) at once: while line
# HOLD runs its LONG tokens, the output holds exactly the HOLD answers before it (the next
# line's answer waits behind it, the one after cannot start). A stop seen there lands mid-job.
HOLD, LONG = 5, 480


def complete_lines(path: Path) -> list[dict]:
    """The answers in `path` that are whole lines (a kill may cut the last one short)."""
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n")[:-1]]


def batch_lines_run(url: str) -> float:
    """Batch-class requests the server at `url` ran to the end since it started."""
    return metric(url, 'batchinfer_e2e_request_latency_seconds_count{priority_class="batch"}')


@pytest.mark.parametrize("how", [signal.SIGKILL, pytest.param(signal.SIGTERM,
                                                                marks=pytest.mark.slow)],
                         ids=["kill", "term"])
def test_stopped_mid_batch_then_restart_resumes(model_dir: str, tmp_path: Path,
                                                how: signal.Signals) -> None:
    """SIGKILL loses nothing written; SIGTERM stops the job first (its running lines are
    not written) and exits; either way a server started on the same directory finishes the
    job: each line answered once, the answers written before the stop kept as they were, and
    only the lines not written run again."""
    batch_dir = tmp_path / "batches"

    def start() -> tuple[subprocess.Popen, str]:
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "batchinfer.cli.main", "serve", "--model", model_dir,
             "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16M",
             "--max-num-seqs", "2", "--batch-dir", str(batch_dir), "--batch-max-in-flight",
             "2"], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(url) or process.poll() is not None, timeout_s=180)
        assert process.poll() is None
        return process, url

    lines = [line(f"k{i}", max_tokens=LONG if i == HOLD else 4) for i in range(40)]
    lines.insert(2, "{broken")  # answered in the error file, without a custom_id
    process, url = start()
    try:
        api = client(url)
        batch = submit(api, lines)
        output = batch_dir / "batches" / batch.id / "output.jsonl"
        wait_for(lambda: len(complete_lines(output)) >= HOLD, timeout_s=180)
        os.kill(process.pid, how)
        assert process.wait(60) is not None
        kept = complete_lines(output)  # what the job had written when it stopped
        assert HOLD <= len(kept) < 40, "the stop came after the job had finished"
        process, url = start()
        api = client(url)
        done = wait_status(api, batch.id, ("completed",), timeout_s=300)
        final, errors = rows(api, done.output_file_id), rows(api, done.error_file_id)
        run_again = batch_lines_run(url)
    finally:
        process.kill()
        process.wait(30)
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (41, 40, 1)
    assert [r["custom_id"] for r in final] == [f"k{i}" for i in range(40)]  # each once
    assert [r["custom_id"] for r in errors] == [None]
    assert final[:len(kept)] == kept  # the answers written before the stop, as they were
    assert run_again == 40 - len(kept)  # and none of their lines ran again


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_expired_window_answers_the_rest_with_batch_expired(server) -> None:
    url, app = server
    api = client(url)
    runner = app.state.server.llm.engine.core.runner
    execute = runner.execute
    slow_steps(app, 0.05)
    try:
        upload = api.files.create(file=("in.jsonl", ("\n".join(
            line(f"e{i}", max_tokens=16) for i in range(30)) + "\n").encode()),
            purpose="batch")
        batch = api.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                   completion_window="2s")
        done = wait_status(api, batch.id, ("expired", "completed"))
    finally:
        runner.execute = execute
    assert done.status == "expired" and done.expired_at
    counts = done.request_counts
    assert counts.total == 30 and counts.completed < 30
    assert counts.completed + counts.failed == 30
    expired = [r for r in rows(api, done.error_file_id) if r["error"]]
    assert len(expired) == counts.failed and expired[0]["response"] is None
    assert {r["error"]["code"] for r in expired} == {"batch_expired"}
    answered = {r["custom_id"] for r in rows(api, done.output_file_id)}
    assert answered.isdisjoint(r["custom_id"] for r in expired)


def test_batch_api_is_off_unless_asked(model_dir: str) -> None:
    """An app built in process (run-batch, an embedding) never opens a server's job store."""
    from fastapi.testclient import TestClient

    app = build_app(EngineConfig.from_kwargs(model=model_dir, **ENGINE), ServerConfig())
    with TestClient(app) as http:
        r = http.get("/v1/batches")
        assert r.status_code == 503 and "off on this server" in r.json()["error"]["message"]


def test_upload_size_limit(model_dir: str, tmp_path: Path) -> None:
    app = build_app(EngineConfig.from_kwargs(model=model_dir, **ENGINE),
                    ServerConfig(batch_api=True, batch_dir=str(tmp_path),
                                 batch_max_file_bytes=1000))
    with run_server(app) as url:
        small = httpx.post(f"{url}/v1/files", data={"purpose": "batch"},
                           files={"file": ("a.jsonl", b"x" * 900)})
        assert small.status_code == 200 and small.json()["bytes"] == 900
        big = httpx.post(f"{url}/v1/files", data={"purpose": "batch"},
                         files={"file": ("b.jsonl", b"x" * 200_000)})
        assert big.status_code == 413 and big.json()["error"]["code"] == "file_too_large"
        over = httpx.post(f"{url}/v1/files", data={"purpose": "batch"},  # caught by the route
                          files={"file": ("c.jsonl", b"x" * 2000)})
        assert over.status_code == 413 and not list((tmp_path / "files").iterdir())[1:]
        # A second server on the same directory leaves its Batch API off, and says why.
        other = build_app(EngineConfig.from_kwargs(model=model_dir, **ENGINE),
                          ServerConfig(batch_api=True, batch_dir=str(tmp_path)))
        with run_server(other) as other_url:
            r = httpx.get(f"{other_url}/v1/batches")
            assert r.status_code == 503 and "in use by another server" in \
                r.json()["error"]["message"]
            assert httpx.get(f"{url}/v1/batches").status_code == 200


def test_batch_lines_enter_the_engine_only_when_nothing_waits_there() -> None:
    """The background lane: while the engine's queue holds requests, no batch line is sent;
    each goes with the batch tier, and not-now answers are retried, not recorded."""
    import asyncio

    from batchinfer.batch import executor
    from batchinfer.batch.jobs import BatchManager

    sent: list[tuple[str, dict]] = []
    answers = [(429, {"error": {"code": "queue_full"}}, None), (200, {"ok": True}, "rid")]

    async def fake_client(url: str, body: dict):
        sent.append((url, body))
        return answers.pop(0)

    room = [False]

    async def scenario() -> None:
        manager = BatchManager(None, fake_client, 4, ready=None,  # type: ignore[arg-type]
                               room=lambda: room[0])
        task = asyncio.ensure_future(manager._handler(asyncio.Event())(
            "/v1/completions", {"prompt": "x"}))
        await asyncio.sleep(0.2)
        assert sent == []  # the queue is busy: nothing sent
        room[0] = True
        assert await asyncio.wait_for(task, 10) == (200, {"ok": True}, "rid")

    executor.RETRY_DELAY_S, saved = 0.01, executor.RETRY_DELAY_S
    try:
        asyncio.run(scenario())
    finally:
        executor.RETRY_DELAY_S = saved
    assert [body for _, body in sent] == [{"prompt": "x", "service_tier": "batch"}] * 2


def test_engine_load_keeps_room_for_interactive_requests_only_while_they_wait() -> None:
    from batchinfer.core.outputs import SchedulerStats
    from batchinfer.server.app import EngineLoad

    load = EngineLoad()
    assert load.room()

    def step(waiting: int, running: int) -> bool:
        stats = SchedulerStats.__new__(SchedulerStats)
        stats.num_waiting, stats.num_running = waiting, running
        load.record_step(stats)
        return load.room()

    assert not step(waiting=2, running=8)  # requests queue behind running ones: hold back
    assert step(waiting=0, running=8)
    assert step(waiting=5, running=0)  # a queue on an idle engine (a static batch filling)
