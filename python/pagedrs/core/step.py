"""One engine-core step: plan -> execute -> sample -> decide -> carry out, over one StepContext.

The core plans (which sequences run, their pages, the tier transfers and copy-on-write
copies); the executor runs the transfers, the copies and the forward pass and reports the
transfers done; the sampler draws tokens for the rows whose policy asks for draws, and
each request's continuation policy turns its rows into a decision — continuations, forked
or in place, and sequences to free — which is carried out on the scheduler: frees no fork
needs, forks, one batched append, the other frees. Beam search waits until every live beam
of a request has its row (preemption may run them in different steps); the policy keeps
the rows meanwhile.

A failure is pinned on the request that caused it where that is possible (a sampling row,
a policy, a fork, an append); only a failed forward pass ends every request that was in it,
and only a failed plan or a dead executor ends the engine (``EngineDeadError``).

Everything one step reads and produces lives on its ``StepContext``, not on the core: two
steps in flight at once (asynchronous scheduling) each have their own. ``StepContext`` is
defined in core/step_context.py and the clean-up after a failed step in core/step_failures.py
(both re-exported here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional, cast

import torch

from pagedrs.core import fast_rows, prompt_logprobs, spec_step
from pagedrs.core.continuation import Decision, StepRow
from pagedrs.core.drawn_ids import EarlyPublication
from pagedrs.core.protocol import EngineDeadError, is_engine_fatal
from pagedrs.core.request import Request, Sample
from pagedrs.core.step_context import Rows, StepContext
from pagedrs.core.step_failures import drop_failed_disk_writes, on_failed_step
from pagedrs.core.structured.mask import StepMasks, apply_grammar_masks
from pagedrs.executor.token_fill import DrawnTokens
from pagedrs.sampling import SampleResult, SamplingRow, sample
from pagedrs.sampling_params import SamplingParams
from pagedrs.step_input import StepInput

if TYPE_CHECKING:
    from pagedrs.core.engine_core import EngineCore

# fewer constrained rows than this: their masks are computed when sampled (under a millisecond),
# not handed to the mask thread, whose wake-up and GIL hand-offs cost a batch-1 step more
MIN_OVERLAPPED_ROWS = 8


def run_step(core: EngineCore, ctx: StepContext) -> None:
    """Runs one step; what it did is in ``ctx.touched``. Raises ``EngineDeadError`` (or the
    executor's own fatal error) after ending every request when the engine cannot go on."""
    if core.speculator is not None:
        core.speculator.propose(core)
    step = plan_step(core, ctx)
    ctx.masks = start_masks(core, step)
    try:
        ctx.logits = core.executor.execute(step)
    except Exception as exc:  # noqa: BLE001 - a failed step ends its requests, not the engine
        if ctx.masks is not None:
            ctx.masks.wait()  # the mask thread lets go of the states before a failure frees them
        on_failed_step(core, step, exc, ctx.touched)
        if is_engine_fatal(exc):  # the executor is gone for good: end everything, then say so
            core.fail_all(exc, ctx.touched)
            raise
        return
    except BaseException:  # KeyboardInterrupt, SystemExit mid-step: the step did not complete
        if ctx.masks is not None:
            ctx.masks.wait()
        # Reported failed, so that the next schedule() cannot report it done; its sequences
        # are recomputed when the caller steps again.
        abandon_step(core, step)
        raise
    try:
        finish_step(core, ctx)
    except BaseException:  # an interrupt (or a failure) while drawing: its rows are computed again
        abandon_step(core, step)
        raise


def plan_step(core: EngineCore, ctx: StepContext) -> StepInput:
    """The scheduler's next step as the executor takes it (``ctx.step``); a failed plan ends
    every request and raises ``EngineDeadError``."""
    try:
        plan = core.scheduler.schedule()
    except RuntimeError as exc:  # planning failed part-way: the core is in no known state
        dead = EngineDeadError(f"the scheduler failed while it planned a step: {exc}")
        core.fail_all(dead, ctx.touched)
        raise dead from exc
    step, ctx.prompt_rows = prompt_logprobs.plan(core, StepInput.from_plan(plan, core.scheduler.disk_pages))
    if core.speculator is not None:
        step, ctx.spec = core.speculator.plan(step)
    ctx.step = step
    core.note_scheduled(step, ctx.start)
    return step


def start_masks(core: EngineCore, step: StepInput) -> Optional[StepMasks]:
    """Structured outputs: the grammar masks of the step's sampled rows, started on the mask
    thread so that they are computed while the executor runs the forward pass. The states are
    current: the previous step's tokens were consumed before this plan. (Asynchronous
    scheduling plans before it samples the step before: its masks are computed when sampled.)
    Beams mask their stacked rows at their decision (core/continuation.py) and are left out."""
    if not core.has_grammars:
        return None
    states = {}
    for row, (seq_id, draws) in enumerate(zip(step.seq_ids.tolist(), step.do_sample.tolist())):
        entry = core.sequence(seq_id) if draws else None
        if entry is not None and entry[1].grammar is not None and isinstance(entry[0].params, SamplingParams):
            states[row] = entry[1].grammar
    return StepMasks(states) if len(states) >= MIN_OVERLAPPED_ROWS else None


def finish_step(core: EngineCore, ctx: StepContext, placeholders: frozenset[int] = frozenset(),
                on_tokens: Optional[Callable[[DrawnTokens], None]] = None) -> None:
    """After the executor ran ``ctx.step`` (its logits in ``ctx.logits``): samples, reports it
    done, decides and carries out. Asynchronous scheduling (core/async_step.py): the
    sequences in ``placeholders`` already hold a placeholder for the token they draw now;
    ``on_tokens`` gets their tokens as soon as they are drawn (the next step, already
    launched, waits for them): on the device, before their copy to the host, when the plain
    rows' batched draw holds them all, else on the host once every row is drawn. The
    scheduler's placeholders are resolved with them instead of an append, and a sequence that
    ends now has its extra row in the next step dropped."""
    step = ctx.step
    assert step is not None
    core.scheduler.complete_transfers(core.executor.take_completed_transfers())
    if ctx.masks is not None:  # the forward is done: so are the masks, or they are waited for here, before
        ctx.masks.wait()  # any matcher is touched again (a fork's clone, a consume; llguidance borrows it)
    if ctx.spec is not None:  # several tokens per speculating sequence, one sampling round each
        assert ctx.logits is not None and not placeholders
        # round 0's view is the step itself: the grammar masks planned for its rows serve there, and
        # the step is reported done once that round is drawn (as below: an interrupt before leaves it open)
        try:
            spec_step.verify(core, step, ctx.logits, ctx.spec, lambda view, logits, on_drawn: _round(
                core, StepContext(ctx.start, view, logits, touched=ctx.touched, masks=ctx.masks if view is step else None),
                view, on_drawn, (lambda: _commit(core, ctx)) if view is step else None))
        except BaseException:  # cut short: an open step is abandoned by the caller; a committed one is rewound here
            if step.step_id not in core.scheduler.open_steps():
                spec_step.rewind_interrupted(core, ctx.spec, ctx.touched)
            raise
        return
    # Drawn before the step is reported done: until then an interrupt or a failure here leaves the
    # step open, and the caller reports it failed (``abandon_step``): its rows are computed again
    # instead of the core waiting forever for tokens it never took.
    published = EarlyPublication(on_tokens, placeholders) if on_tokens is not None and placeholders else None
    fast, tokens, logprobs = _sample(core, ctx, step, published)
    _commit(core, ctx)
    if placeholders:
        drawn = _drawn(ctx, fast, tokens)
        given = {seq_id: drawn[seq_id] for seq_id in placeholders if seq_id in drawn}
        if on_tokens is not None and (published is None or not published.done):
            on_tokens(DrawnTokens(host=given))
        core.scheduler.resolve_placeholders(*fast_rows.as_arrays(list(given), list(given.values())))
        for seq_id in placeholders - given.keys():  # a row that drew nothing: its request failed (and let go)
            entry = core.sequence(seq_id)
            if entry is not None:  # never left with a placeholder nobody fills
                core.fail(entry[0], RuntimeError(f"sequence {seq_id} drew no token for its placeholder"), ctx.touched)
    ctx.decisions = _decide(core, ctx)
    appends = fast_rows.record(core, fast, tokens, logprobs, ctx.touched, ctx.steady) if fast.rows else ([], [], [])
    _carry_out(core, ctx, appends, placeholders)


def _commit(core: EngineCore, ctx: StepContext) -> None:
    """The step is done: what it wrote becomes a prefix hit, and its prompt rows' log-probabilities are kept."""
    assert ctx.step is not None
    core.scheduler.complete_step(ctx.step.step_id, True)
    drop_failed_disk_writes(core)
    if ctx.prompt_rows:
        assert ctx.logits is not None
        prompt_logprobs.record(ctx.logits, ctx.prompt_rows)


def abandon_step(core: EngineCore, step: StepInput) -> None:
    """After an interrupt mid-step, or ``finish_step`` raising: if the step was never reported done
    (its forward or its draw did not finish), it is reported failed now, so its sequences are
    computed again and nothing it wrote is a prefix hit; with asynchronous scheduling the step
    after it fails too. A step already reported done is left as it is."""
    if step.step_id not in core.scheduler.open_steps():
        return
    core.scheduler.complete_transfers(core.executor.take_completed_transfers())
    core.note_reset(core.scheduler.complete_step(step.step_id, False))
    drop_failed_disk_writes(core)


def _round(core: EngineCore, ctx: StepContext, step: StepInput,
           on_drawn: Callable[[dict[int, int]], frozenset[int]], drawn_first: Optional[Callable[[], None]] = None,
           ) -> None:
    """One sampling round of a speculative step over ``step``'s sequences (``ctx.logits``: one row
    each): sample, let ``on_drawn`` see the tokens (it returns the sequences whose token the core
    already holds: accepted drafts), decide, carry out. ``drawn_first``: called once the round is
    drawn, before anything is taken (round 0 reports the step done there)."""
    fast, tokens, logprobs = _sample(core, ctx, step)
    if drawn_first is not None:
        drawn_first()
    resolved = on_drawn(_drawn(ctx, fast, tokens))
    ctx.decisions = _decide(core, ctx)
    appends = fast_rows.record(core, fast, tokens, logprobs, ctx.touched) if fast.rows else ([], [], [])
    _carry_out(core, ctx, appends, resolved)


def _drawn(ctx: StepContext, fast: fast_rows.FastStep, tokens: list[int]) -> dict[int, int]:
    """The token each sequence drew this step (fast rows and generic draws), by sequence id."""
    drawn = {row.sample.seq_id: t for row, t in zip(fast.rows, tokens)}
    for (_, _, s), result in zip(ctx.draws, ctx.results):
        if result is not None:
            drawn[s.seq_id] = result.token_id
    return drawn


# ---- sample -------------------------------------------------------------------------------


def _sample(core: EngineCore, ctx: StepContext, step: StepInput, published: Optional[EarlyPublication] = None,
            ) -> tuple[fast_rows.FastStep, list[int], list[float]]:
    """The plain rows' tokens in one batched draw (core/fast_rows.py; returned with their
    log-probabilities), the other rows' the generic way (``ctx.rows``, ``ctx.draws``, ``ctx.results``).
    ``published``: asynchronous scheduling's early publication of the draw's ids (see ``finish_step``)."""
    fast, slow = core.fast_rows.split(step.seq_ids.tolist(), step.do_sample.tolist())
    tokens: list[int] = []
    logprobs: list[float] = []
    if fast.rows:
        assert ctx.logits is not None
        try:
            tokens, logprobs = fast_rows.draw(ctx.logits, fast, None if published is None else published.for_draw(fast))
        except Exception:  # noqa: BLE001 - the generic path finds the row that fails and ends its request
            if published is not None and published.done:
                raise  # the next step runs on the published ids: drawing others for these rows would be wrong
            slow = sorted(slow + fast.index)
            fast = fast_rows.FastStep([], [])
    ctx.rows = _rows(core, step, slow)
    ctx.draws = _draws(core, ctx)
    ctx.results = _sample_attributed(core, ctx) if ctx.draws else []
    return fast, tokens, logprobs


def _rows(core: EngineCore, step: StepInput, index: list[int]) -> Rows:
    """The sampling rows at logits rows ``index`` (those the fast rows did not take), by request."""
    rows: Rows = {}
    if not index:
        return rows
    seq_ids = step.seq_ids.tolist()
    for row in index:
        entry = core.sequence(seq_ids[row])
        if entry is not None:
            request, state = entry
            rows.setdefault(request.request_id, (request, []))[1].append((row, state))
    return rows


def _draws(core: EngineCore, ctx: StepContext) -> list[tuple[int, Request, Sample]]:
    """(logits row, request, sample) for every token the sampler draws."""
    draws: list[tuple[int, Request, Sample]] = []
    for request, request_rows in ctx.rows.values():
        new_sample = core.sample_factory(request)
        for row, state in request_rows:
            try:
                samples = request.policy.draws(request, state, new_sample)
            except Exception as exc:  # noqa: BLE001
                core.fail(request, exc, ctx.touched)
                break
            _inherit_grammar(state, samples)
            draws.extend((row, request, s) for s in samples)
    return draws


def _inherit_grammar(parent: Sample, samples: list[Sample]) -> None:
    """A child drawing from its parent's row (a fork: n > 1, best_of) gets a copy of the
    parent's grammar state, as of that row."""
    if parent.grammar is not None:
        for s in samples:
            if s.grammar is None:
                s.grammar = parent.grammar.clone()


def _constrained(logits: torch.Tensor, part: list[tuple[int, Request, Sample]],
                 planned: Optional[StepMasks] = None) -> torch.Tensor:
    """Structured outputs: each draw's logits with the tokens its grammar does not allow at -inf,
    before the sampler sees them; so penalties, temperature, top-k/top-p and the logprobs act
    on the constrained distribution (vLLM's order). ``logits`` itself when no draw has a grammar.
    The masks ``planned`` computed during the forward pass serve where they are current."""
    return apply_grammar_masks(logits, [s.grammar for _, _, s in part], [row for row, _, _ in part], planned)


def _sample_attributed(core: EngineCore, ctx: StepContext) -> list[Optional[SampleResult]]:
    """Draws in chunks no larger than a step's batch; a chunk that fails is redrawn row
    by row, so that only the request whose row fails is ended (result None)."""
    logits, draws = ctx.logits, ctx.draws
    assert logits is not None
    chunk = max(1, core.max_num_seqs)
    results: list[Optional[SampleResult]] = []
    for start in range(0, len(draws), chunk):
        part = draws[start : start + chunk]
        # only requests with SamplingParams draw (beam search reads its rows itself)
        rows = [SamplingRow(cast(SamplingParams, request.params), s.generator, request.prompt_token_ids, s.token_ids,
                            core.eos_token_ids) for _, request, s in part]
        index = [row for row, _, _ in part]
        # every row once, in order (a step without n > 1 or beams): the logits themselves, not an
        # indexed copy (18 us at batch 1, a 6 MB copy at 32; sample() never writes into them)
        part_logits = logits if index == list(range(logits.shape[0])) else logits[index]
        try:
            results.extend(sample(_constrained(part_logits, part, ctx.masks), rows))
            continue
        except Exception:  # noqa: BLE001 - find the row(s) that fail
            pass
        for draw, srow in zip(part, rows):
            row, request, _ = draw
            try:
                results.extend(sample(_constrained(logits[[row]], [draw]), [srow]))
            except Exception as exc:  # noqa: BLE001
                core.fail(request, exc, ctx.touched)
                results.append(None)
    return results


# ---- decide and carry out -------------------------------------------------------------------


def _decide(core: EngineCore, ctx: StepContext) -> list[tuple[Request, Decision]]:
    """Each request's policy turns its rows (and the tokens drawn from them) into a decision."""
    logits = ctx.logits
    assert logits is not None
    drawn: dict[int, list[tuple[Sample, SampleResult]]] = {}
    for (row, _, s), result in zip(ctx.draws, ctx.results):
        if result is not None:
            drawn.setdefault(row, []).append((s, result))
    decisions = []
    for request, request_rows in ctx.rows.values():
        ctx.touched[request.request_id] = request
        if request.error is not None:
            continue  # this request already failed in this step
        step_rows = [StepRow(s, logits, row, drawn.get(row, [])) for row, s in request_rows]
        try:
            decision = request.policy.on_step(request, step_rows, core.sample_factory(request))
        except Exception as exc:  # noqa: BLE001 - one request's failure must not take the engine down
            core.fail(request, exc, ctx.touched)
            continue
        if decision is not None:
            decisions.append((request, decision))
    return decisions


def _carry_out(core: EngineCore, ctx: StepContext, fast: tuple[list[int], list[int], list[Request]],
               resolved: frozenset[int] = frozenset()) -> None:
    """Frees of sequences no fork reads, then the forks (a parent that goes on more than
    once is forked before any append), then one batched append (the fast rows' continuations,
    ``fast``, with the others), then the other frees. Freeing early lets a pruned beam's pages
    serve this step's copies-on-write. The sequences in ``resolved`` have their token in the
    scheduler already (a resolved placeholder): they are not appended again."""
    now = time.monotonic()
    appends: list[tuple[Request, Sample, int]] = []
    for request, decision in ctx.decisions:
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        core.num_generated += decision.num_tokens
        forks = [c for c in decision.continuations if c.sample is not c.parent]
        parents = {c.parent.seq_id for c in forks}
        for s in decision.finished:
            if s.seq_id not in parents:
                core.release(s.seq_id)
        try:
            for c in forks:
                core.fork(request, c.parent, c.sample)
        except Exception as exc:  # noqa: BLE001 - e.g. the contiguous layout has no room for a child
            core.fail(request, exc, ctx.touched)
        appends += [(request, c.sample, c.token_id) for c in decision.continuations]
    appends = [a for a in appends if a[0].error is None]
    ids, tokens, owners = fast
    if appends:
        ids = ids + [s.seq_id for _, s, _ in appends]
        tokens = tokens + [t for _, _, t in appends]
        owners = owners + [r for r, _, _ in appends]
    if resolved and ids:
        keep = [i for i, seq_id in enumerate(ids) if seq_id not in resolved]
        ids, tokens, owners = [ids[i] for i in keep], [tokens[i] for i in keep], [owners[i] for i in keep]
    if ids:
        _append(core, ids, tokens, owners, ctx.touched)
    for request, decision in ctx.decisions:
        for s in decision.finished:  # also after a failure: a policy may have dropped them from samples
            core.release(s.seq_id)
        if request.finished and request.metrics.finished_time is None:
            request.metrics.finished_time = now


def _append(core: EngineCore, ids: list[int], tokens: list[int], owners: list[Request],
            touched: dict[str, Request]) -> None:
    try:
        core.scheduler.append_tokens(*fast_rows.as_arrays(ids, tokens))  # all or nothing
    except Exception:  # noqa: BLE001 - find the sequence(s) the core refuses
        for request, seq_id, token in zip(owners, ids, tokens):
            if request.error is not None:
                continue
            try:
                core.scheduler.append_tokens(*fast_rows.as_arrays([seq_id], [token]))
            except Exception as exc:  # noqa: BLE001
                core.fail(request, exc, touched)
