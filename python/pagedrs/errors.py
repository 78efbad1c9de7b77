"""Errors that end the engine, as types (a request's own failure ends that request only).

Part of the core's protocol (``pagedrs.core.protocol`` re-exports them); they live here, in
the base layer, so that any layer may raise or catch them.
"""

from __future__ import annotations

__all__ = [
    "EngineCoreDeadError", "EngineCoreError", "EngineDeadError", "FieldError", "PinCapError", "PrefixCacheBusyError",
    "UnknownPinError",
]


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (its executor is gone, the scheduler failed while it
    planned, or the core process died); every request has ended. A request's own failure is
    no EngineDeadError: it ends that request only."""

    fatal = True  # kept for callers outside pagedrs that test it; pagedrs catches the type


class EngineCoreError(RuntimeError):
    """The engine core process failed to start or went away."""

    fatal = True


class EngineCoreDeadError(EngineCoreError, EngineDeadError):
    """The engine core process died (or failed and exited) after it started: it will never step again."""


class PrefixCacheBusyError(RuntimeError):
    """A reset of the prefix cache was refused because requests are in the engine (their pages
    are in use, as vLLM's reset refuses while blocks are held); nothing was cleared. Not fatal."""


class PinCapError(RuntimeError):
    """A pin was refused: it would hold more device pages than ``EngineArgs.max_pinned_fraction``
    of the pool allows (the message names the cap and the numbers); nothing was pinned. Not fatal."""


class UnknownPinError(KeyError):
    """``unpin`` of a pin id that is not live (never made, expired, or unpinned already)."""

    def __str__(self) -> str:  # KeyError's repr-quoting would hide the message
        return str(self.args[0]) if self.args else ""


class FieldError(ValueError):
    """A request's input refused, naming the request field at fault (``param``: "prompt",
    "priority", ...), so that a server reports it in the error's ``param`` as well as in the
    message. A ValueError: callers that catch ValueError see no change."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[FieldError], tuple[str, str]]:
        # both arguments: Exception's own reduce would rebuild it from the message alone, and fail
        return (FieldError, (self.param, str(self)))


class GrammarDeadEnd(ValueError):
    """A structured-output request whose grammar admits no continuation partway through an answer (a
    required property whose schema matches nothing): the request's own constraint is at fault, so the
    request ends with this error, never as a complete answer."""


class NonFiniteLogitsError(RuntimeError):
    """A request's logits held NaN where a token was to be drawn (non-finite weights, or an activation
    that overflowed): its greedy pick would be token 0 and its log-probability NaN, a wrong answer
    with nothing to show it. The request ends with this error (a 500: the model's fault, not the
    request's); the others go on."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"the model's logits were NaN at output token {num_tokens} (non-finite weights or an "
                         "activation that overflowed); no token was drawn")
        self.num_tokens = num_tokens

    def __reduce__(self) -> tuple[type[NonFiniteLogitsError], tuple[int]]:
        return (NonFiniteLogitsError, (self.num_tokens,))


class GrammarLimitError(ValueError):
    """A structured-output grammar that outgrew the grammar engine's parser limits partway through an
    answer (llguidance's items per row, lexer states, fuel: a schema of thousands of properties):
    the request's grammar is too large to follow, so the request ends with this error (a 400)."""


# Errors a request's own input causes while it runs: the core ends the request with ``"<Type>: message"``
# (``EngineCore.fail``) and ``error_by_request`` set, and the server answers those with 400, not 500.
REQUEST_CAUSED: tuple[type[Exception], ...] = (FieldError, GrammarDeadEnd, GrammarLimitError)


def error_param(exc: BaseException) -> str | None:
    """The request field a request-caused error names (``FieldError.param``), carried beside its text so a
    server's 400 reports it in ``param`` (an ``allowed_token_ids`` the grammar masked to nothing mid-answer
    was a 400 with ``param`` null); None for any other error."""
    return exc.param if isinstance(exc, FieldError) else None


def error_text(exc: BaseException) -> tuple[str, bool]:
    """What a failed request carries: its error's text (``"<Type>: message"``) and whether the request's
    own input caused it (``REQUEST_CAUSED``: a 400) rather than the engine or the model (a 500). Why a
    flag and not the text: a message is for people, and a type name read back out of it would break
    the day a message starts with another type's name or a type is renamed."""
    return f"{type(exc).__name__}: {exc}", isinstance(exc, REQUEST_CAUSED)
