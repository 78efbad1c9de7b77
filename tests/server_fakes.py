"""The server tests' harness: a deterministic stand-in for pagedrs.Engine (to test the server's
plumbing without a model), live servers over it or over a real Engine, and the leak check every
server test ends with (``assert_nothing_left``).

It follows docs/ENGINE_API.md: one token per sample per step, token ``ord('a') + (k + index) % 26``
for the k-th token of sample ``index`` (or, with ``script`` set, the script's k-th character, and
"stop" after its last one: an answer a test chooses, ended as by EOS or a stop string). Every call is recorded; with ``permits`` set, each step
records itself and then waits for one permit, so a test can hold the engine inside a step.
Its prefix cache is a model of the real one: a prompt reuses the full pages (of ``BLOCK_SIZE``
tokens, always keeping its last token to compute) of any earlier prompt under the same
``cache_salt``, and every output reports that as ``num_cached_tokens``; asked for logprobs, each
token gets ``-0.5`` and its top alternatives.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pagedrs.outputs import CompletionOutput, RequestOutput

MODEL = "fake"
EXPLODE = "\U0001f4a5"  # text the fake tokenizer refuses with an unexpected exception (not a ValueError)
POISON = "poison"  # a prompt whose request the fake engine fails on its own, mid-run
BLOCK_SIZE = 4  # the fake's page size, as its stats say


class FakeTokenizer:
    """One token per character: id = ord(ch)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if EXPLODE in text:
            raise ZeroDivisionError("the fake tokenizer exploded")
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        text = "".join(f"<tool:{t['function']['name']}>" for t in tools or [])
        text += "".join(f"<{m['role']}>{m['content']}" + "".join(f"<call:{c['function']['name']}>"
                                                                for c in m.get("tool_calls") or [])
                        for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


class FakeEngine:
    def __init__(self, max_model_len: int = 64, permits: threading.Semaphore | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.vocab_size = 0x110000  # every code point (one token per character)
        self.model_name = "fake"
        self.permits = permits  # when set, every step takes one (waiting at most a minute)
        self.fail_next_step = False
        self.script: str | None = None  # when set, every sample writes this text, then ends by "stop" (EOS)
        self.calls: list[tuple[str, Any]] = []  # ("add", id) | ("abort", id) | ("step", k)
        self.added: dict[str, dict[str, Any]] = {}  # request id -> what add_request was given (kept after it ends)
        self._cached: dict[str | None, set[tuple[int, ...]]] = {}  # cache_salt -> full-page prefixes seen
        self._requests: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # the test thread reads `calls` while the engine thread appends
        self._inbox: list[tuple[Any, ...]] = []  # submitted adds, applied at the next step (as the Engine's)
        self._abort_after_add: set[str] = set()

    def add_request(
        self, request_id: str, prompt: Any, params: Any = None, priority: int = 0, arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        ids = self._validate(request_id, prompt)
        self._record("add", request_id)
        with self._lock:
            self.added[request_id] = {"ids": list(ids), "params": params, "priority": priority, "cache_salt": cache_salt}
        self._requests[request_id] = {"ids": ids, "params": params, "samples": [[] for _ in range(params.n)],
                                      "cached": self._reuse(ids, cache_salt)}

    def submit(
        self, request_id: str, prompt: Any, params: Any, priority: int, on_ack: Callable[[BaseException | None], None],
        cache_salt: str | None = None, arrival_time: float | None = None,
    ) -> None:
        """As Engine.submit: validated now (raises), added at the next step boundary, answered there."""
        self._validate(request_id, prompt)
        with self._lock:
            if any(item[0] == request_id for item in self._inbox) or request_id in self._requests:
                raise ValueError(f"request_id={request_id!r} is already in flight; request ids must be unique")
            self._inbox.append((request_id, prompt, params, priority, cache_salt, on_ack))

    def _apply_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for request_id, prompt, params, priority, cache_salt, on_ack in inbox:
            try:
                self.add_request(request_id, prompt, params, priority, cache_salt=cache_salt)
            except Exception as exc:  # noqa: BLE001 - the refusal goes to whoever submitted it
                on_ack(exc)
                continue
            on_ack(None)
            if request_id in self._abort_after_add:  # aborted on its way: added, then aborted, as in the core
                self._abort_after_add.discard(request_id)
                self.abort(request_id)

    def _validate(self, request_id: str, prompt: Any) -> list[int]:
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(ids)} tokens > max_model_len {self.max_model_len}"
            )
        return list(ids)

    def _reuse(self, ids: list[int], salt: str | None) -> int:
        """Tokens of ``ids`` in full pages an earlier prompt under ``salt`` had; records this prompt's pages."""
        seen = self._cached.setdefault(salt, set())
        full = (len(ids) - 1) // BLOCK_SIZE  # the last token is always computed, as in the real engine
        hits = 0
        while hits < full and tuple(ids[: (hits + 1) * BLOCK_SIZE]) in seen:
            hits += 1
        seen.update(tuple(ids[: (k + 1) * BLOCK_SIZE]) for k in range(len(ids) // BLOCK_SIZE))
        return hits * BLOCK_SIZE

    def abort(self, request_id: str) -> bool:
        self._record("abort", request_id)
        with self._lock:
            if any(item[0] == request_id for item in self._inbox):
                self._abort_after_add.add(request_id)
                return True
        return self._requests.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests) or bool(self._inbox)

    def reset_prefix_cache(self) -> Any:
        """As ``Engine.reset_prefix_cache``: refused while requests are unfinished, else every cached prefix forgotten."""
        from pagedrs.core.protocol import CacheReset
        from pagedrs.errors import PrefixCacheBusyError

        self._record("reset_prefix_cache", None)
        if self.has_unfinished():
            raise PrefixCacheBusyError(f"cannot reset the prefix cache while {len(self._requests)} request(s) are in the engine")
        dropped = sum(len(prefixes) for prefixes in self._cached.values())
        self._cached.clear()
        return CacheReset(dropped, 0, 0)

    def check_alive(self) -> None:
        pass  # the Engine API: an engine in this process is alive while it steps

    def liveness(self) -> tuple[str, str] | None:
        return None

    def step(self) -> list[RequestOutput]:
        self._apply_inbox()
        self._record("step", None)
        if self.permits is not None and not self.permits.acquire(timeout=60):
            raise RuntimeError("FakeEngine.step: no permit within 60 s")
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        outputs = []
        for request_id, r in list(self._requests.items()):
            completions = []
            for index, tokens in enumerate(r["samples"]):
                token = ord("a") + (len(tokens) + index) % 26 if self.script is None else ord(self.script[len(tokens)])
                tokens.append(token)
                ended = self.script is not None and len(tokens) == len(self.script)
                done = ended or len(tokens) >= r["params"].max_tokens
                # Cumulative fields by reference, not rebuilt: the server reads only the deltas, and an
                # endless request rebuilt every step made each step O(tokens so far) (a quadratic flood).
                completion = CompletionOutput(index, "", tokens, chr(token), [token],
                                              "stop" if ended else "length" if done else None)
                if r["params"].logprobs is not None:
                    ranked = [token, *(t for t in range(ord("a"), ord("a") + r["params"].logprobs + 1) if t != token)]
                    completion.logprobs = [{t: -0.5 * (rank + 1) for rank, t in enumerate(ranked)}]
                completions.append(completion)
            error = None
            if r["ids"] == self.tokenizer.encode(POISON) and len(r["samples"][0]) == 2:
                error = "injected failure of this request"  # as the engine reports one request's failure
                completions = [CompletionOutput(c.index, finish_reason="error") for c in completions]
            finished = all(c.finish_reason for c in completions)
            output = RequestOutput(request_id, None, r["ids"], completions, finished, error=error)
            output.num_cached_tokens = r["cached"]  # type: ignore[attr-defined]  # until RequestOutput has the field
            outputs.append(output)
            if finished:
                del self._requests[request_id]
        return outputs

    def stats(self) -> dict[str, Any]:
        return {"num_gpu_blocks": 8, "block_size": 4, "num_free_gpu_blocks": 8 - len(self._requests),
                "num_running": len(self._requests), "num_waiting": 0, "num_swapped": 0}

    def call_log(self) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self.calls)

    def _record(self, kind: str, arg: Any) -> None:
        with self._lock:
            self.calls.append((kind, arg))


def assert_nothing_left(loop: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait (bounded) for the engine behind ``loop`` (an EngineLoop) to go idle; fail on anything left.

    Left means: a page not free, a sequence running, waiting or swapped, or an add still queued
    for the engine thread. The stats are the engine thread's own snapshot (the engine is not
    thread-safe), refreshed after every step and command batch.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        stats = loop.stats()
        left = {
            "pages in use": int(stats["num_gpu_blocks"]) - int(stats["num_free_gpu_blocks"]),
            "running": int(stats.get("num_running", 0)),
            "waiting": int(stats.get("num_waiting", 0)) + loop.num_waiting(),
            "swapped": int(stats.get("num_swapped", 0)),
        }
        if not any(left.values()):
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"the engine kept {left} for {timeout_s} s after the test (stats: {stats})")
        time.sleep(0.02)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``condition`` (bounded); fail naming ``what`` if it never holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


class Served:
    """A live server (uvicorn on a thread) over a FakeEngine."""

    def __init__(self, engine: FakeEngine, max_waiting: int = 8, options: Any = None) -> None:
        from pagedrs.server import BackgroundServer, EngineLoop, build_app

        self.engine = engine
        self.loop = EngineLoop(engine)
        self.app = build_app(self.loop, MODEL, max_waiting, options)
        self.http = BackgroundServer(self.app)

    @property
    def url(self) -> str:
        return self.http.url

    def client(self, api_key: str = "unused") -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.engine.call_log() if k == kind)


def served_factory() -> Iterator[Callable[..., Served]]:
    """The body of a ``make_served`` fixture: ``make_served(engine, max_waiting=8, options=None)``
    starts a server; at teardown each is checked for leaks and stopped.

    A generator, not a fixture, so that test modules declare the fixture themselves
    (``yield from served_factory()``) instead of importing a fixture by name.
    """
    started: list[Served] = []

    def make(engine: FakeEngine, max_waiting: int = 8, options: Any = None) -> Served:
        served = Served(engine, max_waiting, options)
        served.loop.start()
        served.http.start()
        started.append(served)
        return served

    yield make
    for served in started:
        if served.engine.permits is not None:
            served.engine.permits.release(10_000)  # never leave the engine thread parked in a step
        try:
            assert_nothing_left(served.loop)
        finally:
            served.http.stop()
            served.loop.stop()


@dataclass
class LiveServer:
    """A real Engine behind an EngineLoop and a BackgroundServer (``live_server``)."""

    engine: Any
    loop: Any
    app: Any
    http: Any

    @property
    def url(self) -> str:
        return str(self.http.url)


@contextlib.contextmanager
def live_server(
    model_dir: Path, engine_kw: dict[str, Any], model_name: str, max_waiting: int = 64, *, core_process: bool = False,
    trace: Any = None, options: Any = None,
) -> Iterator[LiveServer]:
    """Serve the model in ``model_dir`` on 127.0.0.1 for the duration of the block.

    ``core_process``: the engine runs in its own process behind a RemoteEngine, as
    ``pagedrs serve`` runs it by default. ``trace``: a RequestTrace the loop writes to.
    ``options``: the app's ServerOptions (API keys, the admin key).
    """
    from pagedrs import Engine, EngineArgs
    from pagedrs.server import BackgroundServer, EngineLoop, build_app
    from pagedrs.server.engine_core import RemoteEngine

    args = EngineArgs(model=str(model_dir), **engine_kw)
    engine = RemoteEngine(args) if core_process else Engine(args)
    loop = EngineLoop(engine, trace=trace)
    app = build_app(loop, model_name, max_waiting=max_waiting, options=options)
    http = BackgroundServer(app)
    loop.start()
    http.start()
    try:
        yield LiveServer(engine, loop, app, http)
    finally:
        http.stop()
        loop.stop()
        if core_process:
            engine.shutdown()
