"""The request guard: pure ASGI middleware in front of every route.

Every response carries `X-Request-Id` (the client's, when it is plain and bounded, or a new
one). Then, in order: a malformed `X-Request-Id` (400), `--api-key` on everything but `/health`
and `/metrics` (401), draining (503), body size (413: `Content-Length`, or the bytes received,
so a chunked upload cannot get round it).
"""

from __future__ import annotations

import hmac
import re
import uuid
from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from fastapi.responses import Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchinfer.server.dashboard import DASHBOARD_COOKIE, DASHBOARD_PATHS
from batchinfer.server.errors import APIError, error_response

if TYPE_CHECKING:
    from batchinfer.server.app import ServerState

UNGUARDED_PATHS = ("/health", "/metrics", "/version")
# Without the API key, only these answer: probes and scrapers carry no key. Everything else
# (/v1/*, /tokenize, /detokenize, /version, /docs, /openapi.json) costs work or shows the API.
OPEN_PATHS = ("/health", "/metrics")
UPLOAD_PATH = "/v1/files"
# A client's X-Request-Id is echoed back and names its requests in logs and engine ids (which
# add `@` and `#`): bounded and plain, or the request is refused with a fresh id.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


class RequestGuard:
    """Pure ASGI middleware: `X-Request-Id` on every response, then the API key (401 on
    `/v1/*`), draining (503) and the body size (413: `Content-Length`, or the bytes received,
    so a chunked upload cannot get round it)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        # Authorization header -> owner of what it creates (a digest of the key)
        from batchinfer.server.batches import owner_digest

        self._owners = {f"Bearer {key}".encode(): owner_digest(key)
                        for key in state.config.api_keys}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get("x-request-id")
        valid = given is None or REQUEST_ID.fullmatch(given) is not None
        request_id = given if given is not None and valid else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        send = _with_request_id(send, request_id)
        path: str = scope["path"]
        error: Response | None = None if valid else error_response(
            400, "X-Request-Id must be 1 to 128 letters, digits or ._:/+=- characters",
            param="X-Request-Id", code="invalid_request_id")
        error = error or self._check(path, headers, scope["state"], scope.get("query_string", b""))
        if error is None and path == UPLOAD_PATH and scope["method"] == "POST":
            # A multipart upload, streamed to disk by the route: only its size is bounded here.
            error, receive = self._bound_upload(headers, receive)
        elif error is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, error = await self._read_body(headers, receive)
            receive = _replay(body, receive)
            _as_json(scope, headers)
        if error is not None:
            await error(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, path: str, headers: Headers, scope_state: dict[str, Any],
               query: bytes = b"") -> Response | None:
        given = headers.get("authorization", "").encode()
        if not given and path in DASHBOARD_PATHS:
            # A browser cannot send the header: the key comes once as ?api_key= (the page then
            # sets it as a cookie and drops it from its address) and then as that cookie.
            cookie = SimpleCookie(headers.get("cookie", "")).get(DASHBOARD_COOKIE)
            keys = parse_qs(query.decode("latin-1")).get("api_key") or \
                ([cookie.value] if cookie is not None else [])
            given = f"Bearer {keys[0]}".encode() if keys else b""
        batch_api = self.state.batch_api
        if batch_api is not None and hmac.compare_digest(given,
                                                         f"Bearer {batch_api.token}".encode()):
            scope_state["owner"] = ""  # the server's own batch jobs
        elif self._owners and path not in OPEN_PATHS:
            owner = next((o for auth, o in self._owners.items()
                          if hmac.compare_digest(given, auth)), None)
            if owner is None:
                return error_response(401, "missing or wrong API key: send "
                                      "'Authorization: Bearer <key>'", code="invalid_api_key")
            scope_state["owner"] = owner
        if self.state.draining and path not in UNGUARDED_PATHS:
            return error_response(503, "the server is shutting down", code="shutting_down")
        return None

    def _bound_upload(self, headers: Headers, receive: Receive
                      ) -> tuple[Response | None, Receive]:
        limit = self.state.config.batch_max_file_bytes
        message = f"the upload exceeds {limit} bytes (--batch-max-file-bytes)"
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit + (64 << 10):
            return error_response(413, message, code="file_too_large"), receive
        received = 0

        async def bounded() -> Message:
            nonlocal received
            event = await receive()
            received += len(event.get("body", b""))
            if received > limit + (64 << 10):  # the file plus its multipart headers
                raise APIError(413, message, code="file_too_large")
            return event

        return None, bounded

    async def _read_body(self, headers: Headers, receive: Receive) -> tuple[bytes, Response | None]:
        limit = self.state.config.max_request_bytes
        too_large = error_response(413, f"the request body exceeds {limit} bytes "
                                   "(--max-request-bytes)", code="request_too_large")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            if length.isdigit():
                return b"", too_large
            return b"", error_response(400, "malformed Content-Length header",
                                       code="invalid_value")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left; the app will see it when it reads
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None


def _as_json(scope: Scope, headers: Headers) -> None:
    """Every body here is JSON: `curl -d` sends it as a form, so read it as JSON anyway."""
    if headers.get("content-type", "").startswith("application/json"):
        return
    scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    scope["headers"].append((b"content-type", b"application/json"))


def _with_request_id(send: Send, request_id: str) -> Send:
    header = (b"x-request-id", request_id.encode("latin-1", "replace"))

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message)
            headers = list(message.get("headers", []))
            if all(name.lower() != b"x-request-id" for name, _ in headers):
                headers.append(header)
            message["headers"] = headers
        await send(message)

    return send_with_id


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A `receive` that yields the already-read body once, then the client's next messages."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
