"""A step's grammar masks: computed for every constrained row in one call, applied to the logits.

The grammar engine writes each row's allowed tokens as a bitmask (``[rows, ceil(V / 32)]`` int32,
bit ``t % 32`` of word ``t // 32`` for token ``t``), for all rows at once on its own threads, the
GIL released (``GrammarState.fill_bitmasks``: llguidance's ``LLExecutor``, or xgrammar's batch matcher). The bitmask becomes an additive bias (0 where allowed,
-inf elsewhere) through a table of the 256 bytes' 8 floats (one ``np.take``: 0.3 ms for 32 rows
of a 49k vocabulary), and the masked logits are ``logits + bias``, a copy: the step's logits
stay as the model made them. ``masked_fill`` with the same mask costs 10-20 ms at that size on
one thread (a data-dependent branch per element); the sum costs 0.5 ms and gives the same
values (``x + 0.0 == x``).

``StepMasks`` computes a step's bias on the mask thread from the plan, while the executor runs
the forward pass (core/step.py): a sampled row's grammar state cannot change between the plan
and the sampling, since its previous token was consumed before the plan. A row whose state did
change, or that was not planned with a mask, gets its mask computed when it is sampled.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from pagedrs.core.structured.state import GrammarState

# _BYTE_BIAS[b, i]: 0.0 when bit i of byte b is set (the token is allowed), else -inf
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                      np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


@functools.cache
def _mask_thread() -> ThreadPoolExecutor:
    """One thread: a step's masks are one job (llguidance fans it out to its own threads)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedrs-masks")


def grammar_bitmask(states: Sequence[GrammarState]) -> np.ndarray:
    """``[len(states), words]`` int32: each state's allowed next tokens, one bit per token id."""
    words = (max(s.vocab_size for s in states) + 31) // 32
    bitmask = np.zeros((len(states), words), dtype=np.int32)
    type(states[0]).fill_bitmasks(states, bitmask)  # one backend per engine: every state's is the same
    return bitmask


def bias_of(bitmask: np.ndarray) -> torch.Tensor:
    """``[rows, 32 * words]`` float32: 0 where the bitmask allows the token, -inf elsewhere."""
    rows = bitmask.shape[0]
    # int32 words are little-endian: byte j of a row holds tokens 8j .. 8j+7, bit i token 8j+i
    return torch.from_numpy(np.take(_BYTE_BIAS, bitmask.view(np.uint8), axis=0).reshape(rows, -1))


class StepMasks:
    """One step's masks, for the logits rows whose sample has a grammar, computed on the mask
    thread from the moment it is made. ``bias(rows, states)`` waits for them."""

    def __init__(self, states: dict[int, GrammarState]) -> None:
        self._index = {row: i for i, row in enumerate(states)}  # logits row -> its row in the bias
        self._consumed = [s.num_consumed for s in states.values()]  # the states as the masks saw them
        self.compute_seconds = 0.0  # time the mask thread spent on them
        self._future: Future[torch.Tensor] = _mask_thread().submit(self._compute, list(states.values()))

    def _compute(self, states: list[GrammarState]) -> torch.Tensor:
        start = time.perf_counter()
        bias = bias_of(grammar_bitmask(states))
        self.compute_seconds = time.perf_counter() - start
        return bias

    def wait(self) -> None:
        """Until the mask thread is done with the states (before anything else may touch them)."""
        self._future.exception()

    def bias(self, rows: Sequence[int], states: Sequence[GrammarState]) -> Optional[torch.Tensor]:
        """The bias of logits rows ``rows`` (in that order), whose samples hold ``states`` (a fork's
        clone of the row's state will do); None when a row was not planned with a mask or its
        state moved since."""
        index = [self._index.get(row, -1) for row in rows]
        if -1 in index or any(s.num_consumed != self._consumed[i] for i, s in zip(index, states)):
            self.wait()
            return None
        bias = self._future.result()
        return bias if index == list(range(bias.shape[0])) else bias[index]


def apply_grammar_masks(logits: torch.Tensor, states: Sequence[Optional[GrammarState]],
                        rows: Optional[Sequence[int]] = None, planned: Optional[StepMasks] = None) -> torch.Tensor:
    """``logits`` ([n, V]) with each constrained row's disallowed tokens at -inf, in a copy;
    ``logits`` itself when no row has a grammar. ``states[i]`` is row i's state or None;
    ``rows[i]`` the step's logits row it came from, whose mask ``planned`` may hold already."""
    constrained = [i for i, s in enumerate(states) if s is not None]
    if not constrained:
        return logits
    grammars = [s for s in states if s is not None]
    bias = None
    if planned is not None and rows is not None:
        bias = planned.bias([rows[i] for i in constrained], grammars)
    if bias is None:
        bias = bias_of(grammar_bitmask(grammars))
    vocab = logits.shape[1]
    if bias.shape[1] < vocab:  # ids past the grammar's vocabulary are never allowed
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    bias = bias[:, :vocab].to(logits.device)
    if len(constrained) == logits.shape[0]:
        return logits + bias
    masked = logits.clone()
    index = torch.tensor(constrained, device=logits.device)
    masked[index] = masked[index] + bias
    return masked
