"""`batchinfer serve --model <folder>` for each family added beyond Llama, over real HTTP: a
server process on a free port (stopped by its PID) answers the `openai` client with
transformers' greedy tokens (each token's text, as the logprobs name it), and a chat
completion through the folder's chat template."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer

import batchinfer
from tests.test_model_families import hf_greedy, hf_model
from tests.test_server import free_port
from tests.test_server_cli import wait_healthy
from tests.tiny_models import make_tiny_llama, make_tiny_tokenizer

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("gemma2", {"sliding_window": 8, "attn_logit_softcapping": 2.0}),
    "gemma3": ("gemma3", {"sliding_window": 8,
                          "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen3-moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
}
# A server process takes 10-20 s on a busy laptop: the default run starts two.
SLOW = {"gemma2", "mistral-window"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in FAMILIES])
def test_serve_answers_the_openai_client(tmp_path: Path, name: str) -> None:
    family, overrides = FAMILIES[name]
    folder = make_tiny_llama(tmp_path, family, **overrides)
    prompt = make_tiny_tokenizer().encode("The capital of France is", add_special_tokens=False)
    torch.set_num_threads(1)
    expected = hf_greedy(hf_model(folder), prompt, 12)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "batchinfer.cli.main", "serve", "--model", str(folder),
               "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "16M",
               "--block-size", "4", "--log-level", "warning"]
    # The server runs the batchinfer this test imports (not another checkout's install).
    env = {**os.environ, "PYTHONPATH": str(Path(batchinfer.__file__).parents[1])}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        try:
            wait_healthy(base_url, proc)
        except RuntimeError as exc:
            proc.kill()
            raise RuntimeError(f"{exc}: {proc.communicate()[1]}") from None
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        completion = client.completions.create(
            model=str(folder), prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True})
        chat = client.chat.completions.create(
            model=str(folder), max_tokens=6, temperature=0,
            messages=[{"role": "user", "content": "Hello world!"}])
    finally:
        proc.terminate()  # by PID
        proc.wait(timeout=60)
    choice = completion.choices[0]
    assert choice.logprobs is not None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in expected]
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
