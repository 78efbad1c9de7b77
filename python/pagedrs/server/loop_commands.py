"""What crosses into the engine thread: ``EngineLike``, the part of the Engine the loop drives, and the
commands an HTTP handler's thread queues for the loop (add, abort, fail all, stop, wake).

Apart from engine_loop.py, which applies them, because these are the loop's interface: read on their
own, they say everything a handler can ask of the engine thread and everything the loop asks of an engine.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedrs.server.loop_call import LoopCall
from pagedrs.server.sinks import Sink


class EngineLike(Protocol):
    """The part of ``pagedrs.Engine`` the loop drives (see docs/ENGINE_API.md).

    ``submit`` is the one way in (from the handler's thread; answered on the loop thread).
    ``check_alive()`` is called between idle turns (raises ``EngineDeadError`` once the engine
    is gone); ``liveness()`` is ``(code, message)`` while it cannot serve, else None.
    """

    max_model_len: int
    vocab_size: int
    tokenizer: Any

    def submit(
        self, request_id: str, prompt: Any, params: Any, priority: int, on_ack: Callable[[BaseException | None], None],
        cache_salt: str | None = None, arrival_time: float | None = None,
    ) -> None: ...
    def step(self) -> list[Any]: ...
    def abort(self, request_id: str) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def check_alive(self) -> None: ...
    def liveness(self) -> tuple[str, str] | None: ...


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: Any
    priority: int
    sink: Sink
    cache_salt: str | None = None
    accepted: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    """Abort everything in flight with ``message``, and refuse later adds (the drain deadline)."""

    message: str
    status: int


class _Stop:
    pass


class _Wake:
    """Nothing to apply: wakes an idle loop so it steps the engine, which answers the add just submitted."""


_Command = _Abort | _FailAll | _Stop | _Wake | LoopCall
