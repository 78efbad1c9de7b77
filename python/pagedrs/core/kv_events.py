"""KV events for routers: what each tier's prefix cache holds, published in vLLM's format.

The Rust core logs every page that joins or leaves a tier's cache (block_manager/kv_events.rs);
after each step the core hands the log to a ``KvEventPublisher``, which sends it as one
``EventBatch`` over ZMQ PUB, framed exactly as vLLM's ``ZmqEventPublisher`` does, so a router
that subscribes to vLLM (llm-d's KV-cache indexer, Dynamo) subscribes to pagedrs::

    PUB frames      [topic, seq (8 bytes, big-endian), msgpack(EventBatch)]
    EventBatch      [ts, [event, ...], data_parallel_rank]          (msgspec array_like)
    BlockStored     ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                     lora_id, medium]
    BlockRemoved    ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared["AllBlocksCleared"]
    medium          "GPU" | "CPU" | "DISK": a page moved down a tier is a BlockRemoved above
                    and a BlockStored below

PUB/SUB drops what was sent before a subscriber joined, so the publisher keeps the last
``buffer_steps`` batches and answers on a ROUTER socket: a request ``[b"", seq (8 bytes)]``
(a DEALER socket) gets every buffered batch from ``seq`` on as ``[seq, payload]``
frames, then ``[-1 (8 bytes, signed), b""]``. The first batch announces every page cached
when events were turned on, so batch 0 onwards rebuilds the cache from nothing.

Off by default (``EngineArgs.kv_events_endpoint=None``): the core logs nothing and ``publish``
is a no-op. pyzmq and msgpack are imported only when events are on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Optional, Protocol

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker


class KvEvents(Protocol):
    """What the core calls after each step, and at shutdown."""

    def publish(self, scheduler: Any) -> None: ...

    def close(self) -> None: ...


class NoKvEvents:
    """Events off: nothing logged in the core, nothing sent."""

    def publish(self, scheduler: Any) -> None:
        return None

    def close(self) -> None:
        return None


def encode_events(raw: list[tuple[Any, ...]], block_size: int) -> list[list[Any]]:
    """``Scheduler.take_kv_events()`` tuples as vLLM's tagged array_like structs (field order
    of vllm/distributed/kv_events.py). No LoRA: ``lora_id`` is always None."""
    out: list[list[Any]] = []
    for event in raw:
        kind = event[0]
        if kind == "BlockStored":
            _, hashes, parent, tokens, medium = event
            out.append(["BlockStored", list(hashes), parent, list(tokens), block_size, None, medium])
        elif kind == "BlockRemoved":
            _, hashes, medium = event
            out.append(["BlockRemoved", list(hashes), medium])
        elif kind == "AllBlocksCleared":
            out.append(["AllBlocksCleared"])
        else:
            raise ValueError(f"unknown KV event kind {kind!r}; allowed: BlockStored, BlockRemoved, AllBlocksCleared")
    return out


class KvEventPublisher:
    """vLLM's ``ZmqEventPublisher``: a PUB socket, an optional ROUTER replay socket and a
    buffer of the last ``buffer_steps`` batches, served by one thread that owns both sockets
    after construction (ZMQ sockets are not thread-safe). ``publish`` runs on the core's
    thread and only queues: the step never waits on the network."""

    def __init__(self, endpoint: str, replay_endpoint: Optional[str], *, block_size: int, buffer_steps: int = 10_000,
                 hwm: int = 100_000, topic: str = "", data_parallel_rank: int = 0) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as exc:  # a dev/serve dependency, not the core's
            raise RuntimeError(f"kv_events_endpoint={endpoint!r} needs pyzmq and msgpack: pip install pyzmq msgpack ({exc})") from exc
        self._zmq, self._packb = zmq, msgpack.packb
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: Any = None
        field, value = "kv_events_endpoint", endpoint
        try:
            _bind_or_connect(self._pub, endpoint)  # vLLM's rule: a wildcard binds, a host connects
            if replay_endpoint is not None:
                field, value = "kv_events_replay_endpoint", replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"{field} is {value!r}: cannot open it ({exc})") from exc
        self._queue: queue.Queue[Optional[list[Any]]] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.num_batches = 0  # batches sent (the thread's count)
        self.num_events = 0  # events in them
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pagedrs-kv-events", daemon=True)
        self._thread.start()

    def publish(self, scheduler: Any) -> None:
        """Takes what the core logged since the last call and queues it as one batch (none
        when nothing changed, as vLLM sends none)."""
        if self._closed:
            return
        events = scheduler.take_kv_events()
        if events:
            self._queue.put([time.time(), encode_events(events, self.block_size), self.data_parallel_rank])

    def flush(self, timeout_s: float = 5.0) -> None:
        """Waits until every queued batch was sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Sends what is queued, stops the thread and closes the sockets; once."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout_s=1.0)
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a bad request must not stop publishing
                    logger.exception("KV events: replay request failed")
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            try:
                if batch is None:
                    return
                payload = self._packb(batch)
                seq = self._next_seq
                self._next_seq += 1
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_batches += 1
                self.num_events += len(batch[1])
            except Exception:
                logger.exception("KV events: publishing a batch failed")
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        """vLLM's replay: ``[identity, b"", start seq]`` in, each buffered batch from it on out, then END_SEQ."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignored a replay request of %d frames (want [identity, b'', 8-byte seq])", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _bind_or_connect(sock: Any, endpoint: str) -> None:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def make_kv_events(endpoint: Optional[str], replay_endpoint: Optional[str], buffer_steps: int, scheduler: Any) -> KvEvents:
    """The publisher ``EngineArgs`` asks for, with the core's log turned on; ``NoKvEvents`` when off."""
    if endpoint is None:
        return NoKvEvents()
    publisher = KvEventPublisher(endpoint, replay_endpoint, block_size=int(scheduler.block_size), buffer_steps=buffer_steps)
    scheduler.enable_kv_events()
    return publisher
