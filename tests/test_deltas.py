"""DeltaStream and merge_deltas: a handler that lags gets fewer, larger deltas, never fewer tokens,
and the engine thread schedules a bounded number of event-loop callbacks however fast it steps."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("pagedrs._core")

from pagedrs.server.deltas import DeltaStream, RequestDelta, SampleDelta, merge_deltas  # noqa: E402
from pagedrs.server.errors import APIError  # noqa: E402
from pagedrs.server.serving import Generation  # noqa: E402


def _delta(
    request_id: str,
    token: int,
    *,
    prompt: list[int] | None = None,
    finish: str | None = None,
    error: str | None = None,
    logprobs: bool = False,
) -> RequestDelta:
    sample = SampleDelta(0, chr(token), [token], [{token: -1.0}] if logprobs else None, finish, None)
    return RequestDelta(
        0,
        request_id,
        prompt or [],
        [] if error else [sample],
        finished=finish is not None or error is not None,
        error=error,
        num_cached_tokens=4 if prompt else 0,
    )


def test_merge_concatenates_in_order_and_keeps_the_first_prompt_and_the_last_finish() -> None:
    merged = merge_deltas(_delta("r", 97, prompt=[1, 2], logprobs=True), _delta("r", 98, logprobs=True))
    merged = merge_deltas(merged, _delta("r", 99, finish="length", logprobs=True))
    (sample,) = merged.samples
    assert (sample.text, sample.token_ids, sample.finish_reason) == ("abc", [97, 98, 99], "length")
    assert sample.logprobs == [{97: -1.0}, {98: -1.0}, {99: -1.0}]
    assert merged.prompt_token_ids == [1, 2] and merged.num_cached_tokens == 4 and merged.finished


def test_merge_keeps_an_error_after_tokens_and_refuses_two_requests() -> None:
    merged = merge_deltas(_delta("r", 97), _delta("r", 0, error="boom"))
    assert merged.error == "boom" and merged.finished and merged.samples[0].token_ids == [97]
    with pytest.raises(ValueError, match="request ids differ"):
        merge_deltas(_delta("r", 97), _delta("s", 98))
    finished = _delta("r", 97, finish="stop")
    assert merge_deltas(finished, _delta("r", 98)) is finished  # nothing follows a last delta


def test_a_flood_from_another_thread_is_merged_with_few_callbacks() -> None:
    """20,000 deltas from the engine thread while the handler sleeps: every token arrives, in
    order, and the event loop got far fewer callbacks than deltas (the starvation this fixes)."""
    tokens_per_request = 10_000

    async def scenario() -> tuple[dict[str, list[int]], int]:
        stream = DeltaStream()
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        def produce() -> None:
            for i in range(tokens_per_request):
                last = "length" if i == tokens_per_request - 1 else None
                for rid in ("a", "b"):
                    assert stream.put(_delta(rid, 32 + i % 90, finish=last))

        producer = threading.Thread(target=produce)
        producer.start()
        got: dict[str, list[int]] = {"a": [], "b": []}
        done: set[str] = set()
        while done != {"a", "b"}:
            delta = await stream.get()
            got[delta.request_id].extend(delta.samples[0].token_ids)
            if delta.finished:
                done.add(delta.request_id)
            await asyncio.sleep(0.001)  # a slow handler
        producer.join()
        return got, calls

    got, calls = asyncio.run(scenario())
    expected = [32 + i % 90 for i in range(tokens_per_request)]
    assert got == {"a": expected, "b": expected}
    assert calls < tokens_per_request, f"{calls} callbacks for {2 * tokens_per_request} deltas"


def test_put_after_the_loop_closed_says_so() -> None:
    async def make() -> DeltaStream:
        return DeltaStream()

    stream = asyncio.run(make())  # asyncio.run closes its loop on return
    assert stream.put(_delta("r", 97)) is False


def test_generation_hands_out_merged_tokens_before_the_error() -> None:
    """A handler that lagged gets tokens and error in one delta: the tokens still reach the client."""

    async def scenario() -> tuple[list[int], APIError]:
        ctx = SimpleNamespace(engine_loop=SimpleNamespace(abort=lambda request_id: None), prefix_cache_isolation="shared")
        generation = Generation(ctx, [[1]], SimpleNamespace(n=1))  # type: ignore[arg-type]
        generation.stream = DeltaStream()
        generation._unfinished = {"r"}
        generation.stream.put(merge_deltas(_delta("r", 97, prompt=[1]), _delta("r", 0, error="boom")))
        seen: list[int] = []
        with pytest.raises(APIError) as failed:
            async for delta in generation.deltas():
                seen.extend(t for s in delta.samples for t in s.token_ids)
        return seen, failed.value

    seen, error = asyncio.run(scenario())
    assert seen == [97] and "boom" in str(error)
