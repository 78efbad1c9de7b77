"""The engine: requests in, incremental outputs out, one core step at a time.

    add_request ──► InputProcessor ──► CoreClient ──► EngineCore (scheduler, executor, sampler, policies)
                                                          │ token ids
    step() ◄── RequestOutputs ◄── OutputProcessor ◄───────┘ (text, stop strings ──► FinishSample)

``Engine`` wires three parts and decides nothing itself: the InputProcessor validates and
tokenizes (everything that can reject a request is checked before the core is touched),
the core (core/engine_core.py) runs steps on token ids, and the OutputProcessor
(frontend/output_processor.py) makes the text and decides where it ends. The core sits
behind a ``CoreClient`` (frontend/client.py); the Engine never knows where it runs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional

from pagedrs.attention import AttentionBackend
from pagedrs.beam_search import BeamSearchParams
from pagedrs.core.engine_core import EngineCore
from pagedrs.core.pins import validate_ttl
from pagedrs.core.protocol import Abort, CacheReset, FinishSample, PinPrefix, PinState, is_engine_fatal
from pagedrs.engine_args import EngineArgs
from pagedrs.errors import PinCapError, UnknownPinError
from pagedrs.frontend.client import AckCallback, InprocClient, start_client
from pagedrs.frontend.input_processor import InputProcessor, PromptType
from pagedrs.frontend.output_processor import OutputProcessor
from pagedrs.outputs import RequestOutput
from pagedrs.rollback import Rollback
from pagedrs.sampling_params import SamplingParams
from pagedrs.stats import EngineStats

__all__ = ["Engine", "PromptType"]


class Engine:
    """``client``: "inproc" (the core in this process, the default) or "mp" (the core in its own
    process: ``pagedrs serve``'s default; ``mp_options`` are ``start_timeout_s`` and ``core_timeout_s``)."""

    def __init__(
        self, args: Optional[EngineArgs] = None, *, client: str = "inproc",
        attention_backend: AttentionBackend | None = None, mp_options: Optional[dict[str, float]] = None, **kwargs: Any,
    ) -> None:
        self._start(args if args is not None else EngineArgs(**kwargs), client, attention_backend, mp_options or {})

    def _start(self, args: EngineArgs, client: str, attention_backend: AttentionBackend | None,
               mp_options: dict[str, float]) -> None:
        self.args = args
        self.client, info = start_client(args, client, attention_backend=attention_backend, **mp_options)
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size  # token ids are in [0, vocab_size)
        self.inputs = InputProcessor(self.tokenizer, info.vocab_size, self.max_model_len, args.max_n)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._aborting: set[str] = set()  # aborted, their final output not yet processed

    # ---- the in-process core, for tests and benchmarks that look inside ---------------

    @property
    def core(self) -> EngineCore:
        if not isinstance(self.client, InprocClient):
            raise AttributeError("the engine core runs in another process (client='mp'); it has no in-process core")
        return self.client.core

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Any) -> None:  # tests wrap it to inject failures
        self.core.scheduler = scheduler

    executor = property(lambda self: self.core.executor)
    loaded = property(lambda self: self.core.loaded)
    kv_plan = property(lambda self: self.core.kv_plan)
    scheduler_config = property(lambda self: self.core.scheduler_config)
    num_host_cache_blocks = property(lambda self: self.core.num_host_cache_blocks)
    policies = property(lambda self: self.core.policies)
    device = property(lambda self: self.core.device)

    @property
    def requests(self) -> Mapping[str, Any]:
        """The core's unfinished requests (their sequences and token ids), by id; read-only."""
        return self.core.requests


    @property
    def sequences(self) -> Mapping[int, Any]:
        """Every live sequence in the core: seq id -> (request, sample); read-only."""
        return self.core.sequences

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams | BeamSearchParams] = None,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Validates and queues a request; raises ValueError (or TypeError) with nothing changed.

        ``params`` is SamplingParams (``n`` samples, the best ``n`` of ``best_of``, or beam
        search with ``use_beam_search=True``) or BeamSearchParams (beam search).
        ``arrival_time`` (``time.monotonic()``; default now) is when a front end received it,
        as in vLLM: the server's API process stamps it, so the request's metrics count the
        time it spent reaching the engine. ``cache_salt`` (vLLM's): the request shares
        prefix-cache pages only with requests of the same salt, on every tier and across
        restarts (a string of 1 to 256 UTF-8 bytes)."""
        processed = self.inputs.process(request_id, prompt, params, priority, arrival_time, cache_salt)
        if request_id in self.output_processor:
            raise ValueError(f"request {request_id!r} already exists; request ids must be unique among unfinished requests")
        with Rollback() as undo:
            self.client.add(processed.core_request())
            undo(lambda: self.client.abort(request_id))
            self.output_processor.add(processed, time.monotonic())

    def submit(
        self, request_id: str, prompt: PromptType, params: Optional[SamplingParams | BeamSearchParams],
        priority: int, on_ack: AckCallback, cache_salt: Optional[str] = None, arrival_time: Optional[float] = None,
    ) -> None:
        """``add_request`` from any thread, without waiting: validates here (raises ValueError or
        TypeError with nothing changed) and sends the add; ``on_ack(error)`` runs on the stepping
        thread when the core took it (None) or refused it. The serving loop's one way in, whichever
        client the engine holds: a burst of adds reaches the core at one step boundary."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        processed = self.inputs.process(request_id, prompt, params, priority, arrival, cache_salt)
        if request_id in self.output_processor:
            raise ValueError(f"request_id={request_id!r} is already in flight; request ids must be unique")

        def answered(error: Optional[BaseException]) -> None:
            if error is None:
                self.output_processor.add(processed, time.monotonic())
            on_ack(error)

        self.client.submit(processed.core_request(), answered)

    def abort(self, request_id: str) -> bool:
        """Ends a request now and frees its pages (an add still on its way too); its final output
        comes with the next step, from the core, as every other output does."""
        if request_id in self._aborting:
            return False  # aborted once already; its final output is on its way
        if request_id not in self.output_processor and not self.client.awaiting(request_id):
            return False
        self._aborting.add(request_id)
        self.client.abort(request_id)
        return True

    def check_alive(self) -> None:
        """Raises ``EngineDeadError`` once the core is gone (only a core in another process can go)."""
        self.client.check_alive()

    def liveness(self) -> tuple[str, str] | None:
        """``(code, message)`` while the core cannot serve (gone, or silent too long); else None."""
        return self.client.liveness()

    def has_unfinished(self) -> bool:
        return bool(len(self.output_processor)) or self.client.pending()

    def num_unfinished(self) -> int:
        """Requests not finished and not aborted (an aborted one's final output may still be on its way)."""
        return len(self.output_processor) - sum(1 for r in self._aborting if r in self.output_processor)

    def step(self) -> list[RequestOutput]:
        """Runs one core step; returns an output for every request that progressed
        (a beam search, or ``best_of > n``, only once it finished)."""
        if not len(self.output_processor) and not self.client.pending():
            return []
        try:
            core_outputs = self.client.step()
        except Exception as exc:
            if is_engine_fatal(exc):  # the core ended every request; so does the front end
                self.output_processor.fail_all()
                self._aborting.clear()
            raise
        results, commands = self.output_processor.process(core_outputs.outputs)
        if self._aborting:
            self._aborting -= {r.request_id for r in results if r.finished}
        for command in commands:
            if isinstance(command, FinishSample):
                self.client.finish_sample(command)
            elif isinstance(command, Abort):
                self.client.abort(command.request_id)
        return results

    # ---- reporting and lifecycle ------------------------------------------------------

    def typed_stats(self) -> EngineStats:
        return self.client.stats()

    def stats(self) -> dict[str, Any]:
        """``typed_stats()`` as a dict (the engine contract's string keys)."""
        return self.typed_stats().as_dict()

    def reset_prefix_cache(self) -> CacheReset:
        """Forgets every cached page on every tier, the disk store's too (stepping thread); the pages
        each tier dropped. PrefixCacheBusyError, nothing cleared, while requests are unfinished."""
        return self.client.reset_prefix_cache()

    def pin(self, prompt_or_messages: Any, ttl_s: Optional[float] = None, cache_salt: Optional[str] = None) -> PinState:
        """Prefills a prompt and pins its full pages on the device: no eviction takes them until
        ``unpin`` or ``ttl_s`` seconds (None: no TTL; at most 7 days), so every request starting
        with it hits them (under the same ``cache_salt``). ``prompt_or_messages``: a prompt as
        ``add_request`` takes it, or chat messages (a list of dicts, rendered by the chat template
        without a generation prompt: the system prompt of later chats). Stepping thread; other
        requests step beside the prefill. ValueError (a bad prompt or TTL, a prompt of less than
        one page or that can never fit the pool), PinCapError past ``max_pinned_fraction``."""
        ttl = validate_ttl(ttl_s)
        prompt = prompt_or_messages
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            prompt = {"prompt_token_ids": self._render_messages(prompt)}
        processed = self.inputs.process("pin", prompt, SamplingParams(max_tokens=1), 0, None, cache_salt)
        answer = self.client.pin_prefix(PinPrefix(processed.prompt_token_ids, ttl, cache_salt))
        if answer.refused is not None or answer.pin is None:
            error = PinCapError if answer.refused_kind == "cap" else ValueError
            raise error(answer.refused or "the pin was refused")
        return answer.pin

    def pin_prefix(self, prompt_or_messages: Any, ttl_s: Optional[float] = None, cache_salt: Optional[str] = None) -> str:
        """``pin`` returning the pin's id only (what ``unpin`` takes)."""
        return self.pin(prompt_or_messages, ttl_s, cache_salt).pin_id

    def unpin(self, pin_id: str) -> None:
        """Releases a pin's pages (cached ones stay, evictable); UnknownPinError (a KeyError) when it is not live."""
        if not isinstance(pin_id, str) or not self.client.unpin(pin_id):
            raise UnknownPinError(f"pin_id={pin_id!r} is not a live pin: never made, expired, or unpinned already")

    def list_pins(self) -> list[PinState]:
        """The live pins, oldest first (expired ones released first)."""
        return self.client.list_pins()

    def _render_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        for i, m in enumerate(messages):
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    wrong = (f"messages[{i}][{key!r}] is {m[key]!r} ({type(m[key]).__name__})" if key in m
                             else f"messages[{i}] has no {key!r} (its keys: {sorted(map(str, m))})")
                    raise ValueError(f"{wrong}; a pinned message needs a string 'role' and a string 'content'")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=False))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Aborts what is left, flushes the cached KV pages to the disk tier (when on), and
        releases the core (its disk store closed, tensor-parallel workers exited). Once."""
        for request_id in list(self.output_processor.requests):
            self.output_processor.abort(request_id)
        self._aborting.clear()
        self.client.shutdown(timeout_s)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def check_invariants(self) -> None:
        """The core's invariants, plus: the front end and the core hold the same requests."""
        self.core.check_invariants()
        if set(self.core.requests) - set(self.output_processor.requests):
            raise AssertionError(f"the core holds requests the front end does not: "
                                 f"{sorted(set(self.core.requests) - set(self.output_processor.requests))}")
