"""What a handler receives from the engine thread (RequestDelta) and the mailbox that carries it.

DeltaStream: the engine thread's deltas for one HTTP request, merged while its handler lags.

Why not an ``asyncio.Queue`` fed by ``call_soon_threadsafe`` per delta: the engine thread
produces a delta per request per step, and a step can be far faster than the event loop
writes a server-sent event. With one callback per delta, a fast step against a slow stream
grows the event loop's ready queue without bound; every loop iteration then runs the whole
backlog before it reads a socket, so a new connection waits longer and longer (it was seen
as a second request that never reached the engine in 30 s). vLLM's RequestOutputCollector
solves the same problem the same way: while the consumer has not taken an engine request's
delta, the next one is merged into it.

So here: at most one wakeup callback is scheduled per stream at a time, at most one pending
delta is held per engine request, and a handler that falls behind receives fewer, larger
deltas with exactly the same tokens, text and logprobs in the same order.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, replace

__all__ = ["DeltaStream", "RequestDelta", "SampleDelta", "merge_deltas"]


@dataclass(frozen=True)
class SampleDelta:
    """What one sample (of n) gained in one step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # one dict per token in token_ids, when requested
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(frozen=True)
class RequestDelta:
    """One engine request's progress in one step, or its failure (``error`` set, ``finished``)."""

    tag: int  # which prompt of the HTTP request this engine request serves
    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleDelta]
    finished: bool
    error: str | None = None
    error_status: int = 500  # the HTTP status the error maps to (503: the server is shutting down)
    error_code: str | None = None  # OpenAI's `code`: ENGINE_DEAD, REQUEST_TIMEOUT, or None
    error_param: str | None = None  # OpenAI's `param`: the request field a 400 names (RequestOutput.error_param)
    num_cached_tokens: int = 0  # prompt tokens whose K/V the engine reused (RequestOutput.num_cached_tokens)
    cached_tokens_by_tier: dict[str, int] | None = None  # that count by tier (RequestOutput.cached_tokens_by_tier)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # RequestOutput.prompt_logprobs, once complete


class DeltaStream:
    """Thread-safe mailbox from the engine thread to one asyncio handler.

    Create it on the handler's event loop; ``put`` may be called from any thread, ``get``
    only on that loop.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._pending: dict[str, RequestDelta] = {}  # engine request id -> what its handler has not taken
        self._wakeup_scheduled = False
        self._ready = asyncio.Event()

    def put(self, delta: RequestDelta) -> bool:
        """Hand ``delta`` over (merged into an untaken one of the same request); False when the
        handler's event loop is closed (the server is shutting down)."""
        with self._lock:
            earlier = self._pending.pop(delta.request_id, None)
            # Re-inserted at the end: requests whose deltas are older are handed out first.
            self._pending[delta.request_id] = delta if earlier is None else merge_deltas(earlier, delta)
            if self._wakeup_scheduled:
                return True
            self._wakeup_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the event loop is closed
            return False
        return True

    def _wake(self) -> None:
        with self._lock:
            self._wakeup_scheduled = False
        self._ready.set()

    def get_nowait(self) -> RequestDelta | None:
        """The oldest pending delta, or None."""
        with self._lock:
            if not self._pending:
                return None
            request_id = next(iter(self._pending))
            return self._pending.pop(request_id)

    async def get(self) -> RequestDelta:
        """The oldest pending delta; waits for one."""
        while True:
            delta = self.get_nowait()
            if delta is not None:
                return delta
            self._ready.clear()
            with self._lock:
                if self._pending:  # arrived between the check and the clear: its wakeup may be spent
                    continue
            await self._ready.wait()


def merge_deltas(earlier: RequestDelta, later: RequestDelta) -> RequestDelta:
    """One delta that says what ``earlier`` then ``later`` said (same engine request).

    Tokens, text and logprobs concatenate per sample; the finish state, the error and its
    status are the later one's; the prompt ids and cached-token count come from whichever
    delta carried them (the first output of a request carries them).
    """
    if earlier.request_id != later.request_id:
        raise ValueError(f"merge_deltas: request ids differ ({earlier.request_id!r} and {later.request_id!r})")
    if earlier.finished:
        return earlier  # nothing follows a request's last delta; a stray later one is dropped
    samples: dict[int, SampleDelta] = {s.index: s for s in earlier.samples}
    for sample in later.samples:
        before = samples.get(sample.index)
        samples[sample.index] = sample if before is None else _merge_sample(before, sample)
    return replace(
        later,
        prompt_token_ids=earlier.prompt_token_ids or later.prompt_token_ids,
        samples=[samples[i] for i in sorted(samples)],
        num_cached_tokens=later.num_cached_tokens or earlier.num_cached_tokens,
        cached_tokens_by_tier=later.cached_tokens_by_tier or earlier.cached_tokens_by_tier,
        prompt_logprobs=later.prompt_logprobs or earlier.prompt_logprobs,
    )


def _merge_sample(before: SampleDelta, after: SampleDelta) -> SampleDelta:
    logprobs = None
    if before.logprobs is not None or after.logprobs is not None:
        logprobs = [*(before.logprobs or []), *(after.logprobs or [])]
    return SampleDelta(
        index=before.index,
        text=before.text + after.text,
        token_ids=[*before.token_ids, *after.token_ids],
        logprobs=logprobs,
        finish_reason=after.finish_reason if after.finish_reason is not None else before.finish_reason,
        stop_reason=after.stop_reason if after.finish_reason is not None else before.stop_reason,
    )
