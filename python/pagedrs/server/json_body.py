"""Request bodies parsed strictly: UTF-8 JSON text in which no object repeats a key.

Why: FastAPI parses a body with ``json.loads``, which keeps the last of two equal keys, so a
client that sends ``max_tokens`` twice has one value silently ignored (a wrong answer with a
200); and it answers a body that is not UTF-8, or that nests deeper than Python's recursion
limit, with "There was an error parsing the body", which does not say what to fix. Here each
of those is a 400 that names the problem: the repeated key, the byte that is not UTF-8 and its
offset, or the line and column of a syntax error.

``StrictJSONRoute`` is the app's route class (``app.router.route_class``): its handlers get a
``StrictJSONRequest``, whose ``json()`` FastAPI calls to read a JSON body.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute


def parse(body: bytes) -> Any:
    """``body`` as JSON; HTTPException 400 naming what is wrong (see the module docs)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HTTPException(400, f"the request body is not UTF-8 text: byte 0x{body[exc.start]:02x} at offset "
                                 f"{exc.start} ({exc.reason}); a JSON body must be UTF-8 (RFC 8259)") from None
    try:
        return json.loads(text, object_pairs_hook=unique_keys("the request body"))
    except RepeatedKeyError as exc:
        raise HTTPException(400, str(exc)) from None
    except json.JSONDecodeError as exc:
        raise HTTPException(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
                                 f"{exc.colno} (offset {exc.pos})") from None
    except ValueError as exc:  # Python's cap on integer literals (sys.get_int_max_str_digits)
        raise HTTPException(400, f"the request body holds an integer of more digits than this server reads ({exc}); "
                                 "no field takes a number that large") from None
    except RecursionError:
        raise HTTPException(400, "the request body nests arrays or objects deeper than this server parses "
                                 "(about 1000 levels)") from None


class RepeatedKeyError(ValueError):
    pass


def unique_keys(where: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json.loads`` ``object_pairs_hook`` that refuses a key repeated in one object: RepeatedKeyError
    naming the key and ``where`` the JSON came from ("the request body", a file's line)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise RepeatedKeyError(f"{where} has the key {key!r} twice in one object; each key may appear "
                                       "once (JSON parsers keep one of the two values, so the other would be ignored)")
            out[key] = value
        return out

    return hook


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict
