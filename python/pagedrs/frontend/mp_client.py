"""MPClient: the engine core in its own process, on the typed protocol (core/protocol.py).

Why a process: the API server's event loop, tokenization, detokenization, SSE formatting
and the dispatch of deltas share one interpreter (and its GIL) with whatever else runs
there. In its own process the core only schedules, runs the model and samples, back to
back (vLLM v1's EngineCore does the same behind its API server).

    API process                                          core process
    ───────────                                          ────────────
    submit/abort/finish_sample ─► sender thread ─(codec)─► commands applied between steps
    step() ◄── inbox ◄── receiver thread ◄─(codec)──────── EngineCore.step(), again and again
    (the OutputProcessor makes every text here)            (token ids only; a heartbeat thread)

Every message is a protocol type encoded by frontend/codec.py. Adds go out as they arrive
(the core admits a burst at one step boundary) and their answers (``Added`` or
``AddRefused``) come back on the same stream as the outputs, so an add is answered before
any output of it. Metrics cross once, with a request's first token; the stats once per step.

The core process never outlives its parent: it ignores SIGINT/SIGTERM (the API process
drains and then tells it to stop) and exits when the pipe reports end of file. Liveness,
the other way round: the core heartbeats every ``heartbeat_interval(core_timeout_s)`` s,
idle or mid-step; ``liveness()`` says ``engine_unresponsive`` after ``core_timeout_s`` of
silence; when the pipe ends the receiver reaps the core (its exit code is real) and every
later call raises ``EngineCoreDeadError``. The pipe's threads: frontend/core_pipe.py.
The core process's side (``core_main``, re-exported here): frontend/core_process.py.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Optional

from pagedrs.core.protocol import (
    Abort,
    Add,
    CacheReset,
    CoreOutputs,
    CoreRequest,
    EngineCoreDeadError,
    EngineCoreError,
    FinishSample,
    ListPins,
    PinList,
    Pinned,
    PinPrefix,
    PinState,
    ResetPrefixCache,
    Unpin,
    Unpinned,
)
from pagedrs.engine_args import EngineArgs
from pagedrs.errors import FieldError, PrefixCacheBusyError
from pagedrs.frontend import codec
from pagedrs.frontend.codec import Added, AddRefused, CoreFailed, Ready, StepOutputs, Stop
from pagedrs.frontend.core_pipe import (
    INBOX_MESSAGES,
    REAP_TIMEOUT_S,
    Link,
    describe_exit,
    heartbeat_interval,
    receive_loop,
    send_loop,
    stop_core,
)
from pagedrs.frontend.core_process import core_main  # the child process's side, re-exported here
from pagedrs.stats import EngineStats

DEFAULT_CORE_TIMEOUT_S = 30.0
ENGINE_DEAD = "engine_dead"  # the liveness code of a core that is gone

# Called on the stepping thread with None when the core took an add, or with the error it maps to.
AckCallback = Callable[[Optional[BaseException]], None]


class MPClient:
    """A ``CoreClient`` whose core runs in a child process (see the module docs).

    Called from one thread (the stepping one), except ``submit`` and ``abort``, which any
    thread may call.
    """

    def __init__(
        self, args: EngineArgs, *, start_timeout_s: float = 600.0, core_timeout_s: float = DEFAULT_CORE_TIMEOUT_S,
    ) -> None:
        if not (math.isfinite(core_timeout_s) and core_timeout_s > 0):
            raise ValueError(f"core_timeout_s={core_timeout_s!r} is out of range: allowed a finite number of seconds > 0")
        self.core_timeout_s = core_timeout_s  # silent this long: liveness() says engine_unresponsive
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        # Not a daemon: the core may start tensor-parallel workers of its own. It still never
        # outlives this process: it exits on end of file, and the finalizer stops it at exit.
        self._process = ctx.Process(target=core_main, args=(child, args, heartbeat_interval(core_timeout_s)),
                                    name="pagedrs-engine-core", daemon=False)
        self._process.start()
        child.close()
        self._acks: dict[str, AckCallback] = {}  # adds sent, not yet answered
        self._acks_lock = threading.Lock()
        # Every message to the core goes through one sender thread: in order, and a full pipe
        # (the core mid-step) never blocks an HTTP handler's event loop.
        self._outbox: queue.SimpleQueue[Optional[bytes]] = queue.SimpleQueue()
        self._send_errors: list[BaseException] = []
        self._sender = threading.Thread(target=send_loop, args=(self._conn, self._outbox, self._send_errors),
                                        name="pagedrs-core-sender", daemon=True)
        self._sender.start()
        self._inbox: queue.Queue[Optional[bytes]] = queue.Queue(INBOX_MESSAGES)
        self._link = Link(heard=time.monotonic())
        self._receiver = threading.Thread(target=receive_loop, args=(self._conn, self._process, self._inbox, self._link),
                                          name="pagedrs-core-receiver", daemon=True)
        self._stop_args = (self._conn, self._process, self._outbox, self._sender, self._receiver, self._inbox, self._link)
        self._finalizer = weakref.finalize(self, stop_core, *self._stop_args, stop_message=codec.encode(Stop()))
        if not self._conn.poll(start_timeout_s):
            self.shutdown()
            raise EngineCoreError(f"the engine core did not start within {start_timeout_s} s")
        ready = self._first_reply()
        if isinstance(ready, CoreFailed):
            self.shutdown()
            raise ValueError(f"the engine core could not start: {ready.message}")
        self._link.heard = time.monotonic()
        self._receiver.start()
        self.ready: Ready = ready
        self._stats: EngineStats = ready.stats
        self.step_seconds = self.busy_seconds = 0.0
        self._buffered = CoreOutputs()
        self._reset_answer: Optional[CacheReset] = None  # the core's answer to the latest ResetPrefixCache
        self._answers: dict[type, Any] = {}  # the core's latest answer to a pin command, by answer type

    # ---- CoreClient -------------------------------------------------------------------

    def submit(self, request: CoreRequest, on_ack: AckCallback) -> None:
        """Sends an add without waiting; ``on_ack(error)`` runs on the stepping thread when the core answers."""
        with self._acks_lock:
            if request.request_id in self._acks:
                raise ValueError(f"request_id={request.request_id!r} is already in flight; request ids must be unique")
            self._acks[request.request_id] = on_ack
        self._outbox.put(codec.encode(Add(request)))

    def add(self, request: CoreRequest) -> None:
        """The blocking form of ``submit``: returns once the core took the request, raises its refusal."""
        result: list[Optional[BaseException]] = []
        self.submit(request, result.append)
        while not result:
            self._take(self._recv(None))  # outputs of earlier requests may come first: they are buffered
        if result[0] is not None:
            raise result[0]

    def abort(self, request_id: str) -> None:
        """Fire and forget; an add still on its way is aborted too (the abort follows it)."""
        self._outbox.put(codec.encode(Abort(request_id)))

    def finish_sample(self, command: FinishSample) -> None:
        self._outbox.put(codec.encode(command))

    def step(self, timeout_s: float = 0.5) -> CoreOutputs:
        """The outputs of the core's steps since the last call; waits up to ``timeout_s`` for one."""
        if not self._buffered.outputs and (message := self._recv(timeout_s)) is not None:
            self._take(message)
        while (message := self._recv(0)) is not None:
            self._take(message)
        outputs, self._buffered = self._buffered, CoreOutputs()
        return outputs

    def awaiting(self, request_id: str) -> bool:
        """Whether the add of ``request_id`` is sent and not yet answered."""
        with self._acks_lock:
            return request_id in self._acks

    def pending(self) -> bool:
        """Adds not yet answered, or outputs not yet taken."""
        return bool(self._acks) or bool(self._buffered.outputs)

    def stats(self) -> EngineStats:
        """The core's latest stats, after taking in what it sent (a stop string's freed pages)."""
        try:
            self.check_alive()
        except EngineCoreDeadError:
            pass  # step() and check_alive() report the death; the stats stay the last the core sent
        return self._stats

    def reset_prefix_cache(self) -> CacheReset:
        """Sent after every command before it; waits for the core's answer (outputs that come first are buffered)."""
        self._reset_answer = None
        self._outbox.put(codec.encode(ResetPrefixCache()))
        while (answer := self._reset_answer) is None:
            self._take(self._recv(None))
        if answer.refused is not None:
            raise PrefixCacheBusyError(answer.refused)
        return answer

    def pin_prefix(self, command: PinPrefix) -> Pinned:
        """Sent after every command before it; the core prefills and pins between its steps."""
        answer: Pinned = self._ask(command, Pinned)
        return answer

    def unpin(self, pin_id: str) -> bool:
        answer: Unpinned = self._ask(Unpin(pin_id), Unpinned)
        return answer.found

    def list_pins(self) -> list[PinState]:
        answer: PinList = self._ask(ListPins(), PinList)
        return answer.pins

    def _ask(self, command: Any, answer_type: type) -> Any:
        """Sends ``command`` and waits for the core's ``answer_type`` (outputs that come first are buffered)."""
        self._answers.pop(answer_type, None)
        self._outbox.put(codec.encode(command))
        while (answer := self._answers.pop(answer_type, None)) is None:
            self._take(self._recv(None))
        return answer

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the core (its requests aborted, its pages freed), waiting up to ``timeout_s`` per stage; a core
        already silent past ``core_timeout_s`` (stopped, hung) gets 1 s to answer the stop before it is killed:
        a SIGTERM'd server with a SIGSTOP'd core took 13.9 s to exit, against its --shutdown-timeout of 2."""
        if self._finalizer.detach() is not None:
            silent = self.liveness() is not None
            stop_core(*self._stop_args, timeout_s=min(timeout_s, 1.0) if silent else timeout_s,
                      stop_message=codec.encode(Stop()))

    # ---- liveness -----------------------------------------------------------------------

    def check_alive(self) -> None:
        """Takes in what the core sent without waiting; raises ``EngineCoreDeadError`` once it is gone."""
        while (message := self._recv(0)) is not None:
            self._take(message)

    def liveness(self) -> Optional[tuple[str, str]]:
        """``(code, message)`` while the core cannot serve (gone, or silent for ``core_timeout_s``); else None."""
        if self._link.gone is not None:
            return ENGINE_DEAD, self._link.gone
        silent_s = time.monotonic() - self._link.heard
        if silent_s > self.core_timeout_s:
            return ("engine_unresponsive", f"the engine core has not answered for {silent_s:.1f} s "
                    f"(--core-timeout={self.core_timeout_s:g} s): it is stopped, hung or starved")
        return None

    @property
    def exitcode(self) -> Optional[int]:
        """The core's exit code once it is reaped (negative: the signal that killed it); None while it runs."""
        return self._process.exitcode

    def is_alive(self) -> bool:
        return self._process.is_alive()

    # ---- the pipe -----------------------------------------------------------------------

    def _recv(self, timeout_s: Optional[float]) -> Optional[Any]:
        """The core's next message, waiting up to ``timeout_s`` (None: for ever); None when none came."""
        try:
            raw = self._inbox.get(timeout=timeout_s) if timeout_s != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        if raw is None:  # the receiver reaped the core
            self._inbox.put_nowait(None)  # every later call says so too
            self._fail_pending_acks(error := EngineCoreDeadError(self._link.gone or "the engine core is gone"))
            raise error
        message = codec.decode(raw)
        if isinstance(message, CoreFailed):
            self._fail_pending_acks(error := EngineCoreDeadError(f"the engine core failed: {message.message}"))
            raise error
        return message

    def _fail_pending_acks(self, error: BaseException) -> None:
        with self._acks_lock:
            pending, self._acks = self._acks, {}
        for on_ack in pending.values():
            on_ack(error)

    def _first_reply(self) -> Any:
        try:
            return codec.decode(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            self._process.join(REAP_TIMEOUT_S)  # reaped: its exit code is real
            raise EngineCoreError(f"the engine core exited during start-up ({describe_exit(self._process.exitcode)})") from exc

    def _take(self, message: Any) -> None:
        if isinstance(message, (Added, AddRefused)):
            with self._acks_lock:
                on_ack = self._acks.pop(message.request_id, None)
            if on_ack is not None:
                on_ack(None if isinstance(message, Added) else refusal(message))
        elif isinstance(message, CacheReset):
            self._reset_answer = message
        elif isinstance(message, (Pinned, Unpinned, PinList)):
            self._answers[type(message)] = message
        elif isinstance(message, StepOutputs):
            self._buffered.outputs.extend(message.outputs.outputs)
            if message.outputs.stats is not None:
                self._stats = message.outputs.stats
            self.step_seconds, self.busy_seconds = message.step_seconds, message.busy_seconds


def refusal(message: AddRefused) -> ValueError:
    """The core's refusal of an add as the in-process client raises it: a ``FieldError`` naming its field
    where the core named one, else a ValueError."""
    return FieldError(message.param, message.message) if message.param else ValueError(message.message)
