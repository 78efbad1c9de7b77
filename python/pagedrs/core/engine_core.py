"""EngineCore: token ids in, token ids out, one scheduler step at a time.

    add(CoreRequest) ──► Scheduler (Rust) ──► StepInput ──► Executor ──► logits
                            ▲                                              │
                            └── fork / append / finish ◄── policy ◄── sample ┘ ──► CoreOutputs

The core owns the scheduler, the executor, the sampler and the continuation policies,
and ends a sequence by token rules only (core/request.py); it never holds text. The
front end ends a sample by a text rule with ``finish_sample``. Everything a command
takes was validated by the front end (frontend/input_processor.py); the core is touched
last, and a failure after that rolls back (``Rollback``). The step itself: core/step.py;
the stats snapshot: core/core_stats.py; a seed's generator: core/seeding.py (``generator_seed``,
re-exported here).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Optional, Union

import numpy as np
import torch

from pagedrs.attention import AttentionBackend
from pagedrs.beam_search import BeamSearchParams
from pagedrs.core import prompt_logprobs
from pagedrs.core.async_step import AsyncScheduler
from pagedrs.core.continuation import BeamSearch, ContinuationPolicy, IndependentSamples, request_shape
from pagedrs.core.core_stats import core_stats
from pagedrs.core.fast_rows import FastRows
from pagedrs.core.pins import PinRegistry
from pagedrs.core.prefix_cache import cached_tokens_by_tier, recount_cached_tokens
from pagedrs.core.protocol import CoreOutput, CoreOutputItem, CoreOutputs, CoreRequest, CoreTokenRows, RequestMetrics
from pagedrs.core.request import Request, Sample
from pagedrs.core.seeding import generator_seed
from pagedrs.core.setup import build_core
from pagedrs.core.spec_step import Speculator
from pagedrs.core.step import StepContext, run_step
from pagedrs.core.structured.backend import GrammarCompiler
from pagedrs.core.structured.compilers import make_compiler
from pagedrs.engine_args import EngineArgs
from pagedrs.errors import FieldError, error_param, error_text
from pagedrs.executor.async_execution import AsyncExecution
from pagedrs.rollback import Rollback
from pagedrs.sampling_params import SamplingParams
from pagedrs.spec.config import SpeculativeConfig
from pagedrs.stats import EngineStats
from pagedrs.step_input import StepInput


def _pool_fit_error(exc: ValueError, prompt_len: int, block_size: int, pool_blocks: int) -> ValueError:
    """The scheduler's refusal of a request the KV pool can never hold (``Scheduler.add_sequence``'s "the
    request needs up to ..."), as a ``FieldError`` naming the field to change: "prompt" when the prompt
    and one new token cannot fit the pool's ``pool_blocks``, else "max_tokens" (a server's 400 then names
    it in ``param``); any other refusal is ``exc`` itself."""
    if not str(exc).startswith("the request needs up to"):
        return exc
    prompt_blocks = -(-(prompt_len + 1) // block_size)
    return FieldError("prompt" if prompt_blocks > pool_blocks else "max_tokens", str(exc))


class EngineCore:
    def __init__(self, args: EngineArgs, *, attention_backend: AttentionBackend | None = None) -> None:
        self.args = args
        self.device = torch.device(args.device)
        parts = build_core(self, args, attention_backend)
        self.executor = parts.executor
        self.scheduler = parts.scheduler
        self.scheduler_config = parts.scheduler_config
        self.kv_plan = parts.kv_plan
        self.num_host_cache_blocks = parts.num_host_cache_blocks
        self.max_model_len = parts.max_model_len
        self._closer = parts.closer
        self.kv_events = parts.kv_events  # the routers' KV event publisher (core/kv_events.py), fed after each step
        self.loaded = self.executor.loaded
        self.eos_token_ids = frozenset(self.loaded.tokenizer.eos_token_ids)
        self.max_num_seqs = args.max_num_seqs
        # The request's params type chooses its continuation policy.
        self.policies: dict[type, ContinuationPolicy] = {
            SamplingParams: IndependentSamples(self.eos_token_ids, self.max_model_len),
            BeamSearchParams: BeamSearch(self.eos_token_ids, self.max_model_len),
        }
        self._grammars: Optional[GrammarCompiler] = None  # built at the first structured request
        self._grammar_backend = args.structured_outputs_backend
        self._requests: dict[str, Request] = {}
        # every unfinished request still waiting for its first token (note_scheduled's only concern)
        self._unstarted: dict[str, Request] = {}
        self._by_seq: dict[int, tuple[Request, Sample]] = {}
        # requests with prompt_logprobs whose prompt rows are not all in yet (core/prompt_logprobs.py)
        self.prompt_logprob_requests: dict[str, Request] = {}
        self.fast_rows = FastRows(self)  # the plain decode rows, kept from step to step (core/fast_rows.py)
        # speculative decoding (core/spec_step.py); None = off
        self.speculator: Optional[Speculator] = None
        if args.speculative_config is not None:
            self.speculator = self._speculator(SpeculativeConfig.parse(args.speculative_config, args.device))
        self._async: Optional[AsyncScheduler] = None
        if args.async_scheduling:  # steps complete on a worker; two in flight (core/async_step.py)
            self.executor = AsyncExecution(self.executor)
            self._async = AsyncScheduler(self, self.executor)
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()
        self.num_generated = 0
        self.peak_running = 0
        self.num_steps = 0  # steps run (the requests' queue and prefill step counts use it)
        self.pins = PinRegistry(self, args.max_pinned_fraction)  # pinned prefixes, expired at step boundaries (core/pins.py)

    def _speculator(self, config: SpeculativeConfig) -> Speculator:
        """Prompt lookup, or the draft model the executor loaded (spec/draft.py)."""
        if config.method != "draft_model":
            return Speculator(config)
        from pagedrs.spec.draft import DraftSpeculator
        from pagedrs.spec.draft_runner import DraftRunner

        runner = getattr(self.executor, "draft", None)
        if not isinstance(runner, DraftRunner):
            raise ValueError("speculative_config.method is 'draft_model' but this executor holds no draft model "
                             "(only the local executor does: tensor_parallel_size=1)")
        return DraftSpeculator(config, core=self, runner=runner)

    # ---- views (read-only) -------------------------------------------------------------

    @property
    def requests(self) -> Mapping[str, Request]:
        """The unfinished requests, by id."""
        return MappingProxyType(self._requests)

    @property
    def sequences(self) -> Mapping[int, tuple[Request, Sample]]:
        """Every live sequence: seq id -> (its request, its sample)."""
        return MappingProxyType(self._by_seq)

    def note_reset(self, seq_ids: list[int]) -> None:
        """Sequences a failed step reset (``Scheduler.complete_step``'s answer): a request still before
        its first token counts its cached tokens again at its next admission (what the reset threw
        away was never reused)."""
        for seq_id in seq_ids:
            entry = self._by_seq.get(seq_id)
            if entry is not None and entry[0].metrics.first_token_time is None:
                entry[0].recount_cached = True

    def sequence(self, seq_id: int) -> Optional[tuple[Request, Sample]]:
        return self._by_seq.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- commands ---------------------------------------------------------------------

    def add(self, core_request: CoreRequest) -> None:
        """Queues a validated request; raises ValueError with nothing changed when its id is taken."""
        request_id, params = core_request.request_id, core_request.params
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already exists; request ids must be unique among unfinished requests")
        policy = self.policies[type(params)]
        if self.speculator is not None and isinstance(policy, BeamSearch):
            raise ValueError("beam search with speculative_config: not supported (beam search does not speculate); "
                             "allowed: SamplingParams without use_beam_search, or an engine with speculative_config=None")
        num_samples = request_shape(params).num_samples
        seq_id = next(self._seq_ids)
        first = self._new_sample(seq_id, 0, params)
        structured = params.structured_outputs  # beam search too: each beam clones it
        if structured is not None:  # compiled (or taken from the cache) before anything changes
            first.grammar = self.grammars.new_state(structured)
        arrival = next(self._arrivals)
        queued = time.monotonic()
        arrival_time = queued if core_request.arrival_time is None else min(core_request.arrival_time, queued)
        request = Request(request_id, core_request.prompt_token_ids, params, core_request.priority, arrival, [first],
                          policy=policy, state=policy.start(params), num_samples=num_samples,
                          metrics=RequestMetrics(arrival_time, queued), queued_step=self.num_steps,
                          stream_tokens=core_request.stream_tokens)
        salt = None if core_request.cache_salt is None else core_request.cache_salt.encode("utf-8")
        if isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
            request.prompt_logprobs = {}
        with_rows = prompt_logprobs.wants(params, len(core_request.prompt_token_ids))
        if with_rows:  # a cached prefix computes no logits: this request reuses none
            salt = prompt_logprobs.unique_salt(arrival)
        with Rollback() as undo:
            try:
                self.scheduler.add_sequence(
                    seq_id,
                    np.asarray(core_request.prompt_token_ids, dtype=np.uint32),
                    priority=core_request.priority,
                    arrival=arrival,
                    max_tokens=min(params.max_tokens, self.max_model_len),
                    num_samples=num_samples,
                    cache_salt=salt,
                )
            except ValueError as exc:
                raise _pool_fit_error(exc, len(core_request.prompt_token_ids), self.args.block_size,
                                      self.scheduler.num_gpu_blocks) from exc
            undo(lambda: self.scheduler.finish(seq_id))
            self._requests[request_id] = request
            undo(lambda: self._requests.pop(request_id, None))
            self._by_seq[seq_id] = (request, first)
            self._unstarted[request_id] = request
            if with_rows:
                self.prompt_logprob_requests[request_id] = request

    def abort(self, request_id: str) -> Optional[CoreOutput]:
        """Ends a request now and frees its pages; its final output (None when it is not here)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self._unstarted.pop(request_id, None)
        self._end_request(request, "abort")
        if not self._requests:
            self._drain()
        return request.output(streams_tokens=True)

    def finish_sample(self, request_id: str, index: int, reason: str, stop_reason: Union[int, str, None]) -> None:
        """The front end ended sample ``index`` by a text rule (a stop string): its sequence is freed.
        Nothing when the request or the sample already ended."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for s in request.samples:
            if s.index == index and not s.finished:
                s.finish_reason, s.stop_reason = reason, stop_reason
                self.release(s.seq_id)
        if request.finished:
            request.metrics.finished_time = time.monotonic()
            del self._requests[request_id]
            self._unstarted.pop(request_id, None)
            if not self._requests:
                self._drain()

    def step(self) -> CoreOutputs:
        """Runs one scheduler step; an output for every request that progressed or ended
        (beam search: only once it finished). Pins whose TTL ran out are released first."""
        self.pins.expire()
        if not self._requests:
            self._drain()
            return CoreOutputs()
        if self._async is not None:
            ctx = self._async.step(time.monotonic())
        else:
            ctx = StepContext(start=time.monotonic())
            run_step(self, ctx)
        outputs = CoreOutputs(self._collect(ctx.touched, ctx.steady))
        if not self._requests:
            self._drain()
        self.kv_events.publish(self.scheduler)
        return outputs

    def _drain(self) -> None:
        """Asynchronous scheduling: the step in flight is waited for and reported once no
        request is left (an idle core has no step open and no page held)."""
        if self._async is not None and self._async.in_flight:
            self._async.drain()
            self.kv_events.publish(self.scheduler)  # what the drained step published, now rather than next step

    # ---- what the step calls ------------------------------------------------------------

    def _new_sample(self, seq_id: int, index: int, params: Union[SamplingParams, BeamSearchParams]) -> Sample:
        generator = None
        seed = getattr(params, "seed", None)  # BeamSearchParams has none
        if seed is not None:
            # Sample k of a seeded request uses seed + k, wrapped into the generator's 64 bits.
            generator = torch.Generator(device=self.device).manual_seed(generator_seed((seed + index) % 2**64,
                                                                                      self.device))
        return Sample(seq_id=seq_id, index=index, generator=generator)

    @property
    def has_grammars(self) -> bool:
        """A structured request was ever added (only then may a sample hold a grammar state)."""
        return self._grammars is not None

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of structured outputs' grammars for this model's tokenizer (and its LRU)."""
        if self._grammars is None:
            self._grammars = make_compiler(self._grammar_backend, self.loaded.tokenizer.hf,
                                           self.loaded.config.vocab_size, self.eos_token_ids)
        return self._grammars

    def sample_factory(self, request: Request) -> Callable[[int], Sample]:
        """``new_sample(index)`` for the request's policy: a sample with a fresh sequence id,
        not yet in the scheduler (``fork`` puts it there)."""
        return lambda index: self._new_sample(next(self._seq_ids), index, request.params)

    def fork(self, request: Request, parent: Sample, child: Sample) -> None:
        if parent.grammar is not None and child.grammar is None:  # a child that drew nothing yet
            child.grammar = parent.grammar.clone()
        with Rollback() as undo:
            self.scheduler.fork(parent.seq_id, child.seq_id)
            undo(lambda: self.scheduler.finish(child.seq_id))
            self._by_seq[child.seq_id] = (request, child)

    def release(self, seq_id: int) -> None:
        entry = self._by_seq.pop(seq_id, None)
        self.fast_rows.forget(seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq_id)
        if entry is not None:
            entry[1].grammar = None  # its matcher goes with its sequence
            if self.scheduler.contains(seq_id):
                self.scheduler.finish(seq_id)

    def fail(self, request: Request, exc: BaseException, touched: dict[str, Request]) -> None:
        """Ends one request with finish_reason "error"; the engine and other requests go on."""
        if request.error is None:
            request.error, request.error_by_request = error_text(exc)
            request.error_param = error_param(exc)
        self._end_request(request, "error")
        touched[request.request_id] = request

    def fail_all(self, exc: BaseException, touched: dict[str, Request]) -> None:
        for request in list(self._requests.values()):
            self.fail(request, exc, touched)
        self._collect(touched, CoreTokenRows())

    def _end_request(self, request: Request, reason: str) -> None:
        for s in request.samples:
            if not s.finished:
                s.finish_reason = reason
            self.release(s.seq_id)
        request.ended = request.ended or reason
        request.metrics.finished_time = time.monotonic()

    def note_scheduled(self, step: StepInput, start: float) -> None:
        """Queue and prefill bookkeeping of the requests still waiting for their first token
        (vLLM's first_scheduled_time): the step that starts at ``start`` runs them."""
        self.num_steps += 1
        self.peak_running = max(self.peak_running, self.scheduler.num_running)
        if not self._unstarted:  # a steady decode step: nothing to note, no loop over the batch
            return
        seen: set[str] = set()
        for row, seq_id in enumerate(step.seq_ids.tolist()):
            entry = self._by_seq.get(seq_id)
            if entry is None or entry[0].metrics.first_token_time is not None or entry[0].request_id in seen:
                continue
            request = entry[0]
            metrics = request.metrics
            seen.add(request.request_id)
            if request.recount_cached:  # re-admitted after a reset: its step starts where this admission's hits end
                recount_cached_tokens(self.scheduler, request, seq_id, int(step.positions[step.query_start_loc[row]]))
            elif request.num_cached_tokens is None:
                request.num_cached_tokens = self.scheduler.num_cached_tokens_of(seq_id)
                request.cached_tokens_by_tier = cached_tokens_by_tier(self.scheduler, seq_id)
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = start
                metrics.num_steps_queued = self.num_steps - 1 - request.queued_step
            metrics.num_prefill_steps += 1

    def _collect(self, touched: dict[str, Request], steady: CoreTokenRows) -> list[CoreOutputItem]:
        """The step's outputs: its steady rows in columns first (a request that also failed later in the
        step follows with its own output), then one per other request that progressed or ended."""
        outputs: list[CoreOutputItem] = [steady] if steady.request_ids else []
        for request in touched.values():
            # a request the front end reads only at its end: nothing goes out until then
            out = request.output(request.policy.streams_tokens) if request.stream_tokens or request.finished else None
            if out is not None:
                outputs.append(out)
            finished = out.finished if out is not None else request.finished
            if finished:
                self._requests.pop(request.request_id, None)
            if self._unstarted and (finished or request.metrics.first_token_time is not None):
                self._unstarted.pop(request.request_id, None)
        return outputs

    # ---- reporting and lifecycle ----------------------------------------------------------

    def stats(self) -> EngineStats:
        """The core's stats now (core_stats.py)."""
        return core_stats(self)

    def shutdown(self) -> None:
        """Aborts what is left, flushes the cached KV pages to the disk tier (when on), and
        releases the executor (its disk store closed, tensor-parallel workers exited). Once."""
        for request_id in list(self._requests):
            self.abort(request_id)
        self._drain()
        self.pins.release_all()  # their pages go back before the cached ones flush to disk
        if isinstance(self.executor, AsyncExecution):
            self.executor.stop()  # its worker first; the closer shuts the wrapped executor down
        self._closer()

    def check_invariants(self) -> None:
        """The scheduler's invariants plus the core's: every live sample's sequence is in the scheduler."""
        self.scheduler.check_invariants()
        for seq_id, (request, s) in self._by_seq.items():
            if not self.scheduler.contains(seq_id):
                raise AssertionError(f"request {request.request_id!r} sample {s.index}: sequence {seq_id} is not in the core")
            if request.request_id not in self._requests:
                raise AssertionError(f"sequence {seq_id} belongs to finished request {request.request_id!r}")

    def info(self) -> dict[str, Any]:
        """What a front end needs to know about the core it talks to."""
        return {"max_model_len": self.max_model_len, "model_name": self.loaded.name}
