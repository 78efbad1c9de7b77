"""One thread that owns the Engine and serves every HTTP request through it.

The Engine is not thread-safe, and continuous batching needs every request in
the same engine anyway, so exactly one thread touches it. HTTP handlers (on
the asyncio event loop) only *send commands* — add, abort — and *receive
deltas* on a per-HTTP-request DeltaStream (deltas.py)::

    handler ──add/abort──► commands (SimpleQueue) ──► engine thread: apply commands,
    handler ◄──deltas───── DeltaStream (merges while the handler lags) ◄── engine.step(), dispatch

Commands are applied before every step, so an abort sent while step k runs
frees the request's pages before step k+1 starts ("within one step").

An engine that can never step again (``EngineDeadError``: its core process died, a
tensor-parallel worker or the scheduler failed; ``core.protocol.is_engine_fatal``) ends the
loop: every request in flight gets an error delta, later adds raise
``DeadEngineRefusal``, ``health()`` says ``engine_dead``.
With ``request_timeout_s``, a request without a finished output by then is aborted in
the engine and gets a 504 error delta (or, not yet accepted, ``RequestTimeoutError``).

Deltas are snapshots (new text, new token ids, their logprobs), copied in the
engine thread: the handler may read them after the engine has moved on.

The commands themselves and ``EngineLike``, the part of the Engine the loop drives, are
loop_commands.py's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from pagedrs.core.protocol import is_engine_fatal
from pagedrs.server.deltas import DeltaStream
from pagedrs.server.loop_call import LoopCall
from pagedrs.server.loop_commands import EngineLike, _Abort, _Add, _Command, _FailAll, _Stop, _Wake
from pagedrs.server.metrics import ServerMetrics
from pagedrs.server.refusals import (
    ENGINE_DEAD,
    ENGINE_UNRESPONSIVE,
    REQUEST_TIMEOUT,
    DeadEngineRefusal,
    RequestTimeoutError,
    UnresponsiveEngineRefusal,
)
from pagedrs.server.request_trace import RequestTrace
from pagedrs.server.sinks import Sink

logger = logging.getLogger("pagedrs.server")


_DEAD_STATUS = 500  # as vLLM answers a request its dead engine failed; /health says 503
_TIMEOUT_STATUS = 504


class EngineLoop:
    """Drives ``engine`` from a dedicated thread; safe to call from any thread or event loop."""

    def __init__(
        self, engine: EngineLike, metrics: ServerMetrics | None = None, *, idle_poll_s: float = 0.5,
        trace: RequestTrace | None = None, request_timeout_s: float | None = None,
    ) -> None:
        if request_timeout_s is not None and not (math.isfinite(request_timeout_s) and request_timeout_s > 0):
            raise ValueError(f"request_timeout_s={request_timeout_s!r} is out of range: allowed None (no timeout) "
                             "or a finite number of seconds > 0")
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics or ServerMetrics()
        self.trace = trace  # one line per request at its first token, when the server was asked for it
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._lock = threading.Lock()  # guards _pending_adds and _stats
        self._pending_adds = 0
        self._unacked: dict[str, _Add] = {}  # submitted straight to the engine, its answer not yet in
        self._stats: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        self.fatal_error: str | None = None
        self.engine_dead = False  # the loop ended because the engine can never step again
        self._closed: str | None = None  # engine thread only: why adds are refused (after fail_all)
        self._refresh_stats()  # the engine thread does not exist yet: safe to call from here

    # --- any thread ------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineLoop.start() called twice")
        self._thread = threading.Thread(target=self._run, name="pagedrs-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the current step; requests still in flight get an error delta."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout_s)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        out: DeltaStream,
        *,
        tag: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; returns once the engine accepted it, raises its ValueError otherwise.

        Deltas then arrive on ``out``; the last one has ``finished`` set.
        """
        if not self.is_alive():
            if self.engine_dead:
                raise DeadEngineRefusal(f"the engine is dead: {self.fatal_error}")
            raise RuntimeError(f"the engine loop is not running ({self.fatal_error or 'stopped'})")
        silent = self.engine.liveness()
        if silent is not None and silent[0] == ENGINE_UNRESPONSIVE:
            raise UnresponsiveEngineRefusal(silent[1])
        arrival = time.monotonic()
        deadline = None if self.request_timeout_s is None else arrival + self.request_timeout_s
        sink = Sink(out, tag, arrival, deadline)
        command = _Add(request_id, prompt, params, priority, sink, cache_salt)
        # The add reaches the engine at once, from this thread, instead of after the step the
        # loop thread is in; the engine admits every add of a burst at one step boundary and
        # answers each on the loop thread (_on_ack).
        with self._lock:
            self._pending_adds += 1
            self._unacked[request_id] = command
        try:
            self.engine.submit(request_id, prompt, params, priority, functools.partial(self._on_ack, command),
                               cache_salt=cache_salt, arrival_time=arrival)
        except Exception:
            with self._lock:
                self._pending_adds -= 1
                self._unacked.pop(request_id, None)
            raise
        self._commands.put(_Wake())
        await asyncio.wrap_future(command.accepted)

    def abort(self, request_id: str) -> None:
        """Ask the engine to drop the request (no-op if it already finished). Does not wait."""
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps (loop_call.py); its result or error."""
        if not self.is_alive():
            raise RuntimeError(f"the engine loop is not running ({self.fatal_error or 'stopped'})")
        self._commands.put(command := LoopCall(fn))
        return await asyncio.wrap_future(command.result)

    def fail_all(self, message: str, status: int = 503) -> None:
        """Abort every request in flight (each gets an error delta) and refuse new ones. Does not wait."""
        self._commands.put(_FailAll(message, status))

    def health(self) -> tuple[str, str] | None:
        """Why the engine cannot serve now, as (OpenAI error code, message); None when it can."""
        if not self.is_alive():
            if self.engine_dead:
                return ENGINE_DEAD, f"the engine is dead: {self.fatal_error}"
            return "engine_not_running", self.fatal_error or "the engine loop is not running"
        return self.engine.liveness()

    def num_waiting(self) -> int:
        """Requests not yet scheduled: queued commands plus the engine's waiting queue."""
        with self._lock:
            return self._pending_adds + int(self._stats.get("num_waiting", 0))

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of the end of the latest step or command batch."""
        with self._lock:
            return dict(self._stats)

    # --- engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                commands = self._take_commands(block=idle)
                if any(isinstance(c, _Stop) for c in commands):
                    self._apply([c for c in commands if not isinstance(c, _Stop)])
                    break
                self._apply(commands)
                if self.request_timeout_s is not None:
                    self._expire(time.monotonic())
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self.engine.check_alive()  # a core that died while idle is noticed now, not at the next request
                    self._refresh_stats()  # what the core sent since (a stop string's freed pages) reaches /metrics
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            self.fatal_error = f"{type(exc).__name__}: {exc}"
            self.engine_dead = is_engine_fatal(exc)
            logger.error("engine loop died:\n%s", traceback.format_exc())
        finally:
            if self.engine_dead:
                self._fail_all(f"the engine is dead: {self.fatal_error}", _DEAD_STATUS, ENGINE_DEAD)
            else:
                self._fail_all(self.fatal_error or "the server is shutting down", 500 if self.fatal_error else 503)
            self._fail_queued_commands()

    def _take_commands(self, block: bool) -> list[_Command]:
        commands: list[_Command] = []
        if block:
            try:
                commands.append(self._commands.get(timeout=self._idle_poll_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[_Command]) -> None:
        if not commands:
            return
        for command in commands:
            if isinstance(command, _Abort):
                if self._sinks.pop(command.request_id, None) is not None:  # in flight: its client went away
                    self.metrics.requests.labels(finish_reason="abort").inc()
                self.engine.abort(command.request_id)
            elif isinstance(command, _FailAll):
                self._closed = command.message
                self._fail_all(command.message, command.status)
            elif isinstance(command, LoopCall):
                command.run(self.engine)
        self._refresh_stats()

    def _on_ack(self, command: _Add, error: BaseException | None) -> None:
        """The engine's answer to a submitted add (engine thread): register it, or hand back its error."""
        if error is None and self._closed is not None:  # fail_all ran while it was on its way
            self.engine.abort(command.request_id)
            error = RuntimeError(self._closed)
        if error is not None and is_engine_fatal(error):  # the core died with the add on its way
            error = DeadEngineRefusal(f"the engine is dead: {type(error).__name__}: {error}")
        with self._lock:
            if self._unacked.pop(command.request_id, None) is None:
                return  # already failed by _fail_queued_commands
        self._settle(command, error)

    def _settle(self, command: _Add, error: BaseException | None) -> None:
        """An add the engine took (its deltas now go to its sink) or refused (the handler gets ``error``)."""
        if error is None:
            self._sinks[command.request_id] = command.sink
        with self._lock:  # moved from our queue to the engine's: num_waiting() stays exact
            self._pending_adds -= 1
            if error is None:
                self._stats["num_waiting"] = int(self._stats.get("num_waiting", 0)) + 1
        if error is None:
            command.accepted.set_result(None)
        else:
            command.accepted.set_exception(error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if is_engine_fatal(exc):
                raise  # the engine cannot step again (a dead core process or TP worker): the loop ends, /health says 503
            # The engine's state is unknown; fail what is in flight rather than hang it.
            logger.error("engine.step() failed:\n%s", traceback.format_exc())
            self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            self._refresh_stats()  # the aborts changed them: /metrics must not show the failed requests
            return
        now = time.monotonic()
        for output in outputs:
            self._dispatch(output, now)
        self._refresh_stats()

    def _dispatch(self, output: Any, now: float) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:  # aborted, or not ours
            return
        delta = sink.delta_of(output)
        sink.observe(output, delta, self.metrics, self.trace, now)
        if delta.finished:
            del self._sinks[output.request_id]
        if not sink.stream.put(delta):  # the handler's event loop is gone
            if self._sinks.pop(output.request_id, None) is not None:
                self.metrics.requests.labels(finish_reason="abort").inc()
            self.engine.abort(output.request_id)

    def _refresh_stats(self) -> None:
        stats = self.engine.stats()
        self.metrics.update_from_stats(stats)
        with self._lock:
            self._stats = stats

    def _fail_all(self, message: str, status: int = 500, code: str | None = None) -> None:
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            _fail(self.engine, request_id, sink, message, status, code)
            self.metrics.requests.labels(finish_reason="failed").inc()

    def _expire(self, now: float) -> None:
        """Requests past their deadline (request_timeout_s): aborted in the engine, answered 504."""
        for request_id, sink in list(self._sinks.items()):
            if sink.deadline is not None and now >= sink.deadline:
                del self._sinks[request_id]
                error = self._timeout_error(request_id)
                _fail(self.engine, request_id, sink, str(error), _TIMEOUT_STATUS, REQUEST_TIMEOUT)
                self.metrics.requests.labels(finish_reason="timeout").inc()
        with self._lock:  # submitted, never answered: a stopped core holds the handler at its add
            late = [c for c in self._unacked.values() if c.sink.deadline is not None and now >= c.sink.deadline]
            for command in late:
                del self._unacked[command.request_id]
                self._pending_adds -= 1
        for command in late:
            _swallow(functools.partial(self.engine.abort, command.request_id))  # follows the add to the core
            command.accepted.set_exception(self._timeout_error(command.request_id))

    def _timeout_error(self, request_id: str) -> RequestTimeoutError:
        return RequestTimeoutError(f"request {request_id} timed out: no finished output within "
                                   f"--request-timeout={self.request_timeout_s:g} s")

    def _fail_queued_commands(self) -> None:
        with self._lock:
            unacked, self._unacked = list(self._unacked.values()), {}
        for queued in self._take_commands(block=False):  # aborts and wakes: nothing waits on them; calls do
            if isinstance(queued, LoopCall):
                queued.cancel("the engine loop stopped before the call ran")
        for command in unacked:
            if not command.accepted.done():
                with self._lock:
                    self._pending_adds -= 1
                if self.engine_dead:
                    command.accepted.set_exception(DeadEngineRefusal(f"the engine is dead: {self.fatal_error}"))
                else:
                    command.accepted.set_exception(RuntimeError("the engine loop stopped before the request was added"))


def _fail(engine: EngineLike, request_id: str, sink: Sink, message: str, status: int, code: str | None) -> None:
    """Abort ``request_id`` in the engine (best effort) and hand its handler the error as the last delta."""
    _swallow(functools.partial(engine.abort, request_id))
    sink.fail(request_id, message, status, code)


def _swallow(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - best effort cleanup while failing requests
        logger.debug("ignored during cleanup:\n%s", traceback.format_exc())
