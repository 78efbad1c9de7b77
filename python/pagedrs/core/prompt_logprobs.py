"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): the logits of every prompt row.

The runner returns each scheduled sequence's last row only. For a request that asks for its
prompt's log-probabilities the core names the other prompt rows of each of its chunks in
``StepInput.logit_rows``; the runner returns their logits after the S last rows (one index list
and one ``torch.cat`` in the runner: the smallest change, and a step without such a request is
untouched). Prompt position ``p``'s row gives the log-probability of prompt token ``p + 1``, so
positions ``0 .. L-2`` are needed; the last prompt position's row is the one the first token is
sampled from. A chunk's last row is its sequence's last row (row i of the logits): it needs no
extra row. Chunked prefill simply adds each chunk's positions.

Rows that come from the prefix cache are never computed, so such a request is admitted with a
salt of its own (``unique_salt``: no prefix hit, as vLLM does). A recomputed sequence (after a
preemption, or a lost disk page) computes its positions again: the entries are kept by position
and a recomputed one replaces the same values. Beam search is refused (sampling_params.py).

The log-probabilities are those of the raw logits (float32 log-softmax), as the sampled tokens'
are (sampling.py); each entry is ``{prompt token: logprob}`` followed by the top-k alternatives.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedrs.core.request import Request
from pagedrs.sampling_params import SamplingParams
from pagedrs.step_input import StepInput

if TYPE_CHECKING:
    from pagedrs.core.engine_core import EngineCore

logger = logging.getLogger("pagedrs.engine")

# A salt no user salt can equal (those are UTF-8 text, and 0xff is never a UTF-8 byte).
_SALT_PREFIX = b"\xffprompt_logprobs:"


@dataclass(frozen=True)
class PromptRows:
    """One request's prompt positions in one step and the logits row of each."""

    request: Request
    first: int  # the prompt position of rows[0]; rows[j] is position first + j
    rows: list[int]  # rows of the step's logits tensor


def wants(params: object, prompt_len: int) -> bool:
    """Whether a request has prompt rows to compute (a one-token prompt has none: its entry is None)."""
    return isinstance(params, SamplingParams) and params.prompt_logprobs is not None and prompt_len > 1


def unique_salt(arrival: int) -> bytes:
    """The cache salt of a request with prompt_logprobs: its own, so that no prefix is reused."""
    return _SALT_PREFIX + str(arrival).encode("ascii")


def plan(core: EngineCore, step: StepInput) -> tuple[StepInput, list[PromptRows]]:
    """``step`` with the extra prompt rows in ``logit_rows``, and the rows of each request."""
    pending = core.prompt_logprob_requests
    if not pending:
        return step, []
    for request_id in [rid for rid, r in pending.items() if r.finished or r.prompt_logprobs_complete]:
        del pending[request_id]
    q = step.query_start_loc.tolist()
    seq_lens = step.seq_lens.tolist()
    num_seqs = step.num_seqs
    extra: list[int] = []
    planned: list[PromptRows] = []
    for i, seq_id in enumerate(step.seq_ids.tolist()):
        entry = core.sequence(seq_id)
        if entry is None or entry[0].request_id not in pending:
            continue
        request = entry[0]
        end = seq_lens[i]
        start = end - (q[i + 1] - q[i])
        stop = min(end, len(request.prompt_token_ids) - 1)  # positions 0 .. L-2
        if start >= stop:
            continue  # a decode row, or the chunk holding only the last prompt position
        rows = []
        for p in range(start, stop):
            if p == end - 1:
                rows.append(i)  # the chunk's last row: the sequence's own row
            else:
                rows.append(num_seqs + len(extra))
                extra.append(q[i] + p - start)
        planned.append(PromptRows(request, start, rows))
    if extra:
        step = dataclasses.replace(step, logit_rows=np.asarray(extra, dtype=np.int64))
    return step, planned


def record(logits: torch.Tensor, planned: list[PromptRows]) -> None:
    """Each planned position's entry, from the step's logits (after the step completed)."""
    for rows in planned:
        request = rows.request
        if request.finished or request.prompt_logprobs is None:
            continue
        params = request.params
        assert isinstance(params, SamplingParams) and params.prompt_logprobs is not None
        k = params.prompt_logprobs
        if rows.first > 0 and rows.first - 1 not in request.prompt_logprobs:  # never: its salt is its own
            logger.error("request %s: prompt positions before %d were neither computed nor recorded (a prefix "
                         "reused?); its prompt_logprobs will be missing", request.request_id, rows.first)
        full = torch.log_softmax(logits[rows.rows].float(), dim=-1)
        targets = request.prompt_token_ids[rows.first + 1 : rows.first + 1 + len(rows.rows)]
        chosen = full.gather(1, torch.tensor(targets, device=full.device)[:, None].long())[:, 0].tolist()
        top_ids: list[list[int]] = [[] for _ in targets]
        top_vals: list[list[float]] = [[] for _ in targets]
        if k:
            vals, ids = full.topk(min(k, full.shape[1]), dim=-1)
            top_ids, top_vals = ids.tolist(), vals.tolist()
        for j, (token, logprob) in enumerate(zip(targets, chosen, strict=True)):
            entry = {token: logprob}
            entry.update(zip(top_ids[j], top_vals[j], strict=True))
            request.prompt_logprobs[rows.first + j] = entry
