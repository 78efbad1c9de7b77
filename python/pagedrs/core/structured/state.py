"""One sample's grammar state: the llguidance matcher that has consumed its generated tokens.

It lives with the sample (``core.request.Sample.grammar``), not with its pages: a preempted
sample, swapped or recomputed, keeps it, since its tokens do not change; a forked sample
gets a ``clone``; a finished or aborted one drops it (``EngineCore.release``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol, cast

import llguidance
import numpy as np


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # threads: 80% of the CPUs, at most 32 (llguidance's default)


class GrammarState(Protocol):
    """What the core asks of a sample's matcher, whichever grammar engine made it:
    ``LLGuidanceState`` (the default) or ``xgrammar_backend.XGrammarState``."""

    vocab_size: int  # the grammar's tokenizer's: the width of its masks, in bits
    num_consumed: int

    def consume(self, token_id: int) -> bool: ...
    def clone(self) -> GrammarState: ...
    def rollback(self, num_tokens: int) -> None: ...
    def validate_tokens(self, token_ids: list[int]) -> int: ...

    @staticmethod
    def fill_bitmasks(states: Sequence[GrammarState], bitmask: np.ndarray) -> None: ...

    @property
    def is_accepting(self) -> bool: ...

    @property
    def is_stopped(self) -> bool: ...

    @property
    def error(self) -> str: ...


class LLGuidanceState:
    """llguidance's matcher."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the grammar's tokenizer's: the width of its masks, in bits
        self.num_consumed = 0

    def consume(self, token_id: int) -> bool:
        """Advances by one sampled token; False (and the matcher in its error state) when the
        grammar does not allow it. EOS is allowed where the grammar accepts."""
        ok = self.matcher.consume_token(token_id)
        if ok:
            self.num_consumed += 1
        return ok

    @staticmethod
    def fill_bitmasks(states: Sequence[GrammarState], bitmask: np.ndarray) -> None:
        """Row i of ``bitmask`` (C-contiguous int32 ``[len(states), words]``): state i's allowed next
        tokens, one bit per token id (bit ``t % 32`` of word ``t // 32``), all rows in one call on
        llguidance's threads, the GIL released."""
        _executor().unsafe_compute_mask_ptr([(cast(LLGuidanceState, s).matcher, i) for i, s in enumerate(states)],
                                            bitmask.ctypes.data,
                                            bitmask.shape[1] * 4, len(states))

    def clone(self) -> LLGuidanceState:
        """An independent copy (a fork: n > 1, best_of, a beam)."""
        copy = LLGuidanceState(self.matcher.deep_copy(), self.vocab_size)
        copy.num_consumed = self.num_consumed
        return copy

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` consumed (speculative decoding's rejected proposals)."""
        if not 0 <= num_tokens <= self.num_consumed:
            raise ValueError(f"rollback({num_tokens}): only {self.num_consumed} tokens were consumed")
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar could not roll back {num_tokens} tokens: {self.matcher.get_error()}")
        self.num_consumed -= num_tokens

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (proposed tokens, in order) the grammar would accept from here."""
        return self.matcher.validate_tokens(token_ids)

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete answer (EOS may end it)."""
        return self.matcher.is_accepting()

    @property
    def is_stopped(self) -> bool:
        """Nothing more can follow (the answer is complete, or the matcher failed: see ``error``)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """llguidance's error message; '' while the matcher is fine."""
        return self.matcher.get_error() if self.matcher.is_error() else ""
