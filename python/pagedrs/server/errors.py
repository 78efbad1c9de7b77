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

# OpenAI's error `type` for each status the server uses.
_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    404: "not_found_error",
    500: "internal_server_error",
    503: "server_overloaded_error",
}


class APIError(Exception):
    """A failure to report to the client with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per pydantic error: the field path, the value sent and what was wrong."""
    parts: list[str] = []
    first_param: str | None = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None  # the request field; deeper parts name union branches
        first_param = first_param or param
        value = err.get("input")
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')} (got {value!r})")
    return "; ".join(parts) or "invalid request body", first_param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path through the OpenAI shape (FastAPI's default is a 422 `detail`)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)
