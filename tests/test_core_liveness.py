"""A dead or frozen engine core is noticed (issue 23, items 4 and 5).

kill -9 of the core: it is reaped (its exit code is real), every stream ends with a
dead-engine error (never "overloaded"), /health says 503 engine_dead, and `pagedrs serve`
exits non-zero so that a supervisor restarts it; a server embedded in a program keeps
answering. SIGSTOP of the core: /health says 503 within --core-timeout and 200 again
after SIGCONT; with --request-timeout a request on the stopped core gets a 504.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
psutil = pytest.importorskip("psutil")

from pagedrs import EngineArgs, SamplingParams  # noqa: E402
from pagedrs.errors import EngineDeadError  # noqa: E402
from pagedrs.net import free_port  # noqa: E402
from pagedrs.server import BackgroundServer, EngineLoop, build_app  # noqa: E402
from pagedrs.server.cli import ENGINE_DEAD_EXIT, main  # noqa: E402
from pagedrs.server.deltas import DeltaStream, RequestDelta  # noqa: E402
from pagedrs.server.engine_core import EngineCoreDeadError, RemoteEngine, heartbeat_interval  # noqa: E402
from pagedrs.server.engine_loop import DeadEngineRefusal  # noqa: E402
from pagedrs.server.errors import error_body  # noqa: E402
from server_fakes import FakeEngine  # noqa: E402

ENGINE_KW = dict(block_size=4, num_gpu_blocks=80, max_model_len=256, swap_space_gb=0.001)
LONG = 240  # tokens: far more than the test needs to act before the request ends
CORE_TIMEOUT_S = 1.0


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def stream_body(max_tokens: int = LONG) -> dict:
    return {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}


class Embedded:
    """A RemoteEngine behind an EngineLoop and a BackgroundServer, as a program embeds them."""

    def __init__(self, model_dir: Path, request_timeout_s: float | None = None) -> None:
        self.engine = RemoteEngine(EngineArgs(model=str(model_dir), **ENGINE_KW), core_timeout_s=CORE_TIMEOUT_S)
        self.loop = EngineLoop(self.engine, request_timeout_s=request_timeout_s)
        self.loop.start()
        self.http = BackgroundServer(build_app(self.loop, "tiny", max_waiting=16)).start()
        self.url = self.http.url

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=5)

    def close(self) -> None:
        if self.engine.is_alive():
            os.kill(self.engine.core_pid, signal.SIGCONT)  # a stopped core would hold the shutdown
        self.http.stop()
        self.loop.stop()
        self.engine.shutdown()


@pytest.fixture
def embedded(tiny_llama_dir: Path) -> Iterator:
    started: list[Embedded] = []

    def start(**kw) -> Embedded:
        started.append(Embedded(tiny_llama_dir, **kw))
        return started[-1]

    yield start
    for server in started:
        server.close()


@contextlib.contextmanager
def open_stream(url: str, body: dict) -> Iterator[Iterator[str]]:
    """A streaming completion whose first chunk has arrived (the request runs in the core): its other events."""
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = (line for line in response.iter_lines() if line)
        first = next(lines)
        assert "choices" in json.loads(first.removeprefix("data: ")), first
        yield lines


def error_event(lines: Iterator[str]) -> dict:
    """The stream's remaining events end with an error event, then [DONE]; the error."""
    rest = list(lines)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    payload = json.loads(rest[-2].removeprefix("data: "))
    assert "error" in payload, rest[-3:]
    assert not any('"finish_reason": "length"' in e or '"finish_reason":"length"' in e for e in rest[:-2])
    return payload["error"]


# --- the serving loop, on a fake engine (no core process: fast) -------------------------------


def test_a_fatal_engine_error_fails_requests_as_engine_dead_never_overloaded() -> None:
    engine = FakeEngine()
    loop = EngineLoop(engine, idle_poll_s=0.05)
    loop.start()

    def die() -> list:
        raise EngineDeadError("worker 1 is gone")  # as a dead tensor-parallel worker or scheduler reports

    async def scenario() -> tuple[RequestDelta, BaseException]:
        out = DeltaStream()
        await loop.add("r1", "hi", SamplingParams(max_tokens=10_000), out)
        while not (await out.get()).samples:
            pass
        engine.step = die  # type: ignore[method-assign]
        while not (delta := await out.get()).finished:
            pass
        with pytest.raises(DeadEngineRefusal) as late:  # not a RuntimeError: not "shutting down, retry"
            await loop.add("r2", "hi", SamplingParams(max_tokens=1), DeltaStream())
        return delta, late.value

    try:
        delta, late = asyncio.run(scenario())
    finally:
        loop.stop()
    assert (delta.error_code, delta.error_status) == ("engine_dead", 500) and "worker 1 is gone" in delta.error
    assert not isinstance(late, RuntimeError) and "worker 1 is gone" in str(late)
    code, message = loop.health()
    assert loop.engine_dead and code == "engine_dead" and "worker 1 is gone" in message
    assert error_body(503, message, code=code)["error"]["type"] == "engine_dead_error"
    assert ("abort", "r1") in engine.call_log()


def test_request_timeout_aborts_an_accepted_request_in_the_engine() -> None:
    engine = FakeEngine()
    loop = EngineLoop(engine, request_timeout_s=0.3)
    loop.start()

    async def scenario() -> tuple[RequestDelta, float]:
        out = DeltaStream()
        started = time.monotonic()
        await loop.add("slow", "hi", SamplingParams(max_tokens=10**9), out)  # generates until stopped
        while not (delta := await out.get()).finished:
            pass
        return delta, time.monotonic() - started

    try:
        delta, took = asyncio.run(scenario())
    finally:
        loop.stop()
    assert (delta.error_status, delta.error_code) == (504, "request_timeout"), delta
    assert "--request-timeout=0.3 s" in delta.error and 0.3 <= took < 3
    assert ("abort", "slow") in engine.call_log() and not engine.has_unfinished()  # its pages are freed
    assert error_body(504, delta.error)["error"]["type"] == "timeout_error"
    # counted in /metrics (a timed-out request went uncounted before)
    assert loop.metrics.requests.labels(finish_reason="timeout")._value.get() == 1
    with pytest.raises(ValueError, match="request_timeout_s=0"):
        EngineLoop(engine, request_timeout_s=0)


# --- a core killed with SIGKILL ---------------------------------------------------------------


def test_a_killed_idle_core_is_reaped_and_reported_dead(tiny_llama_dir: Path) -> None:
    engine = RemoteEngine(EngineArgs(model=str(tiny_llama_dir), **ENGINE_KW), core_timeout_s=CORE_TIMEOUT_S)
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        assert engine.liveness() is None and engine.exitcode is None
        os.kill(engine.core_pid, signal.SIGKILL)
        # idle: nothing is asked of the core, and still its death is noticed (the serving loop's idle check)
        wait_until(lambda: engine.liveness() is not None, 10, "the receiver to notice the death")
        assert engine.exitcode == -9  # reaped: not None, not a zombie
        assert engine.core_pid not in [c.pid for c in psutil.Process().children()]  # no zombie left
        code, message = engine.liveness()
        assert code == "engine_dead" and "exit code -9: killed by SIGKILL" in message
        with pytest.raises(EngineCoreDeadError, match="exit code -9") as raised:
            engine.check_alive()
        assert isinstance(raised.value, EngineDeadError)  # the engine's own type, caught by type
        answers: list = []
        engine.submit("b", [5, 6], SamplingParams(max_tokens=2), 0, answers.append)
        with pytest.raises(EngineDeadError):
            engine.step()
        assert isinstance(answers[0], EngineDeadError)  # the add on its way is answered, not left hanging
    finally:
        engine.shutdown()


def test_a_killed_core_under_an_embedded_server_fails_typed_and_the_server_stays(embedded) -> None:
    served = embedded()
    with open_stream(served.url, stream_body()) as lines:
        os.kill(served.engine.core_pid, signal.SIGKILL)
        error = error_event(lines)
    assert error["type"] != "server_overloaded_error" and error["code"] in (None, "engine_dead")
    assert "exit code -9: killed by SIGKILL" in error["message"], error
    wait_until(lambda: served.health().status_code == 503, 10, "/health to report the dead engine")
    health = served.health().json()["error"]
    assert (health["type"], health["code"]) == ("engine_dead_error", "engine_dead"), health
    assert "exit code -9" in health["message"] and served.engine.exitcode == -9
    # a request after the death: a dead-engine 503, not "overloaded"; the embedded server keeps answering
    late = httpx.post(served.url + "/v1/completions", json={**stream_body(4), "stream": False}, timeout=30)
    assert late.status_code == 503, late.text
    assert (late.json()["error"]["type"], late.json()["error"]["code"]) == ("engine_dead_error", "engine_dead")
    assert served.loop.engine_dead and served.health().status_code == 503


def _core_of(server_pid: int) -> int:
    """The engine core: the server's spawned child (not multiprocessing's resource tracker)."""
    def found() -> list[int]:
        return [c.pid for c in psutil.Process(server_pid).children()
                if any("spawn_main" in part for part in c.cmdline())]

    wait_until(lambda: len(found()) == 1, 30, "the engine core process")
    return found()[0]


def test_pagedrs_serve_exits_non_zero_after_its_core_is_killed(tiny_llama_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedrs.server", "--model", str(tiny_llama_dir), "--served-model-name", "tiny",
           "--port", str(port), "--block-size", "4", "--num-gpu-blocks", "80", "--max-model-len", "256",
           "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, f"the server exited early:\n{proc.stdout.read()}"
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 180, "the server to answer /health")
        with open_stream(url, stream_body()) as lines:
            os.kill(_core_of(proc.pid), signal.SIGKILL)
            error = error_event(lines)  # the stream is answered before the server goes
        assert "exit code -9" in error["message"] and error["type"] != "server_overloaded_error"
        assert proc.wait(timeout=30) == ENGINE_DEAD_EXIT != 0
        assert "the engine is dead" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


# --- a core stopped with SIGSTOP --------------------------------------------------------------


def test_a_stopped_core_turns_health_503_and_back_to_200(embedded) -> None:
    served = embedded()
    time.sleep(2.5 * CORE_TIMEOUT_S)  # idle for longer than the timeout: the heartbeat keeps it alive
    assert served.health().status_code == 200
    os.kill(served.engine.core_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_until(lambda: served.health().status_code == 503, 10 * CORE_TIMEOUT_S, "/health to say 503")
        # not before the timeout (counted from the last beat, at most one interval before the stop)
        assert time.monotonic() - stopped_at >= CORE_TIMEOUT_S - heartbeat_interval(CORE_TIMEOUT_S)
        error = served.health().json()["error"]
        assert (error["type"], error["code"]) == ("engine_unresponsive_error", "engine_unresponsive"), error
        assert "--core-timeout=1 s" in error["message"]
    finally:
        os.kill(served.engine.core_pid, signal.SIGCONT)
    wait_until(lambda: served.health().status_code == 200, 10, "/health to say 200 again")


def test_a_stopped_core_is_killed_at_shutdown_without_the_full_wait(embedded) -> None:
    """A server SIGTERM'd while its core was SIGSTOP'd took 13.9 s to exit against a --shutdown-timeout of 2
    (a probe's find): the stop message waited out every stage. A core already silent past --core-timeout now
    gets 1 s to answer the stop, then is killed."""
    served = embedded()
    os.kill(served.engine.core_pid, signal.SIGSTOP)
    wait_until(lambda: served.health().status_code == 503, 10 * CORE_TIMEOUT_S, "/health to say 503")
    served.http.stop()
    served.loop.stop()
    started = time.monotonic()
    served.engine.shutdown(timeout_s=10.0)
    assert time.monotonic() - started < 5 and not served.engine.is_alive()


def test_request_timeout_on_a_stopped_core_answers_504_and_frees_the_pages(embedded) -> None:
    served = embedded(request_timeout_s=1.0)
    with open_stream(served.url, stream_body()) as lines:  # accepted and running
        os.kill(served.engine.core_pid, signal.SIGSTOP)
        try:
            error = error_event(lines)  # an error event, then [DONE]
            assert error["type"] == "timeout_error", error
            assert "--request-timeout=1 s" in error["message"], error
            wait_until(lambda: served.health().status_code == 503, 10 * CORE_TIMEOUT_S, "/health to say 503")
            started = time.monotonic()
            late = httpx.post(served.url + "/v1/completions", json={**stream_body(4), "stream": False}, timeout=30)
            # refused at once, as /health says (it was queued behind the stopped core until the timeout's 504;
            # without --request-timeout, until the client gave up)
            assert late.status_code == 503, late.text
            assert late.json()["error"]["code"] == "engine_unresponsive", late.text
            assert time.monotonic() - started < 2
        finally:
            os.kill(served.engine.core_pid, signal.SIGCONT)

    def all_pages_free() -> bool:
        stats = served.loop.stats()
        return stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"] and stats["num_running"] == 0

    wait_until(all_pages_free, 10, "the aborts to reach the core and free every page")
    done = httpx.post(served.url + "/v1/completions", json={**stream_body(4), "stream": False}, timeout=30)
    assert done.status_code == 200, done.text  # the resumed core serves again


# --- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--core-timeout", "0"], ["--core-timeout", "nan"], ["--core-timeout", "inf"],
    ["--request-timeout", "-1"], ["--request-timeout", "nan"],
])
def test_bad_liveness_flags_exit_2_naming_the_flag(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--model", "/nonexistent/model/dir"]) == 2
    err = capsys.readouterr().err
    assert f"{argv[0]}={float(argv[1])!r}" in err and "finite number of seconds > 0" in err, err
