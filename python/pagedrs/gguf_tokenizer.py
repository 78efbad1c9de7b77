"""The tokenizer section of a GGUF file checked field by field, naming the key at fault: what transformers'
own errors for a malformed section do not do. ``Tokenizer.from_gguf`` runs it once transformers failed.

(``_meta`` and ``_shown_value`` are ``models/gguf_metadata``'s ``_field`` and ``_shown`` again: that module
sits a layer above this one.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_tokenizer_fields(reader: Any, path: Path, byte_of_char: dict[str, int]) -> None:
    """The tokenizer section's lists as transformers builds a tokenizer from them, refused by key: every
    token a string, every merge two tokens of the list joined by one space whose concatenation is a token
    too, scores numbers and token types integers, one of each per token. Why: transformers' own errors for
    these name no key ("'int' object has no attribute 'split'", "Token `x` out of vocabulary"). Run only
    once transformers has failed (``Tokenizer.from_gguf``); the lists' lengths, which transformers does not
    check, are checked on every load by ``models.gguf_metadata``. ``byte_of_char``: GPT-2's byte alphabet
    (``tokenizer.byte_of_char``, passed in: that module imports this one)."""
    tokens = _meta(reader, "tokenizer.ggml.tokens", [])
    _typed_list("tokenizer.ggml.tokens", tokens, str, "a string", path)
    n = len(tokens)
    for key, kind, what in (("tokenizer.ggml.scores", (int, float), "a number"),
                            ("tokenizer.ggml.token_type", int, "an integer")):
        values = _meta(reader, key)
        if values is None:
            continue
        _typed_list(key, values, kind, what, path)
        if len(values) != n:
            raise ValueError(f"GGUF file {str(path)!r}: metadata field {key!r} has {len(values)} entries; "
                             f"'tokenizer.ggml.tokens' has {n}, and there must be one for each token")
    merges = _meta(reader, "tokenizer.ggml.merges")
    if merges is None:
        return
    _typed_list("tokenizer.ggml.merges", merges, str, "a string", path)
    known = _spellings(tokens, byte_of_char)
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"GGUF file {str(path)!r}: metadata field 'tokenizer.ggml.merges' entry {i} is "
                             f"{merge!r}; a merge is two tokens joined by one space")
        missing = next((t for t in (*parts, parts[0] + parts[1]) if t not in known), None)
        if missing is not None:
            raise ValueError(f"GGUF file {str(path)!r}: metadata field 'tokenizer.ggml.merges' entry {i} "
                             f"({merge!r}) needs token {missing!r}, which 'tokenizer.ggml.tokens' lacks")


def _spellings(tokens: list[str], alphabet: dict[str, int]) -> set[str]:
    """The tokens as written and as transformers' builders respell them before merges are matched: a
    byte-level vocabulary's token outside GPT-2's byte alphabet as its UTF-8 bytes in that alphabet, and
    a token of spaces alone as that many U+2581 (Gemma's). A merge that names either spelling is kept."""
    char_of = {b: c for c, b in alphabet.items()}
    known = set(tokens)
    for t in tokens:
        if not set(t) <= alphabet.keys():
            known.add("".join(char_of[b] for b in t.encode("utf-8", "surrogatepass")))
        if t and not t.strip(" "):
            known.add("\u2581" * len(t))
    return known


def _typed_list(key: str, values: Any, kind: type | tuple[type, ...], what: str, path: Path) -> None:
    if not isinstance(values, list):
        raise ValueError(f"GGUF file {str(path)!r}: metadata field {key!r} is {_shown_value(values)}; expected a list")
    bad = next((i for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, kind)), None)
    if bad is not None:
        raise ValueError(f"GGUF file {str(path)!r}: metadata field {key!r} entry {bad} is {_shown_value(values[bad])}; "
                         f"each entry must be {what}")


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata field's value (gguf-py's ``contents()``), or ``default`` when the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _shown_value(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"
