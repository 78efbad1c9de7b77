"""The core's persistent batch of plain decode rows: the steady state of a serving step, in arrays.

Most rows of a busy decode step belong to requests that ask for nothing special: one sample,
no logprobs, no penalties, no seed, no grammar, past ``min_tokens``. For them the generic path
(core/step.py: a ``SamplingRow``, a policy call, a ``Decision``, a ``Continuation`` per row)
costs ~20 us of Python per row and step, which at batch 256 is most of the host's fixed cost
(issue 25). Here such rows are sampled in one batched call, their token rules are one lookup
each, and their appends join the step's one batched append.

The persistent part: each sequence's ``FastRow`` is made once, the first time the sequence
samples, and kept until the core releases the sequence (``FastRows.forget``): a step reads the
rows it needs from this table by sequence id instead of rebuilding them (vLLM v1's
``InputBatch``, updated by the diff of sequences added and released). A row that is not plain
(or not yet past ``min_tokens``) goes the generic way; both paths draw the same greedy tokens
and report the same log-probabilities (``sampling.chosen_logprobs`` in both).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from pagedrs import sampling
from pagedrs.core import drawn_ids
from pagedrs.core.continuation import IndependentSamples
from pagedrs.core.protocol import CoreTokenRows
from pagedrs.core.request import Request, Sample, TokenRule
from pagedrs.errors import NonFiniteLogitsError
from pagedrs.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedrs.core.engine_core import EngineCore


@dataclass(frozen=True)
class FastRow:
    """One plain sequence's row settings, made once."""

    request: Request
    sample: Sample
    rule: TokenRule
    greedy: bool
    temperature: float  # 1.0 when greedy
    top_k: int  # 0: off
    top_p: float
    min_p: float


@dataclass
class FastStep:
    """The plain rows of one step: their logits rows and settings, in step order."""

    index: list[int]  # logits rows
    rows: list[FastRow]
    _all_greedy: Optional[bool] = None  # made once: a steady batch reuses its FastStep step after step

    @property
    def all_greedy(self) -> bool:
        if self._all_greedy is None:
            self._all_greedy = all(r.greedy for r in self.rows)
        return self._all_greedy


def is_plain(request: Request, sample: Sample) -> bool:
    """Whether the sequence's rows can take the fast path (checked once per sequence)."""
    params = request.params
    return (isinstance(params, SamplingParams) and isinstance(request.policy, IndependentSamples)
            and request.num_samples == 1 and sample.grammar is None and sample.generator is None
            and params.seed is None and params.logprobs is None and params.structured_outputs is None
            and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and params.logit_bias is None and params.allowed_token_ids is None)


class FastRows:
    """The table of plain rows by sequence id (None: a sequence that is not plain)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._rows: dict[int, Optional[FastRow]] = {}
        # the previous split when every row of it was fast: a steady batch asks for the same one again
        self._last: Optional[tuple[list[int], list[bool], FastStep]] = None

    def __len__(self) -> int:
        return len(self._rows)

    def forget(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        self._last = None

    def _make(self, seq_id: int) -> Optional[FastRow]:
        entry = self._core.sequence(seq_id)
        if entry is None or not is_plain(*entry):
            return None
        request, sample = entry
        params = request.params
        assert isinstance(params, SamplingParams)
        greedy = params.is_greedy
        return FastRow(request, sample, request.token_rule(self._core.eos_token_ids, self._core.max_model_len),
                       greedy, 1.0 if greedy else params.temperature, params.top_k, params.top_p, params.min_p)

    def split(self, seq_ids: list[int], do_sample: list[bool]) -> tuple[FastStep, list[int]]:
        """The step's sampling rows: the plain ones, and the logits rows of the rest.

        The same sequences as the previous step, all of whose rows were fast, give the same split:
        a row stays plain (its settings do not change) and past ``min_tokens`` (its tokens only
        grow), and a sequence that ends is forgotten, which drops the remembered split."""
        last = self._last
        if last is not None and last[0] == seq_ids and last[1] == do_sample:
            return last[2], []
        fast = FastStep([], [])
        slow: list[int] = []
        table = self._rows
        for i, (seq_id, sampled) in enumerate(zip(seq_ids, do_sample)):
            if not sampled:
                continue
            if seq_id in table:
                row = table[seq_id]
            else:
                row = table[seq_id] = self._make(seq_id)
            if row is not None and len(row.sample.token_ids) >= row.rule.min_tokens:
                fast.index.append(i)
                fast.rows.append(row)
            else:
                slow.append(i)
        self._last = (seq_ids, do_sample, fast) if not slow else None
        return fast, slow


def draw(logits: torch.Tensor, fast: FastStep,
         on_drawn: Optional[Callable[[torch.Tensor], None]] = None) -> tuple[list[int], list[float]]:
    """One token per plain row (``sampling.draw``, the generic path's draw: no penalty, no
    min_tokens mask, no seed here), and its log-probability under the raw logits.

    ``on_drawn`` (asynchronous scheduling) gets the drawn ids (int64 [rows], on the logits' device)
    once the draw cannot fail any more and before they are copied to the host: the next step may
    be launched on them (core/drawn_ids.py has the copy that keeps out of its way)."""
    rows = fast.rows
    whole = len(fast.index) == logits.shape[0] and fast.index[-1] == len(fast.index) - 1
    raw = logits.float() if whole else logits[fast.index].float()
    if raw.device.type == "cpu" and raw.dim() == 2 and raw.shape[1] and fast.all_greedy:
        tokens, logprobs = _greedy_on_cpu(raw)
        if on_drawn is not None:
            on_drawn(torch.tensor(tokens, dtype=torch.int64))
        return tokens, logprobs
    token_ids = sampling.draw(raw, [r.greedy for r in rows], [r.temperature for r in rows], [r.min_p for r in rows],
                              [r.top_k for r in rows], [r.top_p for r in rows])
    chosen, _ = sampling.chosen_logprobs(raw, token_ids)
    if on_drawn is None:
        return token_ids.tolist(), chosen.tolist()
    copy = drawn_ids.to_host_behind(token_ids, chosen)  # enqueued before the next step's kernels
    on_drawn(token_ids)
    host_ids, host_logprobs = copy.wait()
    return host_ids.tolist(), host_logprobs.tolist()


def _greedy_on_cpu(raw: torch.Tensor) -> tuple[list[int], list[float]]:
    """``draw`` of all-greedy rows on the CPU from one Rust call (``logits_greedy``): the same argmax as
    ``sampling.argmax_rows`` (first maximal index, NaN maximal) and the same log-probability as
    ``sampling.chosen_logprobs`` (``x[t] - logsumexp(x)`` with the same log-sum-exp, the same float32
    subtraction), with no torch op and no NumPy indexing (each ran cold here after the model: numpy's
    argmax and torch's log_softmax took ~100 us a batch-1 step)."""
    from pagedrs._core import logits_greedy

    return logits_greedy(np.ascontiguousarray(raw.detach().numpy()))


def record(core: EngineCore, fast: FastStep, tokens: list[int], logprobs: list[float],
           touched: dict[str, Request],
           steady: Optional[CoreTokenRows] = None) -> tuple[list[int], list[int], list[Request]]:
    """Each plain row's token joins its sample, its token rule decides; finished samples are
    released. Returns the (sequence ids, tokens, requests) to append.

    With ``steady`` (a step that draws one token per sequence), a row that only gained its token
    goes out there, in columns (its sample's token counted as sent), instead of through
    ``touched`` and a ``CoreOutput`` of its own; see ``CoreTokenRows`` for when a row is steady."""
    now = time.monotonic()
    ids: list[int] = []
    appended: list[int] = []
    owners: list[Request] = []
    for row, token, logprob in zip(fast.rows, tokens, logprobs):
        s, request = row.sample, row.request
        if logprob != logprob:  # NaN logits (``record_token``'s rule): the request fails, no token taken
            if request.error is None:
                core.fail(request, NonFiniteLogitsError(len(s.token_ids)), touched)
            continue
        s.token_ids.append(token)
        s.logprobs.append(logprob)
        rule = row.rule
        num_out = len(s.token_ids)
        if token in rule.stops or num_out >= rule.limit:  # (what ``finish`` checks first, without the call)
            rule.finish(s, token, num_out, rule.stops)
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            touched[request.request_id] = request  # its first token: the core's queue bookkeeping reads it
        elif request.stream_tokens:  # (a request read only at its end is touched when it ends)
            if steady is not None and s.finish_reason is None and s.sent_tokens == num_out - 1 and request.steady:
                s.sent_tokens = num_out
                steady.request_ids.append(request.request_id)
                steady.token_ids.append(token)
                steady.logprobs.append(logprob)
            else:
                touched[request.request_id] = request
        if s.finish_reason is None:
            ids.append(s.seq_id)
            appended.append(token)
            owners.append(request)
        else:
            touched[request.request_id] = request
            core.release(s.seq_id)
            metrics.finished_time = now
    core.num_generated += len(tokens)
    return ids, appended, owners


def as_arrays(ids: list[int], tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(ids, dtype=np.uint64), np.asarray(tokens, dtype=np.uint32)
