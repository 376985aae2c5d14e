"""The server's error convention: every error is an OpenAI-style JSON body, never a 422.

`{"error": {"message", "type", "param", "code"}}` with the status code of its cause:
bad input 400 (pydantic validation, malformed JSON, `ValueError`; `param` names the field when
known), unknown route 404, queue full 429 + `Retry-After`, queue timeout 503 + `Retry-After`, anything else 500
with the request id so a log line can be found. Handlers raise `APIError` for anything else.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchinfer.batching.errors import BatcherClosedError, ItemTimeoutError, OverloadedError
from batchinfer.core.api_errors import error_body, error_type

logger = logging.getLogger(__name__)

class APIError(Exception):
    """An error with its HTTP status; raise it from a handler and the app renders it."""

    def __init__(self, status_code: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | int | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or error_type(status_code)
        self.param = param
        self.code = code
        self.headers = dict(headers) if headers else None

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.type, self.param, self.code)


def error_response(status_code: int, message: str, type: str | None = None,
                   param: str | None = None, code: str | int | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error response."""
    return api_error_response(APIError(status_code, message, type, param, code, headers))


def api_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def to_api_error(exc: Exception, request_id: str | None = None) -> APIError:
    """Map any exception to its `APIError` (the rules of the module docstring)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, OverloadedError):
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        return APIError(429, str(exc), code="overloaded", headers={"Retry-After": retry_after})
    if isinstance(exc, ItemTimeoutError):
        return APIError(503, str(exc), code="queue_timeout", headers={"Retry-After": "1"})
    if isinstance(exc, BatcherClosedError):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, ValidationError):  # a model built inside a handler
        return validation_error(exc)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=getattr(exc, "param", None), code="invalid_value")
    where = f" (request id {request_id})" if request_id else ""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}{where}",
                    code="internal_error")


def first_invalid_text(value: Any, path: str = "") -> str | None:
    """The path (`messages.0.content`) of the first string in `value` (a parsed JSON body:
    models, dicts, lists) that is not valid Unicode, or None. JSON may escape a lone surrogate
    (`"\\ud800"`); no encoder or tokenizer can take one."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, UnicodeChecked) and path:
        return None  # a nested schema checked itself when it was built
    if isinstance(value, BaseModel):
        items: Any = ((name, getattr(value, name)) for name in type(value).model_fields)
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        found = first_invalid_text(key, where) or first_invalid_text(item, where)
        if found is not None:
            return found
    return None


class UnicodeChecked(BaseModel):
    """A request schema whose strings must all be valid Unicode (400 naming the field)."""

    @model_validator(mode="after")
    def _valid_unicode(self) -> UnicodeChecked:
        where = first_invalid_text(self)
        if where is not None:
            error = ValueError(f"{where} is not valid Unicode (a lone surrogate, "
                               "\\ud800-\\udfff)")
            error.param = where.split(".")[0]  # type: ignore[attr-defined]
            raise error
        return self


def validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    """A pydantic validation failure -> 400 naming the first failing field, in our words."""
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        reason = detail.get("ctx", {}).get("error", detail.get("msg", ""))
        return APIError(400, f"malformed JSON body: {reason}", code="invalid_json")
    message, param = describe_errors(errors)
    return APIError(400, message, param=param, code="invalid_value")


# What a value must be, per pydantic error type and per union member's tag.
_KINDS = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
          "float_type": "a number", "float_parsing": "a number", "string_type": "a string",
          "bool_type": "true or false", "bool_parsing": "true or false", "list_type": "a list",
          "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object", "none_required": "null"}
_TAGS = {"str": ("a string", "strings"), "int": ("an integer", "integers"),
         "float": ("a number", "numbers"), "bool": ("true or false", "booleans"),
         "none": ("null", "nulls")}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
_ORIGINS = ("body", "query", "path", "header")  # where FastAPI found the value


def describe_errors(errors: list[Any]) -> tuple[str, str | None]:
    """(message, param) of the first of pydantic's `errors`: the field's path as a client
    writes it (`messages[0].content`), what is wrong with it, and its top-level name."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = list(first.get("loc", ()))
    while loc and loc[0] in _ORIGINS:
        loc = loc[1:]
    # A union's members each report an error under a tag (`str`, `list[int]`): say what the
    # field may be, not why each member failed.
    tag_at = next((i for i, part in enumerate(loc) if _is_tag(part)), None)
    cause = first.get("ctx", {}).get("error")
    param = (str(loc[0]) if loc and tag_at != 0 else None) or getattr(cause, "param", None)
    if tag_at is not None and len(errors) > 1:
        base = loc[:tag_at]
        tags: list[str] = []
        for error in errors:
            at = [part for part in error.get("loc", ()) if part not in _ORIGINS]
            if at[:tag_at] == base and len(at) > tag_at and _is_tag(at[tag_at]):
                text = _tag_text(str(at[tag_at]))
                if text not in tags:
                    tags.append(text)
        choices = ", ".join(tags[:-1]) + f" or {tags[-1]}" if len(tags) > 1 else tags[0]
        return f"{_path(base)} must be {choices}", param
    where = _path([part for part in loc if not _is_tag(part)])
    kind = first.get("type", "")
    ctx = first.get("ctx", {})
    if isinstance(cause, Exception):
        message = str(cause)
        return (message if not where or message.startswith(where) else f"{where}: {message}",
                param)
    if not where:
        return ("the request body must be a JSON object" if kind in _KINDS
                else first.get("msg", "invalid request")), None
    if kind == "missing":
        return f"{where} is required", param
    if kind == "finite_number":
        return f"{where} must be a finite number", param
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        return f"{where} must be {sign} {ctx.get(key)}", param
    if kind == "too_short":
        least = ctx.get("min_length")
        return f"{where} must hold at least {least} item{'' if least == 1 else 's'}", param
    if kind == "too_long":
        return f"{where} may hold at most {ctx.get('max_length')} items", param
    if kind == "literal_error":
        return f"{where} must be {ctx.get('expected')}", param
    if kind in _KINDS:
        return f"{where} must be {_KINDS[kind]}", param
    return f"{where}: {first.get('msg', 'invalid value')}", param


def _is_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _TAGS or "[" in part or part[:1].isupper())


def _tag_text(tag: str, plural: bool = False) -> str:
    """`list[int]` -> "a list of integers"."""
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _tag_text(tag[5:-1], plural=True)
        return f"lists of {inner}" if plural else f"a list of {inner}"
    if tag in _TAGS:
        return _TAGS[tag][plural]
    return "objects" if plural else "an object"


def _path(loc: list[Any]) -> str:
    """`["messages", 0, "content"]` -> "messages[0].content"."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers on `app` (the generative and the embedding server share them)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return api_error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return api_error_response(APIError(exc.status_code, str(exc.detail),
                                           headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        request_id = _request_id(request)
        error = to_api_error(exc, request_id)
        if error.status_code >= 500 and not isinstance(exc, APIError):
            logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        response = api_error_response(error)
        if request_id is not None:
            # An unexpected exception is answered outside the request guard, which adds the
            # header to every other response; add it here (the guard never adds it twice).
            response.headers["x-request-id"] = request_id
        return response

    # Starlette looks handlers up by class (MRO) before falling back to the 500 middleware,
    # so these return their own status without the generic handler's 500 log line.
    for cls in (APIError, ValueError, OverloadedError, ItemTimeoutError, BatcherClosedError):
        app.add_exception_handler(cls, _any)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None) or request.headers.get("x-request-id")
