"""Errors in the shape OpenAI clients parse, and the exception handlers that emit them.

The official clients read ``{"error": {"message", "type", "param", "code"}}`` and
raise ``BadRequestError`` / ``NotFoundError`` / ... from the status code, so
every failure the server reports goes through :class:`APIError` to keep both
the body and the status consistent.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedrs.server import refusals

# OpenAI's error `type` for each status the server uses.
_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "server_overloaded_error",
    504: "timeout_error",
}

# Codes whose failure is not what their status usually means: a dead or stopped engine is no
# overloaded server (a client would wait and retry instead of paging someone).
_CODE_TYPES: dict[str, str] = {
    refusals.ENGINE_DEAD: "engine_dead_error",
    refusals.ENGINE_UNRESPONSIVE: "engine_unresponsive_error",
    refusals.REQUEST_TIMEOUT: "timeout_error",
}

# Seconds a client should wait before retrying a 503 (sent as `Retry-After`).
RETRY_AFTER_S = 1


class APIError(Exception):
    """A failure to report to the client with `status` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = {**default_headers(status), **(headers or {})}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def default_headers(status: int) -> dict[str, str]:
    """Every 503 says when to come back; every 401 names the scheme it wants."""
    if status == 503:
        return {"Retry-After": str(RETRY_AFTER_S)}
    if status == 401:
        return {"WWW-Authenticate": "Bearer"}
    return {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = (_CODE_TYPES.get(code or "") or _ERROR_TYPES.get(status)
                  or HTTPStatus(status).phrase.lower().replace(" ", "_"))
    return {"error": {"message": _printable(message), "type": error_type, "param": param, "code": code}}


_MAX_MESSAGE_CHARS = 2000


def _printable(message: str) -> str:
    """A message that can always be sent: no lone surrogates (UTF-8 cannot carry them), bounded length."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + f"... ({len(message) - _MAX_MESSAGE_CHARS} more characters)"
    return message


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_branch(part: object) -> bool:
    """pydantic names the union member in an error's location ("list[constrained-int]"): not a field.
    A string of digits is no union member but a dict's key (logit_bias's token ids): kept."""
    return isinstance(part, str) and not part.isdigit() and (not part.isidentifier() or part in _TYPE_TAGS)


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per pydantic error: the field path, the value sent and what was wrong.

    A field typed as a union (``prompt``: text, texts or token ids) fails once per member;
    where some member failed on the value, the members that merely had another type are
    left out: "[true, false]: expected an integer, got the boolean" says what to fix,
    "Input should be a valid string" does not.
    """
    errors = exc.errors()
    wrong_value = {_param(err) for err in errors if not str(err.get("type", "")).endswith("_type")}
    parts: list[str] = []
    for err in errors:
        if str(err.get("type", "")).endswith("_type") and _param(err) in wrong_value:
            continue
        loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _is_union_branch(p)]
        message = str(err.get("msg", "")).removeprefix("Value error, ")
        part = f"{'.'.join(loc) or 'body'}: {message} (got {_short_repr(err.get('input'))})"
        if part not in parts:
            parts.append(part)
    params = [_param(err) for err in errors]
    return "; ".join(parts) or "invalid request body", next((p for p in params if p), None)


def _param(err: Any) -> str | None:
    """The request field an error is about (the first part of its location that names a field);
    None when the error is about the body as a whole."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _is_union_branch(p)]
    return loc[0] if loc else None


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _not_an_object(exc: RequestValidationError, content_type: str | None) -> str | None:
    """What is wrong with a body that is no JSON object (None when it is one): FastAPI hands a body
    sent without ``Content-Type: application/json`` to the model as bytes, and pydantic's "Input
    should be a valid dictionary" says nothing of the header that caused it."""
    for err in exc.errors():
        loc = [p for p in err.get("loc", ()) if p != "body" and not _is_union_branch(p)]
        body = err.get("input")
        if loc or isinstance(body, dict):
            continue
        if content_type is None or "json" not in content_type.lower():
            sent = f"Content-Type: {content_type}" if content_type else "no Content-Type header"
            return (f"the request body must be a JSON object sent with Content-Type: application/json; this one "
                    f"came with {sent}")
        return f"the request body must be a JSON object; this one is {_JSON_TYPES.get(type(body), 'no object')}"
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path through the OpenAI shape (FastAPI's default is a 422 `detail`)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(refusals.DeadEngineRefusal)
    async def _engine_dead(_: Request, exc: refusals.DeadEngineRefusal) -> JSONResponse:  # added after it died
        return APIError(503, str(exc), code=refusals.ENGINE_DEAD).response()

    @app.exception_handler(refusals.UnresponsiveEngineRefusal)
    async def _engine_unresponsive(_: Request, exc: refusals.UnresponsiveEngineRefusal) -> JSONResponse:
        return APIError(503, str(exc), code=refusals.ENGINE_UNRESPONSIVE).response()

    @app.exception_handler(refusals.RequestTimeoutError)
    async def _request_timeout(_: Request, exc: refusals.RequestTimeoutError) -> JSONResponse:  # not accepted in time
        return APIError(504, str(exc), code=refusals.REQUEST_TIMEOUT).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        not_an_object = _not_an_object(exc, request.headers.get("content-type"))
        message, param = (not_an_object, None) if not_an_object else _validation_message(exc)
        return JSONResponse(error_body(400, message, param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = {**default_headers(exc.status_code), **(exc.headers or {})}
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=headers)
