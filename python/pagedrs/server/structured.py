"""Every way a request may ask for structured output, turned into one ``StructuredOutputsParams``.

On both endpoints (vLLM's current names first):

* ``structured_outputs``: ``{"json": schema | "regex": str | "choice": [str] | "grammar": str |
  "json_object": true}``, exactly one (vLLM's ``StructuredOutputsParams``);
* ``response_format`` (OpenAI): ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "description", "strict"}}``;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

A request uses one of them; two are a 400 naming both. A value llguidance cannot compile is a
400 naming the field the client sent (``response_format.json_schema.schema``, ``guided_regex``...)
and llguidance's message; the size and depth limits (``pagedrs.sampling_params``:
``MAX_STRUCTURED_SPEC_BYTES``, ``MAX_SCHEMA_DEPTH``, ``MAX_CHOICES``) likewise. The compile check
runs in a worker thread, so a large schema never blocks the event loop; its result is cached,
so the engine's own check at submit costs nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from pagedrs.core.structured import grammar
from pagedrs.sampling_params import StructuredOutputsParams
from pagedrs.server.errors import bad_request

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


async def structured_outputs(body: Any) -> Optional[StructuredOutputsParams]:
    """The request's constraint (None: free text), checked; an APIError 400 naming the field otherwise."""
    found = _sources(body)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _, _ in found)
        raise bad_request(f"{names} each ask for structured output: send one of them", param=found[1][0])
    return await checked(*found[0])


async def checked(name: str, kind: str, value: Any) -> StructuredOutputsParams:
    """``StructuredOutputsParams(kind=value)``, compiled once off the event loop; a 400 naming ``name`` otherwise."""
    try:
        params = StructuredOutputsParams(**{kind: value})
        await asyncio.to_thread(grammar.check, params)
    except ValueError as exc:
        raise bad_request(f"{name}: {exc}", param=name) from exc
    return params


def _sources(body: Any) -> list[tuple[str, str, Any]]:
    """(the field the client sent, the StructuredOutputsParams field, its value) for each way it asked."""
    found: list[tuple[str, str, Any]] = []
    so = body.structured_outputs
    if so is not None:
        given = so.model_dump(exclude_none=True)
        if given.get("json_object") is False:
            given.pop("json_object")
        if len(given) != 1:
            raise bad_request("structured_outputs needs exactly one of json, regex, choice, grammar, json_object=true; "
                              f"got {', '.join(given) or 'none'}", param="structured_outputs")
        kind, value = next(iter(given.items()))
        found.append((f"structured_outputs.{kind}", kind, value))
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", True))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request('response_format of type "json_schema" needs json_schema.schema', param="response_format")
        found.append(("response_format.json_schema.schema", "json", rf.json_schema.schema_))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            found.append((field, kind, value))
    return found
