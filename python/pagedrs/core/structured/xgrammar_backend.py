"""xgrammar as the second grammar engine (``EngineArgs(structured_outputs_backend="xgrammar")``).

Optional: ``pip install xgrammar`` (it needs ``apache-tvm-ffi`` beside what pagedrs already
has); imported only when an engine asks for it. It compiles each distinct constraint once
(``GrammarCompiler``'s LRU, keyed the same way) into a ``CompiledGrammar``; each sample gets
a ``GrammarMatcher`` on it, ``fork``-ed for a fork. Its bitmask has llguidance's layout (int32
words, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed), so the masks are
applied the same way (core/structured/mask.py).

The constraints are given to it as llguidance gets them: JSON compact (no whitespace, ``,``
and ``:``), a regex as is, a list of choices as an EBNF alternation of string literals, a
grammar in GBNF (EBNF, when it has ``::=``) or Lark. The front end checks constraints with
llguidance (core/structured/grammar.py); one that xgrammar alone refuses is a ValueError
naming the field when the core compiles it.

Where the two engines differ, pagedrs makes xgrammar behave as llguidance does: a token the
grammar refuses leaves the matcher failed, allowing only EOS from then on (only a beam at -inf
ever carries one); ``is_stopped`` is true when only the stop tokens may follow.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import xgrammar as xgr  # type: ignore[import-not-found, unused-ignore]  # optional

from pagedrs.core.structured.backend import GrammarCompiler
from pagedrs.core.structured.state import GrammarState
from pagedrs.sampling_params import StructuredOutputsParams


class XGrammarState:
    """One sample's xgrammar matcher (``GrammarState``'s methods)."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_consumed = 0
        self._stop_token_ids = list(stop_token_ids)
        self._failed = ""  # why a token was refused ('' while fine); then only EOS is allowed

    def consume(self, token_id: int) -> bool:
        if not self._failed and self.matcher.accept_token(token_id):
            self.num_consumed += 1
            return True
        self._failed = self._failed or f"xgrammar refused token {token_id}"
        return False

    @staticmethod
    def fill_bitmasks(states: Sequence[GrammarState], bitmask: np.ndarray) -> None:
        """All rows in one call (xgrammar's batch matcher, on its threads); a failed state's row allows only EOS."""
        xstates = [cast(XGrammarState, s) for s in states]
        live = [i for i, s in enumerate(xstates) if not s._failed]
        if live:
            xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask([xstates[i].matcher for i in live], bitmask, live)
        for i, s in enumerate(xstates):
            if s._failed:
                bitmask[i] = 0
                words = bitmask.view(np.uint32)
                for t in s._stop_token_ids:
                    words[i, t // 32] |= np.uint32(1 << (t % 32))

    def clone(self) -> XGrammarState:
        copy = XGrammarState(self.matcher.fork(), self.vocab_size, self._stop_token_ids)
        copy.num_consumed, copy._failed = self.num_consumed, self._failed
        return copy

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_consumed:
            raise ValueError(f"rollback({num_tokens}): only {self.num_consumed} tokens were consumed")
        if num_tokens:
            self.matcher.rollback(num_tokens)
        self.num_consumed -= num_tokens
        self._failed = ""  # a refused token was never consumed: rolling back past it forgets it

    def validate_tokens(self, token_ids: list[int]) -> int:
        accepted = 0
        for t in token_ids:
            if self._failed or not self.matcher.accept_token(t):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    @property
    def is_accepting(self) -> bool:
        return not self._failed and (self.matcher.is_completed() or self.matcher.is_terminated())

    @property
    def is_stopped(self) -> bool:
        if self._failed or self.matcher.is_terminated():
            return True
        bitmask = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
        return set(allowed.tolist()) <= set(self._stop_token_ids)

    @property
    def error(self) -> str:
        return self._failed


class XGrammarCompiler(GrammarCompiler):
    """``GrammarCompiler``'s LRU over xgrammar's compiler."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        super().__init__(hf_tokenizer, vocab_size, eos_token_ids)
        self._xgr: Any = None  # xgr.GrammarCompiler, built at the first compile

    @property
    def xgrammar(self) -> xgr.GrammarCompiler:
        if self._xgr is None:
            n_vocab = max(self.vocab_size, len(self._hf))
            info = xgr.TokenizerInfo.from_huggingface(self._hf, vocab_size=n_vocab,
                                                      stop_token_ids=self.eos_token_ids or None)
            self._xgr = xgr.GrammarCompiler(info, cache_enabled=False)  # the LRU above is the cache
        return self._xgr

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = self._compile_kind(params.kind, params.spec)
        except Exception as exc:  # noqa: BLE001 - whatever xgrammar raises, the constraint is what is wrong
            raise ValueError(f"structured_outputs.{params.kind} does not compile (xgrammar): "
                             f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.num_compiles += 1
            self.compile_seconds += time.perf_counter() - start
        return compiled

    def _compile_kind(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        compiler = self.xgrammar
        if kind == "json":
            return compiler.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        if "::=" in spec:
            return compiler.compile_grammar(spec)  # GBNF / EBNF
        return compiler.compile_lark(spec)

    def _instantiate(self, template: xgr.CompiledGrammar) -> GrammarState:
        matcher = xgr.GrammarMatcher(template, max_rollback_tokens=-1)
        return XGrammarState(matcher, max(self.vocab_size, len(self._hf)), self.eos_token_ids)
