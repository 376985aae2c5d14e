"""SSE parsing from raw bytes: content chunks counted, usage and errors decoded."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from batchinfer.bench.client import (
    RequestResult,
    _on_lines,
    build_request,
    error_code,
    error_message,
    send_request,
)
from batchinfer.bench.transport import SlotTransport


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


def completion_chunk(text: str | None) -> bytes:
    return sse({"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None})


def chat_chunk(content: str | None) -> bytes:
    return sse({"choices": [{"index": 0, "delta": {"content": content}}]})


def feed(blocks: list[bytes]) -> RequestResult:
    """Feed reads the way `send_request` does: complete lines only, the rest carried over."""
    result = RequestResult(start_s=0.0)
    pending = b""
    for i, data in enumerate(blocks):
        data = pending + data
        cut = data.rfind(b"\n") + 1
        pending = data[cut:]
        if cut:
            _on_lines(data[:cut], float(i + 1), result)
    return result


def test_completion_stream_split_anywhere() -> None:
    stream = (completion_chunk(" a") + completion_chunk("") + completion_chunk(' "quoted"')
              + completion_chunk(None) + completion_chunk("text")
              + sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
              + sse("[DONE]"))
    for size in (1, 7, 50, len(stream)):
        blocks = [stream[i:i + size] for i in range(0, len(stream), size)]
        result = feed(blocks)
        assert len(result.chunk_times_s) == 3, size
        assert (result.num_prompt_tokens, result.num_usage_output_tokens) == (9, 3)
        assert result.chunk_times_s == sorted(result.chunk_times_s)


def test_chat_role_chunk_is_not_content() -> None:
    stream = (sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
              + chat_chunk("Hi") + chat_chunk(None) + chat_chunk(" there")
              + sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}))
    result = feed([stream])
    assert result.chunk_times_s == [1.0, 1.0]
    assert result.num_usage_output_tokens == 2


def test_error_event_marks_failure() -> None:
    result = feed([completion_chunk("x"), sse({"error": {"message": "engine died"}})])
    assert result.error == "stream error" and "engine died" in result.error_detail


def test_content_that_mentions_error_is_not_an_error() -> None:
    assert feed([completion_chunk("error"), completion_chunk('"error": 1')]).error is None


def test_error_message() -> None:
    assert error_message(b'{"error": {"message": "no such model"}}') == "no such model"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"plain text") == "plain text"


def test_error_code() -> None:
    assert error_code(b'{"error": {"message": "m", "code": "queue_timeout"}}') == "queue_timeout"
    for body in (b'{"error": {"code": 429}}', b'{"error": {"code": null}}', b'{"code": "x"}',
                 b'{"error": "x"}', b"[1]", b"plain text"):
        assert error_code(body) is None, body


def test_slot_transport_reuses_one_connection_per_request_in_flight() -> None:
    from tests.fake_openai_server import FakeServerConfig, run_fake_server

    body = json.dumps({"model": "fake-model", "prompt": "a b", "max_tokens": 3,
                       "stream": True}).encode()

    async def run(base_url: str) -> tuple[list[RequestResult], SlotTransport]:
        transport = SlotTransport(max_slots=2)
        async with httpx.AsyncClient(transport=transport) as client:
            semaphore = asyncio.Semaphore(2)

            async def one() -> RequestResult:
                async with semaphore:
                    request = build_request(client, f"{base_url}/v1/completions", body)
                    return await send_request(client, request)

            results = await asyncio.gather(*[one() for _ in range(6)])
            assert len(transport._all) <= 2 and len(transport._free) == len(transport._all)
            return results, transport

    with run_fake_server(FakeServerConfig(itl_s=0.001)) as base_url:
        results, _ = asyncio.run(run(base_url))
    assert all(r.success and len(r.chunk_times_s) == 3 for r in results)


def test_slot_transport_refuses_more_than_its_slots() -> None:
    transport = SlotTransport(max_slots=1)
    transport._take()
    with pytest.raises(RuntimeError, match="in flight"):
        transport._take()
