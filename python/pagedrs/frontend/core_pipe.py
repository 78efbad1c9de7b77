"""The pipe between the API process and its engine core, and the threads at each end.

API side: one sender thread writes every command (in order; a full pipe never blocks an
HTTP handler), one receiver thread reads every message into a bounded inbox, notes when
it last heard from the core (heartbeats included) and, when the pipe ends, reaps the core
so that its exit code is real. Core side: the main thread and a heartbeat thread share
the pipe through ``SerialSender``; the heartbeat is a thread so that a long step beats
like an idle core, and a stopped or hung process (SIGSTOP, a held GIL) does not.
``stop_core`` ends it all, once.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Optional

logger = logging.getLogger("pagedrs.server")

BEAT = b"B"  # the heartbeat: the whole message (the receiver drops it after noting the time)
INBOX_MESSAGES = 256  # received, not yet taken by the stepping thread; beyond, the core waits (back-pressure)
REAP_TIMEOUT_S = 5.0  # the pipe ended: how long the receiver waits for the core to exit before reporting


def heartbeat_interval(core_timeout_s: float) -> float:
    """Seconds between the core's heartbeats: several per ``core_timeout_s``, at most one a second."""
    return min(1.0, core_timeout_s / 5)


class SerialSender:
    """The core's end of the pipe, one writer at a time: the main thread and the heartbeat both send."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send_bytes(self, data: bytes) -> None:
        with self._lock:
            self._conn.send_bytes(data)

    def __getattr__(self, name: str) -> Any:  # recv, poll, close: the main thread's alone
        return getattr(self._conn, name)


def beat(conn: SerialSender, interval_s: float) -> None:
    """The heartbeat thread of the core: it stops exactly when the process does (SIGSTOP, a held GIL)."""
    while True:
        time.sleep(interval_s)
        try:
            conn.send_bytes(BEAT)
        except (OSError, ValueError):  # the API process is gone, or the core is closing
            return


def send_loop(conn: Connection, outbox: queue.SimpleQueue[Optional[bytes]], errors: list[BaseException]) -> None:
    """The sender thread: forwards the outbox to the core, in order, until told to stop (None).

    A function, not a method: a thread holding the client would keep it from ever
    being collected, and its finalizer from stopping the core.
    """
    while (message := outbox.get()) is not None:
        try:
            conn.send_bytes(message)
        except (OSError, ValueError) as exc:  # the core is gone: the next receive reports it
            errors.append(exc)
            return


@dataclass
class Link:
    """What the receiver thread knows of the core (written by it, read by any thread)."""

    heard: float  # time.monotonic() of the latest message from the core, heartbeats included
    gone: Optional[str] = None  # set once the pipe ended and the core was reaped: why it is gone
    stopping: bool = False  # this process asked it to stop: its end is no failure


def describe_exit(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return f"still running {REAP_TIMEOUT_S:g} s after its pipe closed"
    if exitcode < 0:
        try:
            return f"exit code {exitcode}: killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"exit code {exitcode}: killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def receive_loop(conn: Connection, process: Any, inbox: queue.Queue[Optional[bytes]], link: Link) -> None:
    """The receiver thread: every message of the core into ``inbox`` (heartbeats only noted), then
    ``None`` once the pipe ends, after reaping the core. A function for the reason ``send_loop`` is."""
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            break
        link.heard = time.monotonic()
        if raw != BEAT:
            inbox.put(raw)
    process.join(REAP_TIMEOUT_S)  # the pipe ends when the core exits: join it, so its exit code is real
    link.gone = f"the engine core is gone ({describe_exit(process.exitcode)})"
    if not link.stopping:
        logger.error("%s", link.gone)
    inbox.put(None)


def stop_core(
    conn: Connection, process: Any, outbox: queue.SimpleQueue[Optional[bytes]], sender: threading.Thread,
    receiver: Optional[threading.Thread] = None, inbox: Optional[queue.Queue[Optional[bytes]]] = None,
    link: Optional[Link] = None, timeout_s: float = 10.0, stop_message: bytes = b"",
) -> None:
    """Asks the core to stop, waits, kills it if it does not; runs once (shutdown, collection or exit).

    The sender thread finishes what it holds first (one writer on the pipe at a time), and
    the receiver its last read (the pipe is closed once nobody uses it).
    """
    if link is not None:
        link.stopping = True
    outbox.put(None)
    sender.join(timeout_s)
    if process.is_alive():
        try:
            conn.send_bytes(stop_message)
        except (OSError, ValueError):
            pass
        process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join(timeout_s)
    if receiver is not None and inbox is not None and receiver.ident is not None:  # started once the core was ready
        drain_until_done(receiver, inbox, timeout_s)
    conn.close()


def drain_until_done(receiver: threading.Thread, inbox: queue.Queue[Optional[bytes]], timeout_s: float) -> None:
    """Waits for the receiver's last read (the core is gone), emptying the inbox it may be blocked on."""
    deadline = time.monotonic() + timeout_s
    while receiver.is_alive() and time.monotonic() < deadline:
        try:
            while True:
                inbox.get_nowait()
        except queue.Empty:
            pass
        receiver.join(0.05)
