"""OpenAI batch files, line by line: what an input line may say and what an output line is.

Input (one JSON object a line): `{"custom_id": str, "method": "POST", "url": one of
`BATCH_URLS`, "body": {...}}`. Output: `{"id": "batch_req_...", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}`, as OpenAI writes it; a line that cannot
run (bad JSON, unknown url, streaming) gets `status_code` 400 and an OpenAI error body, and
`custom_id` null where the line has none to give.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from batchinfer.core.api_errors import error_body

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID_CHARS = 512


class LineError(ValueError):
    """An input line that cannot run; `param` is the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One parsed input line; `error` set means it will not run (its answer is a 400)."""

    index: int  # 0-based position in the file
    custom_id: str | None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: LineError | None = None


def parse_line(index: int, text: str, endpoint: str | None = None) -> BatchLine:
    """Parse line `index` (0-based); `endpoint` (a batch job's) is the only url allowed."""
    try:
        data = _loads(text)
    except json.JSONDecodeError as exc:
        return BatchLine(index, None, error=LineError(
            f"line {index + 1} is not valid JSON: {exc.msg} at column {exc.colno}"))
    except ValueError as exc:
        return BatchLine(index, None, error=LineError(f"line {index + 1}: {exc}"))
    if not isinstance(data, dict):
        return BatchLine(index, None, error=LineError(f"line {index + 1} is not a JSON object"))
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return BatchLine(index, None, error=LineError(
            f"line {index + 1}: custom_id must be a non-empty string of at most "
            f"{MAX_CUSTOM_ID_CHARS} characters", "custom_id"))
    try:
        url, body = _check_request(data, endpoint)
    except LineError as exc:
        return BatchLine(index, custom_id, error=LineError(f"line {index + 1}: {exc}",
                                                           exc.param))
    return BatchLine(index, custom_id, url, body)


def _check_request(data: dict[str, Any], endpoint: str | None) -> tuple[str, dict[str, Any]]:
    method = data.get("method", "POST")
    if method != "POST":
        raise LineError(f"method must be POST, got {method!r}", "method")
    url = data.get("url")
    if url not in BATCH_URLS:
        raise LineError(f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}", "url")
    if endpoint is not None and url != endpoint:
        raise LineError(f"url {url!r} differs from the batch's endpoint {endpoint!r}", "url")
    body = data.get("body")
    if not isinstance(body, dict):
        raise LineError("body must be a JSON object", "body")
    if body.get("stream"):
        raise LineError("stream is not supported in a batch", "body.stream")
    return url, body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _loads(text: str) -> Any:
    """Strict JSON: no NaN / Infinity, no unpaired surrogates (neither can be answered or
    written back as UTF-8 JSON)."""
    data = json.loads(text, parse_constant=_reject_constant)
    if "\\u" in text:  # escapes may spell an unpaired surrogate
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the line holds an unpaired surrogate escape") from None
    return data


def peek(text: str) -> tuple[str | None, str | None]:
    """(custom_id, url) of a line where they are strings, else None: a cheap first pass."""
    try:
        data = _loads(text)
    except ValueError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    custom_id, url = data.get("custom_id"), data.get("url")
    return (custom_id if isinstance(custom_id, str) and custom_id else None,
            url if isinstance(url, str) else None)


def output_line(custom_id: str | None, status_code: int, body: Any,
                request_id: str | None = None) -> dict[str, Any]:
    """An output line as OpenAI writes one."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code,
                         "request_id": request_id or uuid.uuid4().hex, "body": body},
            "error": None}


def rejected_line(line: BatchLine) -> dict[str, Any]:
    """The 400 answer of a line that cannot run."""
    assert line.error is not None
    return output_line(line.custom_id, 400, error_body(400, str(line.error), param=line.error.param,
                                                       code="invalid_batch_line"))
