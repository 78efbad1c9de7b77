"""Prompt lookup (vLLM's ``ngram`` proposer): the sequence's last n tokens, found earlier in
its own prompt and output, propose the tokens that followed them there.

Pure and NumPy-only: ``propose(tokens, k, lo, hi)`` tries suffix lengths ``hi`` down to ``lo``
and takes the most recent earlier occurrence of the longest suffix that matches (the newest
context is the likeliest to repeat: a text being quoted, a list being continued). No model
cost; a sequence with no match proposes nothing and decodes as usual.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: np.ndarray, k: int, lo: int, hi: int) -> np.ndarray:
    """Up to ``k`` draft tokens (uint32) continuing ``tokens`` (a 1-D integer array), or none."""
    n_tok = int(tokens.shape[0])
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        suffix = tokens[n_tok - n:]
        # windows that start before the suffix itself and leave at least one token after them
        windows = sliding_window_view(tokens[: n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the newest earlier match
            return tokens[start : start + k].astype(np.uint32)
    return np.zeros(0, dtype=np.uint32)
