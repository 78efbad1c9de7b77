"""Which grammar compiler a core builds: ``EngineArgs.structured_outputs_backend``.

Apart from backend.py (llguidance, the default) and xgrammar_backend.py (optional, imported only
when asked for), since the xgrammar compiler is a GrammarCompiler itself.
"""

from __future__ import annotations

from typing import Any

from pagedrs.core.structured.backend import GrammarCompiler

BACKENDS = ("llguidance", "xgrammar")  # EngineArgs.structured_outputs_backend


def make_compiler(backend: str, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> GrammarCompiler:
    """The compiler of ``backend`` (one of ``BACKENDS``); xgrammar is imported only when asked for."""
    if backend == "xgrammar":
        from pagedrs.core.structured.xgrammar_backend import XGrammarCompiler

        return XGrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids)
    if backend != "llguidance":
        raise ValueError(f"structured_outputs_backend={backend!r} is not a grammar backend: allowed {', '.join(BACKENDS)}")
    return GrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids)
