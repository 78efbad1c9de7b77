"""Tokenizer: text <-> token ids and chat templates, plus streaming detokenization.

Both sources (a Hugging Face folder's tokenizer.json, or a GGUF file's metadata)
go through transformers' fast tokenizer, always with ``local_files_only`` so that
nothing is ever fetched from a hub.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence

# Files from which transformers can build a tokenizer; a folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model")
SKIP_TOKENIZER_HINT = "pass EngineArgs(skip_tokenizer_init=True) (--skip-tokenizer-init) and give prompts as token ids"


class Tokenizer:
    # whether decode() can give anything but "": the front end detokenizes only then
    makes_text: bool = True

    def __init__(self, hf_tokenizer: Any, eos_token_ids: set[int] | None = None) -> None:
        self.hf = hf_tokenizer
        eos = set(eos_token_ids or ())
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: set[int] = eos

    @classmethod
    def from_folder(cls, folder: str | Path, eos_token_ids: set[int] | None = None) -> Tokenizer:
        from transformers import AutoTokenizer

        if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(
                f"model folder {str(folder)!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
                f"to run it without a tokenizer, {SKIP_TOKENIZER_HINT}"
            )
        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"cannot load a tokenizer from folder {str(folder)!r}: {e}; to run it without one, {SKIP_TOKENIZER_HINT}"
            ) from e
        return cls(tok, eos_token_ids)

    @classmethod
    def from_gguf(cls, path: str | Path, eos_token_ids: set[int] | None = None) -> Tokenizer:
        """Built by transformers from the GGUF metadata (slow: the GGUF loader caches the result as a folder;
        its reader parses the header from memory, ``pagedrs.gguf_reader``)."""
        from transformers import AutoTokenizer

        from pagedrs.gguf_reader import header_in_memory_everywhere

        path = Path(path)
        with header_in_memory_everywhere():
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        return cls(tok, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @functools.cached_property
    def decodes_by_bytes(self) -> bool:
        """Whether a decode is the UTF-8 of the tokens' bytes put end to end (a byte-level BPE:
        GPT-2's, SmolLM2's, Llama 3's), with no cleanup of spaces. Then decoding a run of tokens
        at once gives the text that decoding it in pieces cut at character boundaries gives. Not
        so for a SentencePiece decoder, which strips a decode's leading space and turns every
        byte of an invalid byte-fallback run into U+FFFD, so that where a decode starts matters."""
        try:
            from tokenizers import decoders
        except ImportError:  # pragma: no cover - transformers' fast tokenizers need it
            return False
        backend = getattr(self.hf, "backend_tokenizer", None)
        return (isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
                and not getattr(self.hf, "clean_up_tokenization_spaces", True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The model's own chat template (given ``tools`` when set), rendered to text and then encoded
        without extra special tokens."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass a plain prompt instead")
        text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


class TokenIdsOnly(Tokenizer):
    """The tokenizer of an engine built with ``skip_tokenizer_init=True``, as in vLLM.

    Token-id prompts need nothing from a tokenizer, and outputs carry token ids with
    empty text; every use that needs text (a text prompt, a chat template, stop
    strings) raises a ValueError that names the option. EOS ids come from the config,
    so generation still stops where the model says. A subclass so that every consumer of
    a Tokenizer takes it as one.
    """

    makes_text = False  # every decode is "": outputs carry token ids only (vLLM's detokenize=False)

    def __init__(self, eos_token_ids: set[int] | None = None) -> None:  # no super().__init__: no hf tokenizer to wrap
        self.hf = None
        self.eos_token_ids = set(eos_token_ids or ())

    @property
    def vocab_size(self) -> int:
        raise self.refuse("the tokenizer's vocabulary size")

    @staticmethod
    def refuse(what: str) -> ValueError:
        return ValueError(
            f"{what} needs a tokenizer, but the engine was built with skip_tokenizer_init=True; "
            "give prompts as token ids ({'prompt_token_ids': [...]})"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise self.refuse("a text prompt")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    @functools.cached_property
    def decodes_by_bytes(self) -> bool:
        """Every decode is "": at once or in pieces, the same."""
        return True

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        raise self.refuse("a chat conversation")


class IncrementalDetokenizer:
    """Text deltas of a growing output, never splitting a multi-byte character.

    Decodes only a short window: ``ids[prefix_offset:read_offset]`` is text already
    emitted, ``ids[prefix_offset:]`` is that plus the new tokens. Decoding with a few
    tokens of left context keeps tokenizers that drop a leading space at the start of
    a decode (SentencePiece) right. A window that ends in U+FFFD is an incomplete
    byte sequence: it is held back until the next token completes it (``flush`` emits
    it at the end of a request).
    """

    _CONTEXT = 5  # tokens of already-emitted left context

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids)
        self.prompt_len = len(self.ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - self._CONTEXT, 0)
        self.text = ""
        # a byte-level tokenizer (``Tokenizer.decodes_by_bytes``) decodes a run of tokens as the UTF-8 of
        # their bytes put end to end: where the window's text ends on a whole character (no U+FFFD),
        # ``_emit`` decodes only the new tokens. Known only once the window has been decoded.
        self._by_bytes = tokenizer.decodes_by_bytes
        self._clean = False

    def step(self, new_token_ids: list[int]) -> str:
        self.ids.extend(new_token_ids)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """Emit whatever is held back (an output that really ends in an invalid byte sequence)."""
        return self._emit(hold_incomplete=False)

    def finish_at_once(self, new_token_ids: list[int]) -> str:
        """What ``step`` of each token of ``new_token_ids`` and then ``flush`` emit: for a sample
        whose text nobody reads before it ends (a final-only output without stop strings). With a
        tokenizer that ``decodes_by_bytes``, one decode of the whole window from the left context
        the first ``step`` would have (two decodes per token otherwise); with any other, the steps
        themselves, since only they give exactly their text (tests/test_output_kind.py compares
        both ways on real tokenizers)."""
        if not self.tokenizer.decodes_by_bytes:
            return "".join([self.step([token]) for token in new_token_ids]) + self.flush()
        self.ids.extend(new_token_ids)
        return self._emit(hold_incomplete=False)

    def restarted(self) -> IncrementalDetokenizer:
        """A detokenizer at this one's start (the prompt only), whatever this one has seen."""
        return IncrementalDetokenizer(self.tokenizer, self.ids[: self.prompt_len], self.skip_special_tokens)

    def _emit(self, hold_incomplete: bool) -> str:
        decode = self.tokenizer.decode
        if self._clean:
            # a byte-level decode whose window ends where UTF-8 decoding is back in its initial state:
            # decode(window + new) is decode(window) + decode(new), so the new tokens alone give the
            # delta (one decode a step instead of two; the same text, tests/test_tokenizer.py)
            delta = decode(self.ids[self.read_offset :], self.skip_special_tokens)
            if not delta or (hold_incomplete and delta.endswith(_REPLACEMENT_CHAR)):
                return ""
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._clean = not delta.endswith(_REPLACEMENT_CHAR)  # the new window's own text is the delta
            self.text += delta
            return delta
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        if self._by_bytes and not prefix_text.endswith(_REPLACEMENT_CHAR):
            self._clean = True  # nothing pending at the window's end: from here on, one decode a step
            return self._emit(hold_incomplete)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or (hold_incomplete and new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
