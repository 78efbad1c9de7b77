"""A step's grammar masks: computed for every constrained row in one call, applied to the logits.

llguidance writes each row's allowed tokens as a bitmask (``[rows, ceil(V / 32)]`` int32, bit
``t % 32`` of word ``t // 32`` for token ``t``), for all rows at once on its own threads
(``LLExecutor``, the GIL released). The bits are unpacked to a ``[rows, V]`` bool and every
token they do not allow gets a logit of -inf, in a copy: the step's logits stay as the model
made them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import llguidance
import numpy as np
import torch

from pagedrs.core.structured.state import GrammarState


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # threads: 80% of the CPUs, at most 32 (llguidance's default)


def allowed_tokens(states: Sequence[GrammarState], vocab_size: int) -> np.ndarray:
    """``[len(states), vocab_size]`` uint8: 1 where the state's grammar allows the token next."""
    words = (max(s.vocab_size for s in states) + 31) // 32
    bitmask = np.zeros((len(states), words), dtype=np.int32)
    _executor().unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], bitmask.ctypes.data,
                                        words * 4, len(states))
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")  # int32 words are little-endian
    if bits.shape[1] < vocab_size:  # ids past the grammar's vocabulary are never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return bits[:, :vocab_size]


def apply_grammar_masks(logits: torch.Tensor, states: Sequence[Optional[GrammarState]]) -> torch.Tensor:
    """``logits`` ([rows, V]) with each constrained row's disallowed tokens at -inf, in a copy;
    ``logits`` itself when no row has a grammar. ``states[i]`` is row i's state or None."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    allowed = allowed_tokens([s for s in states if s is not None], logits.shape[1])
    disallowed = torch.from_numpy(allowed == 0).to(logits.device)
    masked = logits.clone()
    if len(rows) == logits.shape[0]:
        masked.masked_fill_(disallowed, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        masked[index] = masked[index].masked_fill(disallowed, float("-inf"))
    return masked
