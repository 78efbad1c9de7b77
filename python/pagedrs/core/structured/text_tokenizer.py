"""The llguidance tokenizer of a Hugging Face fast tokenizer whose tokenize spells exactly the
bytes it is given: the text a grammar forces comes out as that text, never as a special token.

Why: ``llguidance.hf.from_tokenizer`` hands llguidance the tokenizer's JSON, and the tokenizers
library finds added special tokens in any text it encodes. When a constraint's literal holds a
special token's spelling (a choice of ``"<|im_end|>"``, a regex ``a<\\|im_start\\|>``), llguidance
tokenized the forced bytes to the special token, put it in the mask, and then refused it when it
was sampled (a special token is never text to the parser): the request failed with a 500. The same
befell a SentencePiece tokenizer's literal U+2581 (``"\\u2581x"``), whose tokenization spells a
space. Here the table is llguidance's own (the same bytes, the same special ids); a tokenization
that holds a special token or does not spell the bytes is replaced by llguidance's greedy one over
the table, which never yields a special token.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
from llguidance._tokenizer import TokenizerWrapper


class _SpelledTokenize:
    """What ``TokenizerWrapper`` reads: the table, the special ids, and bytes -> ids that spell them."""

    def __init__(self, base: llguidance.LLTokenizer) -> None:
        self._base = base
        self.eos_token_id = base.eos_token
        self.bos_token_id = None
        self.tokens = [base.decode_bytes([i]) for i in range(base.vocab_size)]
        self.special_token_ids = [i for i in range(base.vocab_size) if base.is_special_token(i)]
        self._special = frozenset(self.special_token_ids)

    def __call__(self, data: bytes) -> list[int]:
        ids = list(self._base.tokenize_bytes(data))
        if self._special.isdisjoint(ids) and b"".join(self.tokens[i] for i in ids) == data:
            return ids  # the tokenizer's own (canonical) tokens
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:  # a piece of a character: the greedy walk takes text alone
            return ids
        return list(self._base.greedy_tokenize(text))


def text_tokenizer(hf_tokenizer: Any, n_vocab: int, eos_token_ids: list[int] | None) -> llguidance.LLTokenizer:
    """llguidance's tokenizer of ``hf_tokenizer`` whose tokenize spells its bytes in ordinary tokens."""
    base = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token_ids)
    return llguidance.LLTokenizer(TokenizerWrapper(_SpelledTokenize(base)), n_vocab=n_vocab, eos_token=base.eos_tokens)
