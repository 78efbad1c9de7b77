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

        from pagedrs import gguf_reader
        from pagedrs.gguf_reader import header_in_memory_everywhere
        from pagedrs.gguf_tokenizer import check_tokenizer_fields

        path = Path(path)
        with header_in_memory_everywhere():
            try:
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
            except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
                # the malformed field by its key (transformers' own errors name none); checked only on a
                # failure: reading the lists again costs ~2.4 s for SmolLM2's 49,152 tokens
                check_tokenizer_fields(gguf_reader.reader(path), path, byte_of_char())
                raise ValueError(f"cannot build a tokenizer from GGUF file {str(path)!r} (its 'tokenizer.ggml.*' "
                                 f"metadata): {e}; to run it without one, {SKIP_TOKENIZER_HINT}") from e
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

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes token ``token_id`` stands for (a piece of a multi-byte character included:
        the bytes of all of an output's tokens end to end are its text's UTF-8), or None where they
        are not known: an id with no token, or one ``_token_bytes_table`` could not read (then
        a decode of the token alone has U+FFFD, which would hide its real bytes). A lookup in a
        table built on first use."""
        table = self._token_bytes_table
        return table[token_id] if 0 <= token_id < len(table) else None

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids that ``decode(..., skip_special_tokens=True)`` leaves out: the fast tokenizer's
        added tokens marked special (it is the one that skips them), else transformers' list."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return frozenset(int(i) for i in self.hf.all_special_ids)
        return frozenset(int(i) for i, token in backend.get_added_tokens_decoder().items() if token.special)

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """The ``<0xNN>`` tokens of a decoder with byte fallback (Llama 2's, Mistral's): a decode turns a run
        of them into its UTF-8, or, when the run as a whole is not valid UTF-8, every byte of it into
        U+FFFD, its valid bytes too. So text read from a run before it ends may be taken back by its
        last byte (``IncrementalDetokenizer`` holds a run until it ends). Empty for any other decoder."""
        import json
        import re

        backend = getattr(self.hf, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        try:
            state = json.dumps(json.loads(decoder.__getstate__())) if decoder is not None else ""
        except (AttributeError, TypeError, ValueError):
            return frozenset()
        if '"ByteFallback"' not in state:
            return frozenset()
        byte = re.compile(r"<0x[0-9A-Fa-f]{2}>")
        return frozenset(i for token, i in self.hf.get_vocab().items() if byte.fullmatch(token))

    @functools.cached_property
    def _token_bytes_table(self) -> list[bytes | None]:
        """Every token's bytes, by id (``token_bytes``).

        Read from the token's string where the decoder is one this knows: a byte-level BPE's
        (GPT-2, SmolLM2, Llama 3, Qwen: each character of the string is one byte through GPT-2's
        byte-to-unicode table, a character outside it its own UTF-8, as the decoder does, added
        tokens included) or a SentencePiece one (Llama 2: ``<0xE6>`` is that byte when the decoder
        has byte fallback, "\u2581" a space, the rest its UTF-8). Each entry is then checked
        against a decode of the token alone (lossy UTF-8 of the bytes, less the one leading space a
        SentencePiece decode strips); where that disagrees, or the decoder is of another kind, the
        entry falls back to that decode's UTF-8 when it has no U+FFFD, else None (unknown: never the
        replacement character's bytes standing in for the token's own)."""
        hf = self.hf
        backend = getattr(hf, "backend_tokenizer", None)
        size = len(hf)
        ids = [[i] for i in range(size)]
        if backend is not None:
            decoded = [str(t) for t in backend.decode_batch(ids, skip_special_tokens=False)]
        else:  # a slow tokenizer: one decode a token (still only once)
            decoded = [str(hf.decode(i, skip_special_tokens=False, clean_up_tokenization_spaces=False)) for i in ids]
        kind = _decoder_kind(backend)
        pieces = hf.convert_ids_to_tokens(list(range(size))) if kind is not None else [None] * size
        table: list[bytes | None] = []
        for piece, text in zip(pieces, decoded, strict=True):
            raw = _piece_bytes(kind, piece) if kind is not None and isinstance(piece, str) else None
            if raw is not None and _shown(kind, raw.decode("utf-8", "replace")) == _shown(kind, text):
                table.append(raw)
            else:
                table.append(None if _REPLACEMENT_CHAR in text else text.encode())
        return table

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a ValueError for text that is not valid Unicode (a lone surrogate, as a
        terminal's undecodable byte or JSON's ``"\\ud800"`` gives), which the tokenizers library refused with
        a TypeError that named nothing."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the text is not valid Unicode: {exc.reason} (character {exc.object[exc.start]!r} "
                             f"at index {exc.start})") from None
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


@functools.cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the printable Latin-1 bytes stand for themselves, the
    other bytes, in order, for U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {b: b for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = 256 + n
    return {chr(c): b for b, c in chars.items()}


def _decoder_kind(backend: Any) -> str | None:
    """"byte-level", "sentencepiece" / "sentencepiece+bytes" (byte fallback), or None: a decoder
    whose tokens' bytes ``_piece_bytes`` cannot read (``Tokenizer._token_bytes_table``)."""
    import json

    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    if state.get("type") == "ByteLevel":
        return "byte-level"
    steps = state.get("decoders", []) if state.get("type") == "Sequence" else [state]
    kinds = [step.get("type") for step in steps]
    spaces = [step for step in steps if step.get("type") == "Metaspace" and step.get("replacement") == _SPACE_MARK
              or step.get("type") == "Replace" and step.get("pattern") == {"String": _SPACE_MARK}
              and step.get("content") == " "]
    known = all(kind in ("Metaspace", "Replace", "ByteFallback", "Fuse", "Strip") for kind in kinds)
    if not known or len(spaces) != len([k for k in kinds if k in ("Metaspace", "Replace")]) or not spaces:
        return None
    if any(step.get("type") == "Strip" and (step.get("content") != " " or step.get("stop") != 0
                                            or step.get("start", 0) > 1) for step in steps):
        return None
    return "sentencepiece+bytes" if "ByteFallback" in kinds else "sentencepiece"


_SPACE_MARK = "\u2581"  # SentencePiece's word boundary, a space in text


def _piece_bytes(kind: str, piece: str) -> bytes | None:
    """A token string's bytes under a ``_decoder_kind``."""
    if kind == "byte-level":
        table = byte_of_char()
        try:
            return bytes([table[c] for c in piece])
        except KeyError:  # a character outside the table (an added token's) is its own UTF-8, as the decoder has it
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
    if kind == "sentencepiece+bytes" and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(_SPACE_MARK, " ").encode()


def _shown(kind: str | None, text: str) -> str:
    """A token's text as a decode of it alone shows it: a SentencePiece decode strips one leading space."""
    return text[1:] if kind is not None and kind.startswith("sentencepiece") and text.startswith(" ") else text


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

    def token_bytes(self, token_id: int) -> bytes | None:
        """Not known without a tokenizer."""
        return None

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset()

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        return frozenset()

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
    it at the end of a request). With a byte-fallback decoder a run of ``<0xNN>`` tokens
    is held until a token of another kind ends it: the decode of a run that is not valid
    UTF-8 as a whole is one U+FFFD a byte, its valid bytes included, so text emitted from
    the run's start (``"^R"`` before two bytes 0xAD) would differ from the text's decode.
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
        self._run_ids: frozenset[int] = getattr(tokenizer, "byte_fallback_ids", frozenset())

    def step(self, new_token_ids: list[int]) -> str:
        self.ids.extend(new_token_ids)
        if self._run_ids and len(self.ids) > self.read_offset and self.ids[-1] in self._run_ids:
            return ""  # a byte run not yet ended: its decode may still turn to U+FFFD
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
