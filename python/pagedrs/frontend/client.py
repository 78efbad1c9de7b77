"""How the front end talks to the engine core: one interface, ``CoreClient``.

``InprocClient`` holds the core in this process and calls it directly. A client that
runs the core elsewhere (its own process, a Ray replica) implements the same interface;
the Engine never knows which one it holds.

Both clients answer an add the same two ways: ``add`` (blocking, for the offline LLM API,
on the stepping thread) and ``submit`` (from any thread, answered on the stepping thread at
the next step boundary: what the serving loop uses, so that a burst of adds is admitted at
one step boundary whichever client it is). And both hand an aborted request's final output
back with a later ``step()``: the front end never makes an output the core did not send.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

from pagedrs.attention import AttentionBackend
from pagedrs.core.engine_core import EngineCore
from pagedrs.core.prefix_cache import reset_prefix_cache
from pagedrs.core.protocol import Abort, CacheReset, CoreOutputs, CoreRequest, FinishSample, Pinned, PinPrefix, PinState
from pagedrs.engine_args import EngineArgs
from pagedrs.gc_heap import freeze_imports_once
from pagedrs.stats import EngineStats
from pagedrs.tokenizer import TokenIdsOnly, Tokenizer

# Called on the stepping thread with None when the core took an add, or with its refusal.
AckCallback = Callable[[Optional[BaseException]], None]


class CoreClient(Protocol):
    def add(self, request: CoreRequest) -> None:
        """Queues a validated request; raises ValueError when the core refuses it (stepping thread)."""
        ...

    def submit(self, request: CoreRequest, on_ack: AckCallback) -> None:
        """Sends an add without waiting, from any thread; ``on_ack(error)`` runs on the stepping
        thread when the core answers (at the latest during the next ``step()``)."""
        ...

    def awaiting(self, request_id: str) -> bool:
        """Whether the add of ``request_id`` is submitted and not yet answered."""
        ...

    def abort(self, request_id: str) -> None:
        """Ends a request in the core and frees its pages (an add still on its way too); its final
        output comes with a later ``step()``. Nothing when the request is not there."""
        ...

    def finish_sample(self, command: FinishSample) -> None:
        """Ends one sample in the core (the front end found a stop string)."""
        ...

    def step(self) -> CoreOutputs:
        """The outputs of the core's next step. Raises EngineDeadError when it cannot step again."""
        ...

    def pending(self) -> bool:
        """Whether the client holds work the front end does not know of yet (adds not yet answered)."""
        ...

    def stats(self) -> EngineStats: ...

    def reset_prefix_cache(self) -> CacheReset:
        """Forgets every cached page on every tier, between two steps (stepping thread); raises
        PrefixCacheBusyError, nothing cleared, while requests are in the core."""
        ...

    def pin_prefix(self, command: PinPrefix) -> Pinned:
        """Prefills the prompt and pins its full pages (core/pins.py), between two steps (stepping
        thread); the outputs of the steps the prefill ran come with the next ``step()``."""
        ...

    def unpin(self, pin_id: str) -> bool:
        """Releases a pin; False when it is not live (unknown, expired, unpinned already)."""
        ...

    def list_pins(self) -> list[PinState]:
        """The live pins, expired ones released first."""
        ...

    def check_alive(self) -> None:
        """Takes in what the core sent without waiting; raises EngineDeadError once it is gone."""
        ...

    def liveness(self) -> tuple[str, str] | None:
        """``(code, message)`` while the core cannot serve; None when it can."""
        ...

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Aborts what is left and releases the core; once."""
        ...


class InprocClient:
    """The core in this process: every call is a direct call, and a ``FinishSample`` is
    applied before the next step starts (the core never computes a token past a stop string).

    Submitted adds wait in an inbox that ``step()`` applies first, in order with the aborts
    that follow them; an abort's final output is buffered and returned by the next ``step()``.
    """

    def __init__(self, args: EngineArgs, *, attention_backend: AttentionBackend | None = None) -> None:
        freeze_imports_once()  # before the core's objects exist: see gc_heap
        self.core = EngineCore(args, attention_backend=attention_backend)
        self._lock = threading.Lock()  # guards the inbox: submit() is called from any thread
        self._inbox: list[Union[tuple[CoreRequest, AckCallback], Abort]] = []
        self._awaiting: set[str] = set()
        self._aborted = CoreOutputs()  # final outputs of aborted requests (and a pin's prefill steps), for the next step()

    def add(self, request: CoreRequest) -> None:
        self.core.add(request)

    def submit(self, request: CoreRequest, on_ack: AckCallback) -> None:
        with self._lock:
            if request.request_id in self._awaiting:
                raise ValueError(f"request_id={request.request_id!r} is already in flight; request ids must be unique")
            self._awaiting.add(request.request_id)
            self._inbox.append((request, on_ack))

    def awaiting(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._awaiting

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._awaiting:  # the abort follows its add through the inbox
                self._inbox.append(Abort(request_id))
                return
        if (aborted := self.core.abort(request_id)) is not None:
            self._aborted.outputs.append(aborted)

    def finish_sample(self, command: FinishSample) -> None:
        self.core.finish_sample(command.request_id, command.index, command.reason, command.stop_reason)

    def step(self) -> CoreOutputs:
        self._apply_inbox()
        aborted, self._aborted = self._aborted, CoreOutputs()
        try:
            stepped = self.core.step()
        except BaseException:
            self._aborted.outputs[:0] = aborted.outputs  # not handed out: the next step() returns them
            raise
        return CoreOutputs(aborted.outputs + stepped.outputs, stepped.stats)

    def _apply_inbox(self) -> None:
        with self._lock:
            commands, self._inbox = self._inbox, []
        for command in commands:
            if isinstance(command, Abort):
                self.abort(command.request_id)
                continue
            request, on_ack = command
            with self._lock:
                self._awaiting.discard(request.request_id)
            try:
                self.core.add(request)
            except Exception as exc:  # noqa: BLE001 - the refusal goes to the caller that submitted it
                on_ack(exc)
            else:
                on_ack(None)

    def pending(self) -> bool:
        with self._lock:
            return bool(self._inbox) or bool(self._aborted.outputs)

    def check_alive(self) -> None:
        pass  # a core in this process is alive while it steps

    def liveness(self) -> tuple[str, str] | None:
        return None

    def stats(self) -> EngineStats:
        return self.core.stats()

    def reset_prefix_cache(self) -> CacheReset:
        self._apply_inbox()  # adds already submitted count as requests in the core
        return reset_prefix_cache(self.core)

    def pin_prefix(self, command: PinPrefix) -> Pinned:
        self._apply_inbox()  # adds already submitted run beside the prefill, in order
        outcome = self.core.pins.pin(command)
        self._aborted.outputs.extend(outcome.outputs)  # the prefill's steps' outputs: returned by the next step()
        return outcome.answer

    def unpin(self, pin_id: str) -> bool:
        return self.core.pins.unpin(pin_id)

    def list_pins(self) -> list[PinState]:
        return self.core.pins.states()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._inbox.clear()
            self._awaiting.clear()
        self.core.shutdown()


@dataclass(frozen=True)
class CoreInfo:
    """What the front end needs to know about the core behind its client."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    model_name: str


def start_client(args: EngineArgs, kind: str, *, attention_backend: AttentionBackend | None = None,
                 **mp_options: Any) -> tuple[CoreClient, CoreInfo]:
    """``kind``: "inproc" (the core in this process) or "mp" (in its own process; ``mp_options``
    are MPClient's ``start_timeout_s`` and ``core_timeout_s``)."""
    if kind == "inproc":
        inproc = InprocClient(args, attention_backend=attention_backend)
        loaded = inproc.core.loaded
        return inproc, CoreInfo(loaded.tokenizer, loaded.config.vocab_size, inproc.core.max_model_len, loaded.name)
    if kind == "mp":
        from pagedrs.frontend.mp_client import MPClient

        mp_client = MPClient(args, **mp_options)
        ready = mp_client.ready
        eos = set(ready.eos_token_ids)
        tokenizer = TokenIdsOnly(eos) if ready.tokenizer_folder is None else Tokenizer.from_folder(ready.tokenizer_folder, eos)
        return mp_client, CoreInfo(tokenizer, ready.vocab_size, ready.max_model_len, ready.model_name)
    raise ValueError(f"client={kind!r} is not a core client: allowed 'inproc' or 'mp'")
