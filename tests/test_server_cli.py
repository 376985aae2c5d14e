"""`batchinfer serve` as a process: SIGTERM drains running requests and exits 0; and the
embedded default model answers a question."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from batchinfer.core.config import EngineConfig
from batchinfer.server.app import build_app
from tests.test_server import free_port, run_server
from tests.tiny_models import make_tiny_llama


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health").status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError("the server did not become healthy")


def test_sigterm_past_the_shutdown_timeout_ends_each_stream_cleanly(tmp_path):
    model_dir = make_tiny_llama(tmp_path, max_position_embeddings=2048)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "batchinfer.cli.main", "serve", "--model", str(model_dir),
               "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16M",
               "--shutdown-timeout", "0.4", "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(base_url, proc)
        body = {"model": "default", "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            data = [line[6:] for line in lines if line.startswith("data: ")]
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert data[-1] == "[DONE]"
    usage = json.loads(data[-2])["usage"]
    assert 0 < usage["completion_tokens"] < 2000
    reasons = [c["finish_reason"] for line in data[:-2] for c in json.loads(line)["choices"]]
    assert reasons[-1] == "abort"
    assert "cut 1 unfinished request" in log and "CancelledError" not in log, log


def test_sigterm_finishes_running_requests_then_exits_0(tmp_path):
    model_dir = make_tiny_llama(tmp_path)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "batchinfer.cli.main", "serve", "--model", str(model_dir),
               "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16M",
               "--shutdown-timeout", "60", "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base_url, proc)
        body = {"model": "default", "prompt": "Hello", "max_tokens": 300, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            try:  # admission has stopped: the port is closed, or 503 on a live connection
                status = httpx.post(f"{base_url}/v1/completions", json=body, timeout=5).status_code
            except httpx.HTTPError:
                status = 503
            assert status == 503
            data = [line[6:] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["usage"]["completion_tokens"] == 300
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--max-num-queued-requests", "0"], "max_num_queued_requests"),
     (["--model", "none"], "--embedding-model"),
     (["--max-client-batch-size", "0"], "max_client_batch_size"),
     (["--embedding-max-batch-size", "0"], "max_batch_size")],
)
def test_serve_rejects_bad_flags(flags, named):
    result = subprocess.run([sys.executable, "-m", "batchinfer.cli.main", "serve", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and named in result.stderr


def test_default_model_knows_the_capital_of_france():
    with run_server(build_app(EngineConfig()), timeout_s=600) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="default", max_tokens=32, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
