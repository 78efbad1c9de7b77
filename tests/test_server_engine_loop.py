"""The server's plumbing — engine thread, back-pressure, failures, disconnects — on a fake engine.

A fake engine (tests/server_fakes.py) can be held inside a step, which makes the
orderings these tests check deterministic. The real model is exercised in test_server.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from pagedrs.sampling_params import SamplingParams  # noqa: E402
from pagedrs.server import EngineLoop  # noqa: E402
from pagedrs.server.deltas import DeltaStream  # noqa: E402
from server_fakes import MODEL, FakeEngine, Served, served_factory, wait_until  # noqa: E402


@pytest.fixture
def make_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


def test_abort_is_applied_before_the_next_step() -> None:
    """An abort sent while step k runs is applied before step k+1 (here: there is no k+1)."""
    permits = threading.Semaphore(0)
    engine = FakeEngine(permits=permits)
    loop = EngineLoop(engine)
    loop.start()
    try:

        async def scenario() -> None:  # one event loop throughout: deltas need a live loop to land on
            await loop.add("r1", "hi", SamplingParams(max_tokens=50), DeltaStream())
            wait_until(lambda: ("step", None) in engine.call_log(), "the first step to start")
            loop.abort("r1")
            permits.release(100)
            wait_until(lambda: ("abort", "r1") in engine.call_log(), "the abort to be applied")
            wait_until(lambda: loop.stats().get("num_running") == 0, "the stats to show no running request")

        asyncio.run(scenario())
        assert engine.call_log() == [("add", "r1"), ("step", None), ("abort", "r1")]
    finally:
        permits.release(10_000)
        loop.stop()


def test_add_rejected_by_the_engine_raises_its_value_error() -> None:
    loop = EngineLoop(FakeEngine(max_model_len=4))
    loop.start()
    try:
        with pytest.raises(ValueError, match="max_model_len 4"):
            async def add() -> None:
                await loop.add("r1", "too long", SamplingParams(max_tokens=1), DeltaStream())

            asyncio.run(add())
        assert loop.num_waiting() == 0
    finally:
        loop.stop()


def test_503_when_the_waiting_queue_is_full(make_served: Callable[..., Served]) -> None:
    permits = threading.Semaphore(0)
    served = make_served(FakeEngine(permits=permits), max_waiting=2)
    client = served.client()
    with ThreadPoolExecutor(2) as pool:
        # 1: added at the first step boundary, then the engine is held inside that step; until the
        # step's stats come in, the loop counts it as waiting (the engine has not said it runs)
        first = pool.submit(client.completions.create, model=MODEL, prompt="a", max_tokens=2)
        wait_until(lambda: served.count("step") == 1, "the first request's step")
        wait_until(lambda: served.loop.num_waiting() == 1, "the first request counted as waiting")
        # 2: submitted while the step is held: waiting too
        second = pool.submit(client.completions.create, model=MODEL, prompt="b", max_tokens=2)
        wait_until(lambda: served.loop.num_waiting() == 2, "two waiting requests")
        # 3: would make the waiting queue 3 > --max-waiting 2
        with pytest.raises(openai.APIStatusError) as rejected:
            client.completions.create(model=MODEL, prompt="c", max_tokens=2)
        permits.release(10_000)
        assert first.result(timeout=60).choices[0].text == "ab"
        assert second.result(timeout=60).choices[0].text == "ab"
    assert rejected.value.status_code == 503
    error = rejected.value.body
    assert error["type"] == "server_overloaded_error" and error["code"] == "server_overloaded"
    assert "2 requests are waiting and --max-waiting is 2" in error["message"]
    wait_until(lambda: served.loop.num_waiting() == 0, "nothing waiting once both finished")
    metrics = httpx.get(served.url + "/metrics").text
    assert 'pagedrs_requests_rejected_total{status="503"} 1.0' in metrics


def test_a_failed_step_fails_its_requests_with_500_and_the_server_keeps_serving(
    make_served: Callable[..., Served],
) -> None:
    engine = FakeEngine()
    engine.fail_next_step = True
    served = make_served(engine)
    client = served.client()
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model=MODEL, prompt="a", max_tokens=3)
    assert "injected step failure" in failed.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=3).choices[0].text == "abc"
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}


def test_a_failed_step_ends_a_stream_with_an_error_event_then_done(make_served: Callable[..., Served]) -> None:
    engine = FakeEngine()
    engine.fail_next_step = True
    served = make_served(engine)
    body = {"model": MODEL, "prompt": "a", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    assert len(events) == 2 and events[1] == "data: [DONE]"
    error = json.loads(events[0].removeprefix("data: "))["error"]
    assert error["type"] == "internal_server_error" and error["message"].endswith("RuntimeError: injected step failure")


def test_non_streaming_client_that_disconnects_is_aborted(make_served: Callable[..., Served]) -> None:
    permits = threading.Semaphore(0)
    served = make_served(FakeEngine(permits=permits))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 50}, timeout=0.5)
    # the client closed its connection while the engine was held inside the first step
    _step_until_aborted(served, permits)


def test_streaming_client_that_disconnects_is_aborted(make_served: Callable[..., Served]) -> None:
    permits = threading.Semaphore(0)
    served = make_served(FakeEngine(permits=permits))
    body = {"model": MODEL, "prompt": "a", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as response:
        permits.release(2)
        events = (line for line in response.iter_lines() if line)
        text = ""
        while len(text) < 2:  # two steps: one event each, or one merged event when the stream lagged
            text += json.loads(next(events).removeprefix("data: "))["choices"][0]["text"]
    assert text == "ab"
    # closed after two chunks
    _step_until_aborted(served, permits)


def _step_until_aborted(served: Served, permits: threading.Semaphore) -> None:
    """The server aborts the abandoned request while the engine is still held in an early step.

    The request asked for 50 tokens and the engine has taken at most 3 steps: once the
    HTTP handler is over (its abort is then queued), released steps end within one more
    step. Conditions, not sleeps, order the two threads.
    """
    wait_until(lambda: served.app.state.drain.active == 0, "the server to end the abandoned request")
    permits.release(10_000)
    wait_until(lambda: served.count("abort") == 1, "the abort to reach the engine")
    wait_until(lambda: not served.engine.has_unfinished(), "the engine to be idle")
    assert served.count("step") <= 4


def test_sampling_value_errors_become_400_naming_the_field(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine())
    with pytest.raises(openai.BadRequestError) as bad:
        served.client().completions.create(model=MODEL, prompt="a", top_p=1.5)
    assert bad.value.body["param"] == "top_p"
    assert bad.value.body["message"] == "SamplingParams.top_p=1.5 is out of range: allowed 0 < top_p <= 1"


def test_chat_without_max_tokens_fills_what_the_kv_pool_can_hold(make_served: Callable[..., Served]) -> None:
    """Context 64 tokens, pool 8 pages x 4 = 32 slots: the default stops at the pool, not the context."""
    served = make_served(FakeEngine(max_model_len=64))
    response = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    prompt_tokens = len("<user>hi<assistant>")
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 32 - prompt_tokens
    assert response.choices[0].finish_reason == "length"
