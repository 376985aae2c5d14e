"""The OpenAI-style error body, `{"error": {"message", "type", "param", "code"}}`.

Pure Python and below every layer that answers requests: the server's handlers
(`server.errors.APIError`), the batch runners' answers to lines that cannot run, and Ray Serve's
ingress all write the same body with the same `type` per status.
"""

from __future__ import annotations

from typing import Any

# Error `type` per status, in the names vLLM's OpenAI server uses.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


def error_type(status_code: int) -> str:
    """The `type` of an error answered with `status_code` ("APIError" for one not listed)."""
    return ERROR_TYPES.get(status_code, "APIError")


def error_body(status_code: int, message: str, type: str | None = None,
               param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """The body of an error answered with `status_code`; `type` defaults to its status's."""
    return {"error": {"message": message, "type": type or error_type(status_code),
                      "param": param, "code": code}}
