"""The engine core in its own process, and the proxy the API server drives it through.

Why a process: the API server's event loop, tokenization, SSE formatting and the
dispatch of deltas share one interpreter (and its GIL) with whatever else runs there.
With the engine in the same process, forward passes wait on that Python work; in its own
process the core only schedules, runs the model and samples, back to back (vLLM v1's
EngineCore does the same behind its API server).

    API process                                         core process
    ───────────                                         ────────────
    asyncio handlers ─add─► sender thread ─(pickle)─►  apply commands between steps
    EngineLoop thread ─abort/stop─┘                   Engine.step(), again and again
          ▲  text made here (api_text)  ◄── token ids (marshal) ──  (busy while any request is unfinished)
          │
    asyncio handlers (HTTP, SSE)

``RemoteEngine`` is an ``EngineLike`` (server/engine_loop.py), so the EngineLoop's
command queue, back-pressure, abort-on-disconnect and shutdown work unchanged through
it. Commands are rare and pickled; the per-step outputs are flat tuples of ints and
strings encoded with ``marshal`` (no pickling per token, no code ever runs on decode).
A prompt's token ids cross once, with the request's first output. Adds go out as they
arrive (the core admits a burst at one step boundary), and their answers come back on the
same stream as the outputs. The core streams token ids and the API process makes the text
(``api_text``), except for requests whose stopping depends on text (stop strings) or
whose final text a policy builds (beam search, best_of): those keep their text in the core.

The core process never outlives its parent: it ignores SIGINT/SIGTERM (the API process
drains and then tells it to stop) and exits when the pipe reports end of file, which is
what happens when the parent dies, even by SIGKILL.

Liveness, the other way round: a thread of the core sends a heartbeat every
``heartbeat_interval(core_timeout_s)`` seconds, idle or mid-step (a long prefill beats
like an idle core; a stopped or hung process does not). A receiver thread in the API
process reads everything the core sends and notes when it last heard from it:
``liveness()`` says ``engine_unresponsive`` after ``core_timeout_s`` of silence, and
nothing again once the core answers. When the pipe ends the receiver reaps the core
(its exit code is real: -9 after ``kill -9``), and every later call raises
``EngineCoreDeadError``, an ``EngineDeadError`` (pagedrs/errors.py) as the engine raises.
The pipe's threads and the stop live in server/core_pipe.py.
"""

from __future__ import annotations

import dataclasses
import logging
import marshal
import math
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Optional

from pagedrs.errors import EngineDeadError
from pagedrs.server.api_text import RequestText, text_made_here
from pagedrs.server.core_pipe import (
    INBOX_MESSAGES,
    REAP_TIMEOUT_S,
    Link,
    SerialSender,
    beat,
    describe_exit,
    heartbeat_interval,
    receive_loop,
    send_loop,
    stop_core,
)
from pagedrs.server.engine_loop import ENGINE_DEAD, salt_kwargs
from pagedrs.server.options import DEFAULT_CORE_TIMEOUT_S

logger = logging.getLogger("pagedrs.server")

# Per-step message: (outputs, stats); each output is
# (request_id, finished, error, prompt_token_ids or None, samples, metrics or None, num_cached_tokens or None)
# (the prompt and num_cached_tokens cross once, with the request's first output) and each sample is
# (index, delta_text, delta_token_ids, delta_logprobs or None, finish_reason, stop_reason).
# metrics (RequestOutput.metrics: arrival, queued, first scheduled, first token times and step
# counts) crosses once, with the request's first token.
_OUTPUTS, _ACK, _READY, _FATAL = "outputs", "ack", "ready", "fatal"

# Called with None when the core accepted an add, or with the exception its refusal maps to.
AckCallback = Callable[[Optional[BaseException]], None]


@dataclass
class _Completion:
    """The part of CompletionOutput the EngineLoop reads (deltas only)."""

    index: int
    delta_text: str
    delta_token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]]  # one dict per token of delta_token_ids
    finish_reason: Optional[str]
    stop_reason: int | str | None


@dataclass
class _Output:
    """The part of RequestOutput the EngineLoop reads."""

    request_id: str
    finished: bool
    error: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[_Completion] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # RequestOutput.metrics, in the first token's output
    num_cached_tokens: Optional[int] = None  # in the request's first output only (the EngineLoop keeps it)


def _encode_outputs(outputs: list[Any], sent_prompts: set[str], timed: set[str], stats: dict[str, Any]) -> bytes:
    rows = []
    for out in outputs:
        prompt = cached = None
        if out.request_id not in sent_prompts:  # the first output: the prompt and its cache hits cross once
            prompt = list(out.prompt_token_ids)
            # None: never scheduled (aborted while waiting); the EngineLoop then keeps 0
            cached = None if (hits := out.num_cached_tokens) is None else int(hits)
            sent_prompts.add(out.request_id)
        metrics = None
        if out.request_id not in timed and "first_token_time" in out.metrics:
            metrics = dict(out.metrics)
            timed.add(out.request_id)
        if out.finished:
            sent_prompts.discard(out.request_id)
            timed.discard(out.request_id)
        samples = []
        for c in out.outputs:
            new = list(c.delta_token_ids)
            logprobs = None
            if c.logprobs is not None and new:
                logprobs = [dict(d) for d in c.logprobs[-len(new):]]
            samples.append((c.index, c.delta_text, new, logprobs, c.finish_reason, c.stop_reason))
        rows.append((out.request_id, bool(out.finished), out.error, prompt, samples, metrics, cached))
    return b"M" + marshal.dumps((_OUTPUTS, rows, stats))


def _send_reply(conn: Connection, message: tuple) -> None:
    """Rare replies (ready, ack, fatal) are pickled; a one-byte tag tells them from outputs."""
    conn.send_bytes(b"P" + pickle.dumps(message))


def _core_main(conn: Connection, args: Any, heartbeat_s: float = 1.0) -> None:
    """The core process: build the engine, then apply commands and step until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process drains, then sends "stop"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = SerialSender(conn)  # type: ignore[assignment]
    from pagedrs.engine import Engine

    try:
        engine = Engine(args)
    except BaseException as exc:  # noqa: BLE001 - report why the core cannot start
        _send_reply(conn, (_FATAL, f"{type(exc).__name__}: {exc}"))
        return
    tok = engine.tokenizer
    _send_reply(conn, (_READY, {
        "tokenizer_folder": None if tok.hf is None else str(tok.hf.name_or_path),  # None: skip_tokenizer_init
        "eos_token_ids": sorted(tok.eos_token_ids),
        "max_model_len": int(engine.max_model_len),
        "model_name": engine.model_name,
        "stats": engine.stats(),
        "pid": os.getpid(),
    }))
    threading.Thread(target=beat, args=(conn, heartbeat_s), name="pagedrs-core-heartbeat", daemon=True).start()
    sent_prompts: set[str] = set()
    timed: set[str] = set()  # requests whose metrics went out (with their first token)
    # Time in engine.step() over the wall time of loop turns that had work: the share of a
    # saturated core that goes to scheduling + the model + sampling rather than to I/O.
    step_seconds = busy_seconds = 0.0
    try:
        while True:
            turn_start = time.perf_counter()
            busy = had_work = engine.has_unfinished()
            # Commands first: an abort sent while the last step ran frees its pages before the next.
            while conn.poll(0 if busy else 0.5):
                command = conn.recv()
                kind = command[0]
                if kind == "add":
                    _, request_id, prompt, params, priority, arrival_time, cache_salt = command
                    try:
                        engine.add_request(request_id, prompt, params, priority=priority, arrival_time=arrival_time,
                                           **salt_kwargs(cache_salt))
                        _send_reply(conn, (_ACK, request_id, None, None))
                    except Exception as exc:  # noqa: BLE001 - the client's error, reported back
                        _send_reply(conn, (_ACK, request_id, type(exc).__name__, str(exc)))
                    busy = True
                elif kind == "abort":
                    engine.abort(command[1])
                    busy = engine.has_unfinished()
                elif kind == "stop":
                    for request_id in list(engine._requests):
                        engine.abort(request_id)
                    return
            if not engine.has_unfinished():
                continue
            t0 = time.perf_counter()
            outputs = engine.step()
            if had_work:
                step_seconds += time.perf_counter() - t0
            stats = engine.stats()
            stats["core_step_seconds"] = step_seconds
            # this turn counts too, so far: the step just added to step_seconds is inside it
            stats["core_busy_seconds"] = busy_seconds + (time.perf_counter() - turn_start if had_work else 0.0)
            conn.send_bytes(_encode_outputs(outputs, sent_prompts, timed, stats))
            if had_work:  # a turn that began idle includes the wait for its first command
                busy_seconds += time.perf_counter() - turn_start
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the API process is gone: so is the core
    except BaseException as exc:  # noqa: BLE001
        logger.exception("engine core failed")
        try:
            _send_reply(conn, (_FATAL, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass


class EngineCoreError(RuntimeError):
    """The engine core process failed or went away."""

    fatal = True  # the serving loop stops instead of failing request after request


class EngineCoreDeadError(EngineCoreError, EngineDeadError):
    """The engine core process died (or failed and exited) after it started: it will never step again."""


class RemoteEngine:
    """An ``EngineLike`` whose engine runs in a child process (see the module docs).

    Called from one thread (the EngineLoop's), like the Engine itself, except ``submit``,
    which any thread may call.
    """

    def __init__(
        self, args: Any, *, start_timeout_s: float = 600.0, core_timeout_s: float = DEFAULT_CORE_TIMEOUT_S,
    ) -> None:
        from pagedrs.tokenizer import TokenIdsOnly, Tokenizer

        if not (math.isfinite(core_timeout_s) and core_timeout_s > 0):
            raise ValueError(f"core_timeout_s={core_timeout_s!r} is out of range: allowed a finite number of seconds > 0")
        self.core_timeout_s = core_timeout_s  # silent this long: liveness() says engine_unresponsive
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        # Not a daemon: the core may start tensor-parallel workers of its own. It still never
        # outlives this process: it exits on end of file, and the finalizer stops it at exit.
        self._process = ctx.Process(target=_core_main, args=(child, args, heartbeat_interval(core_timeout_s)),
                                    name="pagedrs-engine-core", daemon=False)
        self._process.start()
        child.close()
        # Adds sent and not yet answered; written by submitting threads, popped by the stepping one.
        self._acks: dict[str, AckCallback] = {}
        self._acks_lock = threading.Lock()
        # Every message to the core goes through one sender thread: in order, and a full pipe
        # (the core mid-step) never blocks an HTTP handler's event loop.
        self._outbox: queue.SimpleQueue[Optional[tuple]] = queue.SimpleQueue()
        self._send_errors: list[BaseException] = []
        self._sender = threading.Thread(target=send_loop, args=(self._conn, self._outbox, self._send_errors),
                                        name="pagedrs-core-sender", daemon=True)
        self._sender.start()
        # Started once the core is ready: until then this thread reads its one reply itself.
        self._inbox: queue.Queue[Optional[bytes]] = queue.Queue(INBOX_MESSAGES)
        self._link = Link(heard=time.monotonic())
        self._receiver = threading.Thread(target=receive_loop, args=(self._conn, self._process, self._inbox, self._link),
                                          name="pagedrs-core-receiver", daemon=True)
        self._finalizer = weakref.finalize(self, stop_core, self._conn, self._process, self._outbox, self._sender,
                                           self._receiver, self._inbox, self._link)
        if not self._conn.poll(start_timeout_s):
            self.shutdown()
            raise EngineCoreError(f"the engine core did not start within {start_timeout_s} s")
        kind, info = self._recv_command_reply()
        if kind == _FATAL:
            self.shutdown()
            raise ValueError(f"the engine core could not start: {info}")
        self._link.heard = time.monotonic()
        self._receiver.start()
        eos, folder = set(info["eos_token_ids"]), info["tokenizer_folder"]
        self.tokenizer = TokenIdsOnly(eos) if folder is None else Tokenizer.from_folder(folder, eos)
        self.max_model_len: int = info["max_model_len"]
        self.model_name: str = info["model_name"]
        self.core_pid: int = info["pid"]
        self._stats: dict[str, Any] = dict(info["stats"])
        self._live: set[str] = set()  # added and not yet finished, as the core last reported
        self._prompts: dict[str, list[int]] = {}
        self._buffered: list[_Output] = []
        self._texts: dict[str, RequestText] = {}  # requests whose text this process makes

    # ---- EngineLike -------------------------------------------------------------------

    def submit(
        self, request_id: str, prompt: Any, params: Any, priority: int, on_ack: AckCallback,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Sends an add without waiting; ``on_ack(error)`` runs on the stepping thread when the core answers.

        Safe from any thread (the HTTP handlers call it): the message goes through the sender
        thread, so it reaches the core's pipe at once, and the core admits it at its next step
        boundary together with every other add that arrived during the step. Waiting for each
        ack before sending the next add admitted one request per step: a burst of 32 arrivals
        took 32 steps to enter the batch.
        """
        with self._acks_lock:
            if request_id in self._acks or request_id in self._live:
                raise ValueError(f"request_id={request_id!r} is already in flight; request ids must be unique")
            self._acks[request_id] = on_ack
        if text_made_here(params, self.tokenizer):  # the core streams token ids; the text is made here
            self._texts[request_id] = RequestText(self.tokenizer, params.skip_special_tokens)
            params = dataclasses.replace(params, detokenize=False)
        # Its arrival: the core reads commands only between steps, so the time it then takes
        # to be read (the step in flight) shows in the request's metrics.
        self._outbox.put(("add", request_id, prompt, params, priority, time.monotonic(), cache_salt))

    def add_request(
        self, request_id: str, prompt: Any, params: Any = None, priority: int = 0, cache_salt: Optional[str] = None,
    ) -> None:
        """The blocking form of ``submit``: returns once the core accepted the request, raises its error."""
        result: list[Optional[BaseException]] = []
        self.submit(request_id, prompt, params, priority, result.append, cache_salt=cache_salt)
        while not result:
            self._take(self._recv(None))  # outputs of earlier requests may come first: they are buffered
        if result[0] is not None:
            raise result[0]

    def abort(self, request_id: str) -> bool:
        """Fire and forget: the core frees the pages before its next step and reports the end.

        An add still on its way is aborted too: the abort follows it through the same pipe.
        """
        with self._acks_lock:
            known = request_id in self._live or request_id in self._acks
        if not known:
            return False
        self._outbox.put(("abort", request_id))
        return True

    def step(self, timeout_s: float = 0.5) -> list[_Output]:
        """The outputs of the core's steps since the last call; waits up to ``timeout_s`` for one."""
        if not self._buffered and (self._live or self._acks) and (message := self._recv(timeout_s)) is not None:
            self._take(message)
        while (message := self._recv(0)) is not None:
            self._take(message)
        outputs, self._buffered = self._buffered, []
        return outputs

    def check_alive(self) -> None:
        """Takes in what the core sent without waiting; raises ``EngineCoreDeadError`` once it is gone.

        The serving loop calls it between idle turns, so a core that dies while idle is noticed
        at once (and ``pagedrs serve`` exits), not at the next request.
        """
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

    def has_unfinished(self) -> bool:
        """Requests the core holds, outputs not yet handed out, or adds not yet answered."""
        return bool(self._live) or bool(self._buffered) or bool(self._acks)

    def stats(self) -> dict[str, Any]:
        stats = dict(self._stats)
        busy = stats.get("core_busy_seconds", 0.0)
        stats["core_step_fraction"] = stats.get("core_step_seconds", 0.0) / busy if busy else 0.0
        return stats

    def is_alive(self) -> bool:
        return self._process.is_alive()

    @property
    def pid(self) -> int:
        return self.core_pid

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the core (its requests are aborted, its pages freed) and waits for it to exit."""
        self._finalizer()

    # ---- the pipe -----------------------------------------------------------------------

    def _recv(self, timeout_s: Optional[float]) -> Optional[tuple]:
        """The core's next message, waiting up to ``timeout_s`` (None: for ever); None when none came."""
        try:
            raw = self._inbox.get(timeout=timeout_s) if timeout_s != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
        if raw is None:  # the receiver reaped the core
            self._inbox.put_nowait(None)  # every later call says so too
            error = EngineCoreDeadError(self._link.gone or "the engine core is gone")
            self._fail_pending_acks(error)
            raise error
        message = pickle.loads(raw[1:]) if raw[:1] == b"P" else marshal.loads(raw[1:])
        if message[0] == _FATAL:
            error = EngineCoreDeadError(f"the engine core failed: {message[1]}")
            self._fail_pending_acks(error)
            raise error
        return message

    def _fail_pending_acks(self, error: BaseException) -> None:
        """The core is gone: every add still waiting for its answer gets this error."""
        with self._acks_lock:
            pending, self._acks = self._acks, {}
        for on_ack in pending.values():
            on_ack(error)

    def _recv_command_reply(self) -> tuple:
        try:
            return pickle.loads(self._conn.recv_bytes()[1:])
        except (EOFError, OSError) as exc:
            self._process.join(REAP_TIMEOUT_S)  # reaped: its exit code is real
            raise EngineCoreError(f"the engine core exited during start-up ({describe_exit(self._process.exitcode)})") from exc

    def _take(self, message: tuple) -> None:
        if message[0] == _ACK:
            _, request_id, error_type, error = message
            with self._acks_lock:
                on_ack = self._acks.pop(request_id, None)
            if error_type is None:
                self._live.add(request_id)
            else:
                self._texts.pop(request_id, None)
            if on_ack is not None:
                on_ack(None if error_type is None else (TypeError if error_type == "TypeError" else ValueError)(error))
            return
        if message[0] != _OUTPUTS:
            return
        _, rows, stats = message
        self._stats = stats
        for request_id, finished, error, prompt, samples, metrics, cached in rows:
            if prompt is not None:
                self._prompts[request_id] = prompt
            prompt_ids = self._prompts.get(request_id, [])
            text = self._texts.pop(request_id, None) if finished else self._texts.get(request_id)
            if finished:
                self._live.discard(request_id)
                self._prompts.pop(request_id, None)
            completions = [_Completion(*s) for s in samples]
            if text is not None:
                for c in completions:
                    c.delta_text = text.delta(prompt_ids, c.index, c.delta_token_ids, c.finish_reason, c.stop_reason)
            self._buffered.append(_Output(
                request_id=request_id, finished=finished, error=error, prompt_token_ids=prompt_ids,
                outputs=completions, metrics=metrics or {}, num_cached_tokens=cached,
            ))
