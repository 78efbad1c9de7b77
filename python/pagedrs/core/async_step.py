"""Asynchronous scheduling (``EngineArgs.async_scheduling``, vLLM's ``async_scheduling``): the
core plans and launches step N+1 before it samples step N, so the device never waits for the host.

    step() k:   plan N+1 ─ launch N+1 ─┐ wait N ─ sample N ─► tokens(N) ─ decide N ─ outputs N
    worker:      ... forward N ────────┘              └─► fill N+1's placeholders ─ forward N+1 ...

A sequence of step N that goes on in place (one sample, or a sample already forked) gets a
placeholder token in the scheduler before N+1 is planned (``Scheduler.append_placeholders``),
so N+1 computes its next position; the worker fills the placeholder input ids from step N's
tokens once they are drawn, and the scheduler gets the token (``resolve_placeholders``), which
is when the blocks it completes are hashed (a block with a placeholder is never a prefix hit).
Today's rule in ``schedule.rs`` that a step runs before the next ``schedule`` becomes: at most two
steps in flight (``set_max_steps_in_flight(2)``), reported in order, a failed one failing the
one after it as well.

What stays exact:
- a sequence that ends at step N (EOS, a stop token or string, an abort) had at most one extra
  row planned in N+1: its row is dropped there (the sequence is gone when N+1 is sampled), its
  pages freed; its placeholder's K/V, written by N+1, is in pages nobody reads;
- one that ends by length at N gets no placeholder (known in advance);
- preemption: a waiting sequence with a placeholder is not admitted until the token is known;
- a failed step N fails N+1 too (``complete_step``), its placeholders are dropped and N+1's job
  never runs (it waits for N's tokens, which then never come);
- seeded sampling draws the same tokens (each sample has its own generator); unseeded sampling
  draws from the global generator in the same order per step.

Synchronous still (they sit out the next step instead of taking a placeholder, and join the one
after): beam search (its beams change places by the decision), a request's first token when
``n``/``best_of`` > 1 (the fork happens at the decision). Structured outputs do run ahead: a
grammar's mask is computed when its row is sampled, after the previous token was consumed.

The disk tier: step N's copies to disk run on the worker while N+1 is planned, so each carries
its slots' meta from when the core handed it out (``step_input.Transfer.meta``), and its slots
stay pinned in the core until the copy is reported done. Tensor parallelism: the worker drives
the ranks (the step's broadcast, rank 0's forward). Not supported yet (refused by
``EngineArgs``): speculative decoding.

The executor side is ``executor/async_execution.py``: one worker thread, steps in order.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from pagedrs.core.continuation import IndependentSamples
from pagedrs.core.protocol import EngineDeadError, is_engine_fatal
from pagedrs.core.request import SamplesState
from pagedrs.core.step import StepContext, finish_step, on_failed_step, plan_step
from pagedrs.executor.token_fill import DrawnTokens

if TYPE_CHECKING:
    from pagedrs.core.engine_core import EngineCore
    from pagedrs.executor.async_execution import AsyncExecution

StepTokens = Future  # Future[DrawnTokens]: a step's drawn tokens (what the next step's placeholders wait for)


@dataclass
class InFlight:
    """A launched step: its context, its logits to come, and its tokens once drawn."""

    ctx: StepContext
    logits: Future  # Future[torch.Tensor]
    tokens: StepTokens = field(default_factory=Future)
    placeholders: frozenset[int] = frozenset()  # its sequences given a placeholder for the token it draws


class AsyncScheduler:
    """Two steps in flight over an ``AsyncExecution``; ``step`` returns the older one's outputs."""

    def __init__(self, core: EngineCore, execution: AsyncExecution) -> None:
        self._core = core
        self._execution = execution
        self._in_flight: Optional[InFlight] = None
        core.scheduler.set_max_steps_in_flight(2)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def step(self, ctx_start: float) -> StepContext:
        """Launches the next step, then finishes the one before it; that one's context (its
        touched requests) comes back. The first call launches two."""
        core = self._core
        current = self._in_flight
        if current is None:
            current = self._launch(StepContext(start=ctx_start), after=None)
        current.placeholders = self._give_placeholders(current)
        self._in_flight = None
        try:
            self._in_flight = self._launch(StepContext(start=time.monotonic()), after=current)
        except BaseException:  # planning failed (the engine is dead): let the current step settle first
            self._settle(current)
            raise
        self._finish(current)
        if not core.has_unfinished():
            self.drain()
        return current.ctx

    def drain(self) -> None:
        """Waits for the step in flight and reports it (nothing left to sample from it: its
        requests ended meanwhile); the scheduler has no step open afterwards."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            self._report(pending, ok=None)

    # ---- the parts ---------------------------------------------------------------------

    def _launch(self, ctx: StepContext, after: Optional[InFlight]) -> InFlight:
        step = plan_step(self._core, ctx)
        return InFlight(ctx, self._execution.launch(step, None if after is None else after.tokens))

    def _give_placeholders(self, current: InFlight) -> frozenset[int]:
        """The sequences of ``current`` that go on in place with the token it draws."""
        core = self._core
        step = current.ctx.step
        assert step is not None
        ids = []
        for seq_id, sampled in zip(step.seq_ids.tolist(), step.do_sample.tolist()):
            entry = core.sequence(seq_id) if sampled else None
            if entry is None:
                continue
            request, sample = entry
            if not isinstance(request.policy, IndependentSamples) or sample.finished:
                continue
            state = request.state
            if request.num_samples > 1 and not (isinstance(state, SamplesState) and state.forked):
                continue  # its first token forks the others: at the decision
            rule = request.token_rule(core.eos_token_ids, core.max_model_len)
            if len(sample.token_ids) + 1 >= rule.limit:
                continue  # ends by length with this token: known now
            ids.append(seq_id)
        if not ids:
            return frozenset()
        try:
            core.scheduler.append_placeholders(np.asarray(ids, dtype=np.uint64))
        except ValueError:
            return frozenset()  # e.g. at max_model_len: these wait for their tokens as usual
        return frozenset(ids)

    def _finish(self, current: InFlight) -> None:
        core, ctx = self._core, current.ctx
        step = ctx.step
        assert step is not None
        try:
            ctx.logits = current.logits.result()
        except Exception as exc:  # noqa: BLE001 - a failed step ends its requests, not the engine
            self._failed(current, exc)
            if is_engine_fatal(exc):
                core.fail_all(exc, ctx.touched)
                raise
            return
        except BaseException:  # KeyboardInterrupt mid-wait: both steps are given back, recomputed later
            self._failed(current, None)
            raise
        if not current.placeholders:
            current.tokens.set_result(DrawnTokens())  # the next step reads none of this one's tokens: it may run now
        try:
            finish_step(core, ctx, current.placeholders, current.tokens.set_result)
        except BaseException as exc:
            if step.step_id in core.scheduler.open_steps():  # drawing failed or was interrupted: never committed,
                self._failed(current, None)  # so this step and the one after it go back, computed again
                raise
            published = current.tokens.done() and not current.tokens.cancelled() and current.tokens.exception() is None
            if published and isinstance(exc, Exception):
                self._dead_after_publication(current, exc)
            raise
        finally:
            if not current.tokens.done():  # finish_step failed before the tokens: the next step must not run
                current.tokens.set_exception(EngineDeadError("the step before this one did not finish"))

    def _dead_after_publication(self, current: InFlight, exc: Exception) -> None:
        """``finish_step`` failed after the step was committed and its tokens published: the next
        step runs (or ran) on tokens the core took only in part, so no request can go on exactly.
        The next step is waited for and reported failed, every request ends with the error, and the
        engine says it is dead."""
        following, self._in_flight = self._in_flight, None
        if following is not None:
            self._report(following, ok=False)
        dead = EngineDeadError(f"a step failed after the next one was launched on its tokens: {exc!r}")
        self._core.fail_all(dead, current.ctx.touched)
        raise dead from exc

    def _failed(self, current: InFlight, exc: Optional[BaseException]) -> None:
        """Step N failed: N+1 (launched, waiting for N's tokens) never runs, both are reported
        failed, the placeholders go, and N's requests end (``exc``) or are recomputed (None)."""
        core, ctx = self._core, current.ctx
        step = ctx.step
        assert step is not None
        if not current.tokens.done():  # (published already: the next step ran on them, and fails below all the same)
            current.tokens.set_exception(exc if exc is not None else EngineDeadError("the previous step was interrupted"))
        following, self._in_flight = self._in_flight, None
        if following is not None:
            try:
                following.logits.result()  # it raises at once: it waited for the tokens that never came
            except BaseException:  # noqa: BLE001, S110 - expected
                pass
        if exc is None:
            core.scheduler.complete_transfers(self._execution.take_completed_transfers())
            core.note_reset(core.scheduler.complete_step(step.step_id, False))
        else:
            on_failed_step(core, step, exc, ctx.touched)
        if current.placeholders:
            core.scheduler.drop_placeholders(np.asarray(sorted(current.placeholders), dtype=np.uint64))

    def _settle(self, current: InFlight) -> None:
        """The engine is going down (a failed plan): wait for the launched step, report it failed."""
        self._report(current, ok=False)

    def _report(self, pending: InFlight, ok: Optional[bool]) -> None:
        """Waits for a launched step whose rows nobody samples and reports it, if still open:
        ``ok``, or (None) whether it ran. Its tokens never come (its successor, if any, does not run)."""
        pending.tokens.cancel()
        try:
            pending.logits.result()
            ran = True
        except BaseException:  # noqa: BLE001 - its failure ends no request: none is left in it
            ran = False
        scheduler = self._core.scheduler
        scheduler.complete_transfers(self._execution.take_completed_transfers())
        assert pending.ctx.step is not None
        if pending.ctx.step.step_id in scheduler.open_steps():
            self._core.note_reset(scheduler.complete_step(pending.ctx.step.step_id, ran if ok is None else ok))
