"""The engine: requests in, incremental outputs out, one scheduler step at a time.

    add_request ──► InputProcessor ──► Scheduler (Rust) ──► StepInput ──► Executor ──► logits
                                          ▲                                              │
                                          └── fork / append / finish ◄── policy ◄── sample ┘

How a step flows: the core plans (which sequences run, their pages, the tier transfers
and copy-on-write copies); the executor runs the transfers, the copies and the forward
pass and reports the transfers done; the engine draws tokens for the rows whose policy
asks for draws, and each request's continuation policy (chosen by its params' type:
independent samples or beam search) turns its rows into a decision — continuations,
forked or in place, and sequences to free — which the engine carries out on the core:
frees no fork needs, forks, one batched append, the other frees. Beam search waits
until every live beam of a request has its row (preemption may run them in different
steps); the policy keeps the rows meanwhile. The engine never decides about memory.

Hardening rule: everything that can reject a request is checked on plain values first
(``InputProcessor``, object construction), the core is touched last, and a failure after
that rolls back (``Rollback``). A failure inside a step is pinned on the request that
caused it where that is possible (a sampling row, a fork, a detokenizer); only a failed
forward pass ends every request that was in it.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch

from pagedrs._core import Scheduler, SchedulerConfig
from pagedrs.attention import AttentionBackend
from pagedrs.beam_search import BeamSearchParams
from pagedrs.continuation import BeamSearch, ContinuationPolicy, Decision, IndependentSamples, StepRow
from pagedrs.engine_args import EngineArgs
from pagedrs.errors import EngineDeadError
from pagedrs.executor import LocalExecutor, make_executor, plan_tiers
from pagedrs.inputs import InputProcessor, PromptType
from pagedrs.kv_tiers.errors import CorruptPageError
from pagedrs.models.config import ModelConfig
from pagedrs.outputs import RequestOutput
from pagedrs.request import Request, Sample
from pagedrs.rollback import Rollback
from pagedrs.sampling import SampleResult, SamplingRow, sample
from pagedrs.sampling_params import SamplingParams
from pagedrs.stats import EngineStats
from pagedrs.step_input import StepInput, Transfer
from pagedrs.tokenizer import IncrementalDetokenizer

__all__ = ["Engine", "PromptType"]

logger = logging.getLogger("pagedrs.engine")


class Engine:
    def __init__(
        self, args: Optional[EngineArgs] = None, *, attention_backend: AttentionBackend | None = None, **kwargs: Any
    ) -> None:
        args = args if args is not None else EngineArgs(**kwargs)
        self.args = args
        torch.manual_seed(args.seed)
        self.device = torch.device(args.device)
        self.executor = make_executor(args, attention_backend=attention_backend)
        # What the executor holds (tensor-parallel workers and the process group, a disk store)
        # is released on shutdown(), on garbage collection or at interpreter exit, whichever
        # comes first. The finalizer holds the executor, never the engine.
        self._closer = weakref.finalize(self, self.executor.shutdown)
        self.loaded = self.executor.loaded
        self.tokenizer = self.loaded.tokenizer
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids)
        self.model_name = self.loaded.name
        config = self.loaded.config
        self.max_model_len = args.max_model_len or config.max_position_embeddings
        self.kv_plan = self.executor.plan_kv_memory()
        plan = self.kv_plan
        tiers = plan_tiers(self.executor, args, plan)
        self.num_host_cache_blocks = tiers.host_cache_blocks
        self.scheduler_config = SchedulerConfig(
            num_gpu_blocks=plan.num_gpu_blocks,
            block_size=args.block_size,
            num_cpu_blocks=plan.num_cpu_blocks + tiers.host_cache_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_layout=args.kv_layout,
            contiguous_reserve=args.contiguous_reserve,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            preemption_mode=args.preemption_mode,
            watermark=args.watermark,
            aging_steps=args.aging_steps,
            admission_policy=args.admission_policy,
            prefill_first=args.prefill_first,
            swap_cost_per_block=plan.swap_cost_per_block,
            recompute_cost_per_token=plan.recompute_cost_per_token,
            host_cache_evicted=args.host_cache_evicted or tiers.host_cache_blocks > 0,
            num_disk_blocks=tiers.disk_blocks,
            sliding_window=_uniform_sliding_window(config) if args.kv_layout == "paged" else None,
        )
        self.scheduler = Scheduler(self.scheduler_config)
        if tiers.seed is not None:
            seed = tiers.seed
            self.scheduler.seed_disk(seed.slots, seed.hashes, seed.parents, seed.tokens, seed.invalidated)
            assert isinstance(self.executor, LocalExecutor)  # plan_tiers opens a store for no other
            self.executor.set_page_meta(self.scheduler.disk_pages)
            # A clean shutdown also flushes the cached pages to disk first.
            self._closer.detach()
            self._closer = weakref.finalize(self, _flush_and_close, self.scheduler, self.executor)
        # The layout's rules decide the host pool (none for the contiguous baseline).
        self.executor.init_kv_cache(self.scheduler_config.num_gpu_blocks, self.scheduler_config.num_cpu_blocks)
        self.inputs = InputProcessor(self.tokenizer, config.vocab_size, self.max_model_len, args.max_n)
        # The request's params type chooses its continuation policy.
        self.policies: dict[type, ContinuationPolicy] = {
            SamplingParams: IndependentSamples(self.tokenizer, self.max_model_len),
            BeamSearchParams: BeamSearch(self.tokenizer, self.max_model_len),
        }
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, tuple[Request, Sample]] = {}
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._num_generated = 0
        self._peak_running = 0
        self._num_steps = 0  # steps run (the requests' queue and prefill step counts use it)

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
        salt = _cache_salt_bytes(cache_salt)
        if arrival_time is not None and (
            isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)) or not math.isfinite(arrival_time)
        ):  # a NaN would poison the latency histograms' sums for the server's lifetime
            raise ValueError(f"arrival_time is {arrival_time!r}; it must be a finite time.monotonic() value or None")
        processed = self.inputs.process(request_id, prompt, params, priority)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already exists; request ids must be unique among unfinished requests")
        params = processed.params
        policy = self.policies[type(params)]
        num_samples = policy.num_samples(params)
        seq_id = next(self._seq_ids)
        first = self._new_sample(seq_id, 0, processed.prompt_token_ids, params)
        arrival = next(self._arrivals)
        request = Request(request_id, processed.prompt, processed.prompt_token_ids, params, processed.priority,
                          arrival, [first], policy=policy, num_samples=num_samples,
                          num_outputs=policy.num_outputs(params), streams=policy.streams(params),
                          queued_step=self._num_steps)
        if arrival_time is not None:
            request.arrival_time = min(arrival_time, request.queued_time)
        with Rollback() as undo:
            self.scheduler.add_sequence(
                seq_id,
                np.asarray(processed.prompt_token_ids, dtype=np.uint32),
                priority=processed.priority,
                arrival=arrival,
                max_tokens=min(params.max_tokens, self.max_model_len),
                num_samples=num_samples,
                cache_salt=salt,
            )
            undo(lambda: self.scheduler.finish(seq_id))
            self._requests[request_id] = request
            undo(lambda: self._requests.pop(request_id, None))
            self._by_seq[seq_id] = (request, first)

    def _new_sample(self, seq_id: int, index: int, prompt_ids: list[int], params: Any) -> Sample:
        generator = None
        seed = getattr(params, "seed", None)
        if seed is not None:
            # Sample k of a seeded request uses seed + k, wrapped into the generator's 64 bits.
            generator = torch.Generator(device=self.device).manual_seed((seed + index) % 2**64)
        skip = getattr(params, "skip_special_tokens", True)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=skip)
        return Sample(seq_id=seq_id, index=index, detokenizer=detok, generator=generator)

    def _sample_factory(self, request: Request) -> Callable[[int], Sample]:
        """``new_sample(index)`` for the request's policy: a sample with a fresh sequence id,
        not yet in the core (``_fork`` puts it there)."""
        return lambda index: self._new_sample(next(self._seq_ids), index, request.prompt_token_ids, request.params)

    def abort(self, request_id: str) -> bool:
        """Ends a request now and frees its pages; its final output comes with the next step."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._end_request(request, "abort")
        self._pending_outputs.append(request.to_output())
        return True

    def _end_request(self, request: Request, reason: str) -> None:
        for s in request.samples:
            if not s.finished:
                s.finish_reason = reason
            self._release(s.seq_id)
        while len(request.samples) < request.num_samples:  # samples never forked
            request.samples.append(
                Sample(seq_id=-1, index=len(request.samples), detokenizer=request.samples[0].detokenizer,
                       generator=None, finish_reason=reason)
            )
        request.finished_time = time.monotonic()

    def _release(self, seq_id: int) -> None:
        if self._by_seq.pop(seq_id, None) is not None and self.scheduler.contains(seq_id):
            self.scheduler.finish(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs)

    def num_unfinished(self) -> int:
        return len(self._requests)

    # ---- one step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns an output for every request that progressed
        (a beam search, or ``best_of > n``, only once it finished: see ``Request.streams``)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self._requests:
            return outputs
        start = time.monotonic()
        touched: dict[str, Request] = {}
        try:
            plan = self.scheduler.schedule()
        except RuntimeError as exc:  # planning failed part-way: the core is in no known state
            dead = EngineDeadError(f"the scheduler failed while it planned a step: {exc}")
            self._fail_all(dead, touched)
            raise dead from exc
        step = StepInput.from_plan(plan)
        self._note_scheduled(step, start)
        self._peak_running = max(self._peak_running, self.scheduler.num_running)
        try:
            logits = self.executor.execute(step)
        except Exception as exc:  # noqa: BLE001 - a failed step ends its requests, not the engine
            self._on_failed_step(step, exc, touched)
            if getattr(exc, "fatal", False):  # the executor is gone for good: end everything, then say so
                self._fail_all(exc, touched)
                raise
            return outputs + self._collect(touched)
        except BaseException:  # KeyboardInterrupt, SystemExit mid-step: the step did not complete
            # Reported failed, so that the next schedule() cannot report it done; its sequences
            # are recomputed when the caller steps again.
            self.scheduler.complete_transfers(self.executor.take_completed_transfers())
            self.scheduler.complete_step(step.step_id, False)
            raise
        self.scheduler.complete_transfers(self.executor.take_completed_transfers())
        self.scheduler.complete_step(step.step_id, True)  # what it wrote becomes a prefix hit
        self._drop_failed_disk_writes()
        rows = self._rows(step)
        draws = self._draws(rows, touched)
        results = self._sample_attributed(logits, draws, touched) if draws else []
        self._carry_out(self._decide(rows, logits, draws, results, touched), touched)
        return outputs + self._collect(touched)

    def _on_failed_step(self, step: StepInput, exc: BaseException, touched: dict[str, Request]) -> None:
        """Nothing a failed step wrote is ever served: the core forgets it on every tier
        and resets the step's sequences (and any whose pages it left unwritten) to be
        recomputed. A lost disk page (a checksum failure) is the tier's fault, not the
        request's: its slots leave the disk index and the sequences are simply recomputed.
        Any other failure ends the requests that were in the step."""
        self.scheduler.complete_transfers(self.executor.take_completed_transfers())
        lost_pages = isinstance(exc, CorruptPageError)
        if lost_pages:
            dropped = self.scheduler.invalidate_disk_slots(exc.slots)
            logger.warning("a step read %d disk page(s) that failed their checksum (%d dropped from the tier); "
                           "recomputing its %d sequences: %s", len(exc.slots), dropped, step.num_seqs, exc)
        reset = self.scheduler.complete_step(step.step_id, False)
        self._drop_failed_disk_writes()
        if lost_pages:
            return
        logger.error("the forward pass failed; ending the %d requests in it", step.num_seqs, exc_info=exc)
        for seq_id in step.seq_ids.tolist():
            if seq_id in self._by_seq:
                self._fail(self._by_seq[seq_id][0], exc, touched)
        if len(reset) > step.num_seqs:
            logger.warning("the failed step also lost pages of %d paused sequences; they are recomputed",
                           len(reset) - step.num_seqs)

    def _drop_failed_disk_writes(self) -> None:
        """Disk writes that failed after they were queued (a full disk): their slots leave
        the core's index, so the pages are lost, never read back wrong."""
        failed = self.executor.take_failed_disk_slots()
        if failed:
            self.scheduler.invalidate_disk_slots(failed)

    def _fail_all(self, exc: BaseException, touched: dict[str, Request]) -> None:
        for request in list(self._requests.values()):
            self._fail(request, exc, touched)
        self._collect(touched)

    def _note_scheduled(self, step: StepInput, start: float) -> None:
        """Queue and prefill bookkeeping of the requests still waiting for their first token
        (vLLM's first_scheduled_time): the step that starts at ``start`` runs them."""
        self._num_steps += 1
        seen: set[str] = set()
        for seq_id in step.seq_ids.tolist():
            entry = self._by_seq.get(seq_id)
            if entry is None or entry[0].first_token_time is not None or entry[0].request_id in seen:
                continue
            request = entry[0]
            seen.add(request.request_id)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = self.scheduler.num_cached_tokens_of(seq_id)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
                request.num_steps_queued = self._num_steps - 1 - request.queued_step
            request.num_prefill_steps += 1

    def _rows(self, step: StepInput) -> dict[str, tuple[Request, list[tuple[int, Sample]]]]:
        """The step's sampling rows, by request: (logits row, sample)."""
        rows: dict[str, tuple[Request, list[tuple[int, Sample]]]] = {}
        for row, (seq_id, sampled) in enumerate(zip(step.seq_ids.tolist(), step.do_sample.tolist())):
            if sampled and seq_id in self._by_seq:
                request, state = self._by_seq[seq_id]
                rows.setdefault(request.request_id, (request, []))[1].append((row, state))
        return rows

    def _draws(
        self, rows: dict[str, tuple[Request, list[tuple[int, Sample]]]], touched: dict[str, Request]
    ) -> list[tuple[int, Request, Sample]]:
        """(logits row, request, sample) for every token the sampler draws."""
        draws: list[tuple[int, Request, Sample]] = []
        for request, request_rows in rows.values():
            new_sample = self._sample_factory(request)
            for row, state in request_rows:
                try:
                    samples = request.policy.draws(request, state, new_sample)
                except Exception as exc:  # noqa: BLE001
                    self._fail(request, exc, touched)
                    break
                draws.extend((row, request, s) for s in samples)
        return draws

    def _decide(
        self,
        rows: dict[str, tuple[Request, list[tuple[int, Sample]]]],
        logits: torch.Tensor,
        draws: list[tuple[int, Request, Sample]],
        results: list[Optional[SampleResult]],
        touched: dict[str, Request],
    ) -> list[tuple[Request, Decision]]:
        """Each request's policy turns its rows (and the tokens drawn from them) into a decision."""
        drawn: dict[int, list[tuple[Sample, SampleResult]]] = {}
        for (row, _, s), result in zip(draws, results):
            if result is not None:
                drawn.setdefault(row, []).append((s, result))
        decisions = []
        for request, request_rows in rows.values():
            touched[request.request_id] = request
            if request.error is not None:
                continue  # this request already failed in this step
            step_rows = [StepRow(s, logits[row], drawn.get(row, [])) for row, s in request_rows]
            try:
                decision = request.policy.on_step(request, step_rows, self._sample_factory(request))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not take the engine down
                self._fail(request, exc, touched)
                continue
            if decision is not None:
                decisions.append((request, decision))
        return decisions

    def _fork(self, request: Request, parent: Sample, child: Sample) -> None:
        with Rollback() as undo:
            self.scheduler.fork(parent.seq_id, child.seq_id)
            undo(lambda: self.scheduler.finish(child.seq_id))
            self._by_seq[child.seq_id] = (request, child)

    def _sample_attributed(
        self, logits: torch.Tensor, draws: list[tuple[int, Request, Sample]], touched: dict[str, Request]
    ) -> list[Optional[SampleResult]]:
        """Draws in chunks no larger than a step's batch; a chunk that fails is redrawn row
        by row, so that only the request whose row fails is ended (result None)."""
        chunk = max(1, self.args.max_num_seqs)
        results: list[Optional[SampleResult]] = []
        for start in range(0, len(draws), chunk):
            part = draws[start : start + chunk]
            rows = [self._sampling_row(request, s) for _, request, s in part]
            index = [row for row, _, _ in part]
            # every row once, in order (a step without n > 1 or beams): the logits themselves, not an
            # indexed copy (18 us at batch 1, a 6 MB copy at 32; sample() never writes into them)
            part_logits = logits if index == list(range(logits.shape[0])) else logits[index]
            try:
                results.extend(sample(part_logits, rows))
                continue
            except Exception:  # noqa: BLE001 - find the row(s) that fail
                pass
            for (row, request, _), srow in zip(part, rows):
                try:
                    results.extend(sample(logits[[row]], [srow]))
                except Exception as exc:  # noqa: BLE001
                    self._fail(request, exc, touched)
                    results.append(None)
        return results

    def _sampling_row(self, request: Request, s: Sample) -> SamplingRow:
        return SamplingRow(request.params, s.generator, request.prompt_token_ids, s.token_ids, self._eos_ids)

    def _carry_out(self, decisions: list[tuple[Request, Decision]], touched: dict[str, Request]) -> None:
        """Frees of sequences no fork reads, then the forks (a parent that goes on more than
        once is forked before any append), then one batched append, then the other frees.
        Freeing early lets a pruned beam's pages serve this step's copies-on-write."""
        now = time.monotonic()
        appends: list[tuple[Request, Sample, int]] = []
        for request, decision in decisions:
            if request.first_token_time is None:
                request.first_token_time = now
            self._num_generated += decision.num_tokens
            parents = {c.parent.seq_id for c in decision.continuations if c.sample is not c.parent}
            for s in decision.finished:
                if s.seq_id not in parents:
                    self._release(s.seq_id)
            try:
                for c in decision.continuations:
                    if c.sample is not c.parent:
                        self._fork(request, c.parent, c.sample)
            except Exception as exc:  # noqa: BLE001 - e.g. the contiguous layout has no room for a child
                self._fail(request, exc, touched)
            appends.extend((request, c.sample, c.token_id) for c in decision.continuations)
        appends = [a for a in appends if a[0].error is None]
        if appends:
            self._append(appends, touched)
        for request, decision in decisions:
            for s in decision.finished:  # also after a failure: a policy may have dropped them from samples
                self._release(s.seq_id)
            if request.finished and request.finished_time is None:
                request.finished_time = now

    def _append(self, appends: list[tuple[Request, Sample, int]], touched: dict[str, Request]) -> None:
        ids = np.asarray([s.seq_id for _, s, _ in appends], dtype=np.uint64)
        tokens = np.asarray([t for _, _, t in appends], dtype=np.uint32)
        try:
            self.scheduler.append_tokens(ids, tokens)  # all or nothing
        except Exception:  # noqa: BLE001 - find the sequence(s) the core refuses
            for request, s, token in appends:
                if request.error is not None:
                    continue
                try:
                    self.scheduler.append_tokens(np.asarray([s.seq_id], dtype=np.uint64),
                                                 np.asarray([token], dtype=np.uint32))
                except Exception as exc:  # noqa: BLE001
                    self._fail(request, exc, touched)

    def _fail(self, request: Request, exc: BaseException, touched: dict[str, Request]) -> None:
        """Ends one request with finish_reason "error"; the engine and other requests go on."""
        if request.error is None:
            request.error = f"{type(exc).__name__}: {exc}"
        self._end_request(request, "error")
        touched[request.request_id] = request

    def _collect(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            if request.streams or request.finished:  # beam search, best_of > n: the final output only
                outputs.append(request.to_output())
            if request.finished:
                self._requests.pop(request.request_id, None)
        return outputs

    # ---- reporting ------------------------------------------------------------------

    def typed_stats(self) -> EngineStats:
        return EngineStats.build(
            self.scheduler.stats(),
            num_cpu_blocks=self.scheduler_config.num_cpu_blocks,
            kv_layout=self.args.kv_layout,
            block_size=self.args.block_size,
            num_generated_tokens=self._num_generated,
            peak_running=self._peak_running,
            kv_bytes_per_block=self.kv_plan.bytes_per_block,
            num_host_cache_blocks=self.num_host_cache_blocks,
            num_unfinished_requests=len(self._requests),
            **self._memory_stats(),
        )

    def _memory_stats(self) -> dict[str, int]:
        memory = self.executor.memory_bytes()
        return {
            "memory_weights_bytes": memory["weights"],
            "memory_kv_pool_bytes": memory["kv_pool"],
            "memory_host_pool_bytes": memory["host_pool"],
            "memory_rss_bytes": _rss_bytes(),
        }

    def stats(self) -> dict[str, Any]:
        """``typed_stats()`` as a dict (the engine contract's string keys)."""
        return self.typed_stats().as_dict()

    def shutdown(self) -> None:
        """Aborts what is left, flushes the cached KV pages to the disk tier (when on), and
        releases the executor (its disk store closed, tensor-parallel workers exited)."""
        for request_id in list(self._requests):
            self.abort(request_id)
        self._pending_outputs.clear()
        self._closer()  # once: a second shutdown() (or the collection after it) does nothing

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def check_invariants(self) -> None:
        """The core's invariants plus the engine's: every live sample's sequence is in the core."""
        self.scheduler.check_invariants()
        for seq_id, (request, s) in self._by_seq.items():
            if not self.scheduler.contains(seq_id):
                raise AssertionError(f"request {request.request_id!r} sample {s.index}: sequence {seq_id} is not in the core")
            if request.request_id not in self._requests:
                raise AssertionError(f"sequence {seq_id} belongs to finished request {request.request_id!r}")


def _flush_and_close(scheduler: Scheduler, executor: LocalExecutor) -> None:
    """Clean shutdown of the disk tier: every cached page the disk lacks goes to it, then
    the store is made durable and closed. Takes no engine, so it can run at collection."""
    try:
        transfers = [Transfer(int(i), str(s), str(d), p) for i, s, d, p in scheduler.flush_to_disk()]
        executor.run_transfers(transfers)
        scheduler.complete_transfers([t.id for t in transfers])
    finally:
        executor.shutdown()


MAX_CACHE_SALT_BYTES = 256


def _cache_salt_bytes(cache_salt: object) -> Optional[bytes]:
    """The salt as the core takes it; ValueError naming ``cache_salt`` when it is not a
    string of 1 to 256 UTF-8 bytes."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt is {cache_salt!r} ({type(cache_salt).__name__}); it must be a string or None")
    try:
        raw = cache_salt.encode("utf-8", errors="strict")
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise ValueError(f"cache_salt is not valid UTF-8 text ({exc.reason} at index {exc.start})") from None
    if not 1 <= len(raw) <= MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache_salt is {len(raw)} UTF-8 bytes; it must be 1 to {MAX_CACHE_SALT_BYTES}")
    return raw


def _uniform_sliding_window(config: ModelConfig) -> int | None:
    """The window the core may release pages outside of: only when every layer attends with
    it. A model mixing full and windowed layers (Gemma 2, Qwen2's max_window_layers) keeps
    every page, since its full layers read them all."""
    windows = {config.layer_sliding_window(layer) for layer in range(config.num_hidden_layers)}
    return windows.pop() if len(windows) == 1 else None


def _rss_bytes() -> int:
    """Resident set size of this process from /proc/self/statm (0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
