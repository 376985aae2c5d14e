"""One streamed request over HTTP, timed chunk by chunk, plus the checks run before a benchmark.

The client must not be the bottleneck, so the stream is read as raw bytes: the content chunks
of each read are counted with a few byte searches, and a line is JSON-decoded only when it
carries `usage` or an error (vLLM's client decodes every chunk; the timings are the same).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from batchinfer.bench.workload import WORDS, BenchRequest

JSON_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# A content chunk has a non-empty `text` (completions) or `delta.content` (chat). Inside a JSON
# string a quote is escaped, so these byte patterns can only be keys with their values.
CONTENT_MARKERS = (b'"text":"', b'"text": "', b'"content":"', b'"content": "')
EMPTY_MARKERS = (b'"text":""', b'"text": ""', b'"content":""', b'"content": ""')
# Lines worth decoding: a non-null usage, or an error event.
SPECIAL_MARKERS = (b'"usage":{', b'"usage": {', b'"error"')


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are `time.perf_counter()` seconds; a content chunk is an
    SSE chunk whose `text` (completions) or `delta.content` (chat) is non-empty."""

    start_s: float
    num_prompt_tokens_est: int = 0  # the workload's estimate, used if usage is missing
    end_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None  # from the server's usage
    num_usage_output_tokens: int | None = None  # from the server's usage
    # A short, countable reason: "HTTP 500", "HTTP 503 queue_timeout" (the status and the
    # body's string error code, if any), "RemoteProtocolError".
    error: str | None = None
    error_detail: str | None = None
    request_class: str | None = None  # the `--mix` class it was sent as

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.start_s

    @property
    def e2el_s(self) -> float:
        """Start to the last content chunk, as `vllm bench serve` measures it."""
        return self.chunk_times_s[-1] - self.start_s

    @property
    def num_input_tokens(self) -> int:
        """The server's `usage.prompt_tokens`; the workload's estimate if it sent none."""
        if self.num_prompt_tokens is not None:
            return self.num_prompt_tokens
        return self.num_prompt_tokens_est

    @property
    def num_output_tokens(self) -> int:
        """The server's `usage.completion_tokens`; the number of content chunks if it sent none."""
        if self.num_usage_output_tokens is not None:
            return self.num_usage_output_tokens
        return len(self.chunk_times_s)


def request_body(
    request: BenchRequest, endpoint: str, model: str, ignore_eos: bool = True
) -> bytes:
    """The encoded JSON body of a streamed request (`endpoint`: `completions` or `chat`)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if request.request_class is not None:
        body["service_tier"] = request.request_class
    if endpoint == "chat":
        body["messages"] = _messages(request)
    elif request.messages is not None:
        raise ValueError("a dataset with 'messages' needs --endpoint chat")
    elif request.system_prompt is not None:
        body["prompt"] = f"{request.system_prompt}\n{request.prompt}"
    else:
        body["prompt"] = request.prompt
    return json.dumps(body).encode()


def _messages(request: BenchRequest) -> list[dict[str, Any]]:
    if request.messages is not None:
        return list(request.messages)
    messages = [{"role": "user", "content": request.prompt}]
    if request.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": request.system_prompt})
    return messages


def build_request(client: httpx.AsyncClient, url: str, body: bytes) -> httpx.Request:
    """The POST of `body` to `url`, built ahead so that sending it costs no URL or header work."""
    return client.build_request("POST", url, content=body, headers=JSON_HEADERS)


async def send_request(client: httpx.AsyncClient, request: httpx.Request) -> RequestResult:
    """Send `request`, read its SSE stream and time each content chunk. Never raises for a
    failed request: the failure is recorded in `error` and counted by the caller."""
    result = RequestResult(start_s=time.perf_counter())
    try:
        response = await client.send(request, stream=True)
        try:
            await _read_response(response, result)
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
        result.error_detail = str(exc) or type(exc).__name__
    finally:
        result.end_s = time.perf_counter()
    return result


async def _read_response(response: httpx.Response, result: RequestResult) -> None:
    if response.status_code != 200:
        await response.aread()
        code = error_code(response.content)
        result.error = f"HTTP {response.status_code}" + (f" {code}" if code else "")
        result.error_detail = error_message(response.content)
        return
    if "text/event-stream" not in response.headers.get("content-type", ""):
        result.error = "not a stream"
        result.error_detail = f"content-type {response.headers.get('content-type')!r}"
        return
    pending = b""
    async for data in response.aiter_raw():
        now = time.perf_counter()  # one timestamp a read: when these bytes arrived
        data = pending + data if pending else data
        cut = data.rfind(b"\n") + 1  # complete lines only; the rest waits for more
        pending = data[cut:]
        if cut:
            _on_lines(data[:cut], now, result)
    if result.error is None and not result.chunk_times_s:
        result.error = "no content"
        result.error_detail = "the stream ended without a content chunk"


def _on_lines(block: bytes, now: float, result: RequestResult) -> None:
    """Account for complete SSE lines that arrived at `now`: count their content chunks from
    the raw bytes, and JSON-decode only the lines that carry usage or an error."""
    num_content = sum(map(block.count, CONTENT_MARKERS)) - sum(map(block.count, EMPTY_MARKERS))
    if num_content > 0:
        result.chunk_times_s.extend([now] * num_content)
    for marker in SPECIAL_MARKERS:
        found = block.find(marker)
        while found >= 0:
            start = block.rfind(b"\n", 0, found) + 1
            end = block.find(b"\n", found)
            end = len(block) if end < 0 else end
            line = block[start:end]
            if line.startswith(b"data:"):
                _on_special(json.loads(line[5:]), result)
            found = block.find(marker, end)


def _on_special(data: Any, result: RequestResult) -> None:
    if not isinstance(data, dict):
        return
    if "error" in data or data.get("object") == "error":
        result.error = "stream error"
        result.error_detail = error_message(json.dumps(data).encode())
        return
    usage = data.get("usage")
    if isinstance(usage, dict):
        result.num_prompt_tokens = usage.get("prompt_tokens", result.num_prompt_tokens)
        result.num_usage_output_tokens = usage.get("completion_tokens")


def error_message(content: bytes) -> str:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`), or its text."""
    try:
        data = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return content[:200].decode(errors="replace").strip() or "(empty body)"
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        error = error.get("message") or error.get("detail") or error
    return str(error)[:200]


def error_code(content: bytes) -> str | None:
    """The string `code` of an OpenAI-style error body (`queue_timeout`), or None."""
    try:
        data = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and code else None


async def served_models(client: httpx.AsyncClient, base_url: str) -> list[str] | None:
    """The model ids listed at `GET /v1/models`, or None if the server has no such route.
    Raises `ValueError` if the server cannot be reached."""
    try:
        response = await client.get(f"{base_url}/v1/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach server at {base_url}: {_describe(exc)}") from None
    try:
        data = response.json()["data"] if response.status_code == 200 else None
        return None if data is None else [str(m["id"]) for m in data]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def resolve_model(model: str | None, served: list[str] | None, base_url: str) -> str:
    """`model` if the server serves it (or cannot say), else the first served model."""
    if model is not None:
        if served is not None and model not in served:
            raise ValueError(f"model {model!r} is not served at {base_url} "
                             f"(it serves: {', '.join(served) or 'nothing'})")
        return model
    if not served:
        raise ValueError(f"server at {base_url} lists no models at /v1/models; pass --model")
    return served[0]


async def check_server(client: httpx.AsyncClient, url: str, body: bytes, model: str) -> None:
    """Send one short request before measuring (for servers without `/v1/models`); raise
    `ValueError` with the cause if the server is unreachable, does not know `model` (404), or
    rejects the request."""
    result = await send_request(client, build_request(client, url, body))
    if result.error is None:
        return
    if result.error.startswith("HTTP 404"):
        raise ValueError(f"{url} returned HTTP 404 for model {model!r}: {result.error_detail}")
    if result.error.startswith("HTTP"):
        raise ValueError(f"{url} returned {result.error}: {result.error_detail}")
    if result.error in ("ConnectError", "ConnectTimeout"):
        raise ValueError(f"cannot reach server at {url}: {result.error_detail}")
    raise ValueError(f"test request to {url} failed: {result.error}: {result.error_detail}")


async def calibrate_tokens_per_word(
    client: httpx.AsyncClient, base_url: str, model: str
) -> float | None:
    """Tokens per word of `WORDS` as the server's tokenizer counts them (`POST /tokenize`, as
    vLLM serves it); None if the server has no such route."""
    num_words = 256
    text = " ".join(WORDS[i % len(WORDS)] for i in range(num_words))
    try:
        response = await client.post(f"{base_url}/tokenize", json={"model": model, "prompt": text})
        count = response.json().get("count") if response.status_code == 200 else None
    except (httpx.HTTPError, json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(count, int) or count <= 0:
        return None
    return count / num_words


def _describe(exc: Exception) -> str:
    return str(exc) or type(exc).__name__
