"""The grammar compiler of one tokenizer: compiles each distinct constraint once, keeps the last
``capacity`` compiled in an LRU, and hands every new sample a fresh matcher copied from it.

llguidance compiles a grammar when an ``LLMatcher`` is built (the lexer, the token trie's
walk); a matcher that has consumed nothing is the compiled grammar, and ``deep_copy`` of it
costs a copy, not a compile. So the cache holds one untouched matcher per
``(kind, spec)`` — the tokenizer is this compiler's own — and ``num_compiles`` counts the
misses, so that a test can see a second request with the same schema compile nothing.

The llguidance tokenizer is built from the Hugging Face fast tokenizer on first use (about two
seconds for a 50k vocabulary; ``text_tokenizer``: forced text is tokenized as text), with the model's vocabulary size: its masks have one bit per
logit, and the ids the tokenizer lacks (padding rows of the embedding) are never allowed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Optional

import llguidance

from pagedrs.core.structured.grammar import empty_language_error, grammar_text
from pagedrs.core.structured.state import GrammarState, LLGuidanceState
from pagedrs.core.structured.text_tokenizer import text_tokenizer
from pagedrs.sampling_params import StructuredOutputsParams

DEFAULT_CAPACITY = 128  # compiled grammars kept; a matcher is kilobytes to a few megabytes


class GrammarCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 capacity: int = DEFAULT_CAPACITY) -> None:
        if hf_tokenizer is None:
            raise ValueError("structured outputs need a tokenizer, but the engine was built with skip_tokenizer_init=True")
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.capacity = capacity
        self._tokenizer: Optional[llguidance.LLTokenizer] = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (kind, spec) -> the backend's compiled form
        self.num_compiles = 0  # cache misses: grammars compiled
        self.compile_seconds = 0.0  # their total wall time

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            n_vocab = max(self.vocab_size, len(self._hf))
            eos = self.eos_token_ids or None
            self._tokenizer = text_tokenizer(self._hf, n_vocab, eos)
        return self._tokenizer

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one sample; compiles only when ``params`` is not in the cache.
        Raises ValueError (naming the field and llguidance's message) when it does not compile."""
        key = (params.kind, params.spec)
        template = self._compiled.get(key)
        if template is None:
            template = self._compile(params)
            self._compiled[key] = template
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return self._instantiate(template)

    def _instantiate(self, template: Any) -> GrammarState:  # an llguidance.LLMatcher here
        return LLGuidanceState(template.deep_copy(), self.tokenizer.vocab_size)

    def _compile(self, params: StructuredOutputsParams) -> Any:  # the backend's compiled form: an LLMatcher here
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(params), log_level=0)
        self.num_compiles += 1
        self.compile_seconds += time.perf_counter() - start
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {matcher.get_error()}")
        problem = empty_language_error(matcher)  # the front end's check too; a core may be driven directly
        if problem:
            raise ValueError(f"structured_outputs.{params.kind} {problem}")
        return matcher

    def __len__(self) -> int:
        return len(self._compiled)
