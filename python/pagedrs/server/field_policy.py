"""Which request fields the server honours, which it refuses, and the few it ignores on purpose.

Every name a client sends in a request body (and in each message, content part and
``stream_options``) is exactly one of:

* **honoured**: declared on the request models (protocol.py) and acted on;
* **ignored on purpose**: listed in ``IGNORED_FIELDS`` with the reason; only fields whose
  value cannot change what is generated qualify (docs/limits_and_safety.md lists them);
* **not supported yet**: declared with ``not_supported(reason, *honoured_values)``: null, and
  any value that asks for what pagedrs does anyway (``store: false``,
  ``guided_decoding_backend: "llguidance"``), is accepted; any other value is a 400 naming the field;
* **unknown**: any other name is a 400 naming it (``extra="forbid"``; ``name_unknown_fields``
  rewrites pydantic's "Extra inputs are not permitted" into a message a client can act on).

tests/test_server_fields.py walks every field of the request types in the pinned ``openai``
package and checks each is honoured or refused, so a field OpenAI adds cannot slip through.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import AfterValidator, ValidationError, ValidatorFunctionWrapHandler
from pydantic_core import InitErrorDetails, PydanticCustomError

# Accepted and ignored on purpose: none of them can change what the model generates.
IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; nothing in pagedrs reads it",
    "safety_identifier": "the newer name of `user`, for the same purpose",
    "metadata": "tags for OpenAI's stored completions; pagedrs stores no completion",
    "prompt_cache_key": "OpenAI's routing hint for cache hit rates; pagedrs caches every prompt prefix anyway "
    "(which requests may share cached pages is `cache_salt`'s business)",
}

# Message roles the chat template is given as they are.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def not_supported(reason: str, *honoured: Any) -> AfterValidator:
    """The validator of a field pagedrs does not implement: null or a value in ``honoured``, else a 400.

    ``honoured`` values ask for what pagedrs does anyway; they must match in type too
    (``store: 0`` is not ``store: false``). Use as ``Annotated[Any, not_supported(...)] = None``.
    """
    accepted = " or ".join(["null", *(json.dumps(v) for v in honoured)])

    def check(value: Any) -> Any:
        if value is None or any(value == h and type(value) is type(h) for h in honoured):
            return value
        raise PydanticCustomError(
            "not_supported", "not supported yet ({reason}); remove the field or send {accepted}",
            {"reason": reason, "accepted": accepted},
        )

    return AfterValidator(check)


def check_role(role: str) -> str:
    if role in CHAT_ROLES:
        return role
    if role == "function":
        raise PydanticCustomError(
            "not_supported", "{role} messages are not supported yet (the legacy functions API): use 'tool' messages",
            {"role": repr(role)},
        )
    raise PydanticCustomError(
        "invalid_role", "unknown role {role}: a message's role is one of {allowed}",
        {"role": repr(role), "allowed": ", ".join(repr(r) for r in CHAT_ROLES)},
    )


_IGNORED_HINT = "accepted and ignored on purpose: " + ", ".join(IGNORED_FIELDS)


def name_unknown_fields(data: Any, handler: ValidatorFunctionWrapHandler, hint: str = _IGNORED_HINT) -> Any:
    """A wrap validator: pydantic's "extra inputs are not permitted" says what to do instead.
    ``hint`` ends the message (the request bodies': the fields accepted and ignored on purpose)."""
    try:
        return handler(data)
    except ValidationError as exc:
        errors = exc.errors()
        if not any(e["type"] == "extra_forbidden" for e in errors):
            raise
        raise ValidationError.from_exception_data(exc.title, [_rebuilt(e, hint) for e in errors]) from None


def _rebuilt(error: Any, hint: str) -> InitErrorDetails:
    """The same error (type name, message, location), or the explanation of an unknown field."""
    if error["type"] == "extra_forbidden":
        kind = PydanticCustomError(
            "unknown_field",
            "{name} is not a field this server knows, so it is refused rather than ignored; remove it ({hint})",
            {"name": str(error["loc"][-1]), "hint": hint},
        )
    else:  # the message as rendered: a custom error type cannot be rebuilt from its name
        kind = PydanticCustomError(error["type"], "{message}", {"message": error["msg"]})
    return InitErrorDetails(type=kind, loc=error["loc"], input=error["input"])
