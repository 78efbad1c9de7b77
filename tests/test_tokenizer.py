"""Tokenizer wrapper and streaming detokenization."""

from __future__ import annotations

import random

import pytest

from conftest import TINY_CORPUS, make_sentencepiece_tokenizer, make_tiny_tokenizer
from pagedrs.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(folder)
    return Tokenizer.from_folder(folder)


def _stream(tok: Tokenizer, prompt: list[int], output: list[int], chunk_sizes: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, i, c = [], 0, 0
    while i < len(output):
        n = chunk_sizes[c % len(chunk_sizes)]
        deltas.append(detok.step(output[i : i + n]))
        i, c = i + n, c + 1
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("chunks", [[1], [2, 1, 3]])
def test_deltas_concatenate_to_full_decode_and_never_split_characters(tiny_tokenizer, chunks):
    text = "naïve café 東京 🙂🚀 ✓ résumé über"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    # byte-level pieces: a multi-byte character spans several tokens here
    assert len(ids) > len(text)
    prompt = tiny_tokenizer.encode("The quick", add_special_tokens=False)
    deltas = _stream(tiny_tokenizer, prompt, ids, chunks)
    assert "".join(deltas) == tiny_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some steps had to hold an incomplete character back


def test_random_token_streams_match_full_decode(tiny_tokenizer):
    """Random ids, including ones that never form valid UTF-8 alone: after flush the text equals decode()."""
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, tiny_tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        detok = IncrementalDetokenizer(tiny_tokenizer, [])
        for t in ids:
            detok.step([t])
        detok.flush()
        assert detok.text == tiny_tokenizer.decode(ids)


def test_skip_special_tokens(tiny_tokenizer):
    eos = tiny_tokenizer.hf.eos_token_id
    ids = tiny_tokenizer.encode("lazy dog", add_special_tokens=False) + [eos]
    detok = IncrementalDetokenizer(tiny_tokenizer, [], skip_special_tokens=True)
    detok.step(ids)
    assert detok.text == "lazy dog"
    kept = IncrementalDetokenizer(tiny_tokenizer, [], skip_special_tokens=False)
    kept.step(ids)
    assert kept.text == "lazy dog<|im_end|>"


def test_encode_decode_roundtrip_and_eos(tiny_tokenizer):
    for line in TINY_CORPUS:
        assert tiny_tokenizer.decode(tiny_tokenizer.encode(line, add_special_tokens=False)) == line
    assert tiny_tokenizer.eos_token_ids == {tiny_tokenizer.hf.convert_tokens_to_ids("<|im_end|>")}
    assert tiny_tokenizer.vocab_size == len(tiny_tokenizer.hf)


def test_chat_template(tiny_tokenizer):
    ids = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_embedded_tokenizer_chat_and_stream(smollm2):
    tok = smollm2.tokenizer
    assert tok.eos_token_ids == {2}
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    out = tok.encode(" café 🙂 東京", add_special_tokens=False)
    deltas = _stream(tok, ids, out, [1])
    assert "".join(deltas) == " café 🙂 東京"


def _two_decode_emit(detok: IncrementalDetokenizer, hold_incomplete: bool) -> str:
    """The detokenizer's window algorithm as it was before the one-decode shortcut: the reference."""
    decode = detok.tokenizer.decode
    prefix_text = decode(detok.ids[detok.prefix_offset : detok.read_offset], detok.skip_special_tokens)
    new_text = decode(detok.ids[detok.prefix_offset :], detok.skip_special_tokens)
    if len(new_text) <= len(prefix_text) or (hold_incomplete and new_text.endswith("\ufffd")):
        return ""
    delta = new_text[len(prefix_text) :]
    detok.prefix_offset, detok.read_offset = detok.read_offset, len(detok.ids)
    detok.text += delta
    return delta


def test_one_decode_a_step_gives_the_two_decode_deltas_on_a_byte_level_tokenizer(smollm2, monkeypatch):
    """SmolLM2's byte-level BPE: the shortcut (decode only the new tokens where the window ends on a
    whole character) against the two-decode window, delta by delta, on random streams built to break
    it: tokens that are fragments of a multi-byte character, special tokens (skipped or not), prompts
    that end inside a character, several tokens a step, and the flush of an incomplete end."""
    tok = smollm2.tokenizer
    assert tok.decodes_by_bytes
    rng = random.Random(3)
    fragments = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])][:300]
    special = sorted(tok.hf.all_special_ids)
    assert len(fragments) > 50 and special

    def pick() -> int:
        r = rng.random()
        return rng.choice(special) if r < 0.05 else rng.choice(fragments) if r < 0.5 else rng.randrange(tok.vocab_size)

    counts = {"decodes": 0, "steps": 0}
    real_decode = tok.decode

    def counted_decode(*args, **kwargs):
        counts["decodes"] += 1
        return real_decode(*args, **kwargs)

    for trial in range(400):
        prompt = [pick() for _ in range(rng.randrange(0, 9))]
        output = [pick() for _ in range(rng.randrange(1, 30))]
        skip = rng.random() < 0.8
        runs = {}
        for way in ("reference", "shortcut"):
            detok = IncrementalDetokenizer(tok, prompt, skip)
            if way == "reference":
                monkeypatch.setattr(detok, "_emit", lambda hold_incomplete, d=detok: _two_decode_emit(d, hold_incomplete))
            else:
                monkeypatch.setattr(tok, "decode", counted_decode)
            r2 = random.Random(trial)
            deltas, i = [], 0
            while i < len(output):
                n = r2.choice([1, 1, 1, 2, 3])
                deltas.append(detok.step(output[i : i + n]))
                i += n
                counts["steps"] += way == "shortcut"
            deltas.append(detok.flush())
            monkeypatch.setattr(tok, "decode", real_decode)
            runs[way] = (deltas, detok.text)
        assert runs["shortcut"] == runs["reference"], (prompt, output, skip)
    # the reference decodes twice a step; the shortcut about once (twice on a step after a held fragment)
    assert counts["decodes"] < 1.5 * counts["steps"], counts


# ---- token_bytes: each token's raw bytes (logprobs' ``bytes``) ----------------------------

SPLIT_TEXTS = [*TINY_CORPUS, "我喜欢吃 😀🎉", "Reply with only emoji: 😀🎉", " café 🙂 東京"]


def _gpt2_bytes(tok: Tokenizer, token_id: int) -> bytes:
    """The referee for a byte-level BPE: transformers' own copy of GPT-2's byte table."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    return bytes(byte_of[char] for char in tok.hf.convert_ids_to_tokens(token_id))


def _check_token_bytes(tok: Tokenizer, texts: list[str]) -> int:
    """The bytes of each text's tokens end to end are its UTF-8; returns how many of the tokens are
    not whole UTF-8 on their own (the case a per-token decode gets wrong)."""
    split = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.token_bytes(i) for i in ids]
        assert all(p is not None for p in pieces), text
        assert b"".join(p for p in pieces if p is not None) == text.encode("utf-8"), text
        split += sum(tok.decode([i]) == "\ufffd" for i in ids)
    return split


def test_token_bytes_of_a_byte_level_bpe_rebuild_the_text(tiny_tokenizer):
    assert _check_token_bytes(tiny_tokenizer, SPLIT_TEXTS) >= 10
    for token_id in range(tiny_tokenizer.vocab_size):
        if token_id not in tiny_tokenizer.special_token_ids:
            assert tiny_tokenizer.token_bytes(token_id) == _gpt2_bytes(tiny_tokenizer, token_id), token_id
    assert tiny_tokenizer.token_bytes(tiny_tokenizer.hf.eos_token_id) == b"<|im_end|>"
    assert tiny_tokenizer.token_bytes(tiny_tokenizer.vocab_size + 5) is None  # no such token


def test_token_bytes_of_the_embedded_tokenizer(smollm2):
    tok = smollm2.tokenizer
    assert _check_token_bytes(tok, SPLIT_TEXTS) >= 10
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1 and [_gpt2_bytes(tok, i) for i in ids] == [tok.token_bytes(i) for i in ids]
    assert tok.token_bytes(tok.hf.convert_tokens_to_ids("<|im_start|>")) == b"<|im_start|>"


def test_token_bytes_of_added_tokens_are_what_a_decode_gives(tmp_path):
    """An added token's string goes through the byte-level decoder as the vocabulary's do."""
    make_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    tok.hf.add_tokens(["a b", "\u0120x", "<tool>"])
    for piece in ("a b", "\u0120x", "<tool>"):
        token_id = tok.hf.convert_tokens_to_ids(piece)
        assert tok.token_bytes(token_id) == tok.decode([token_id], skip_special_tokens=False).encode()


def test_token_bytes_of_a_sentencepiece_byte_fallback_tokenizer(tmp_path):
    make_sentencepiece_tokenizer(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    text = "The quick 我 😀"
    ids = tok.encode(text, add_special_tokens=False)
    assert "<0xE6>" in tok.hf.convert_ids_to_tokens(ids)
    # the leading U+2581 the normalizer prepends is a space in the bytes; a decode strips it
    assert b"".join(tok.token_bytes(i) or b"?" for i in ids) == b" " + text.encode()
    assert tok.token_bytes(tok.hf.convert_tokens_to_ids("<0xE6>")) == b"\xe6"
    assert tok.token_bytes(tok.hf.convert_tokens_to_ids("\u2581q")) == b" q"
    assert tok.token_bytes(tok.hf.convert_tokens_to_ids("</s>")) == b"</s>"


def test_token_bytes_of_an_unknown_decoder_never_hide_bytes(tmp_path):
    """A decoder this does not read: a token's bytes are its decode's UTF-8, or None (unknown) where
    that decode has U+FFFD, never the replacement character's bytes."""
    from tokenizers import decoders

    make_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    tok.hf.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Fuse()])
    ids = tok.encode("我 The", add_special_tokens=False)
    assert tok.decode([ids[0]]) == "\ufffd"
    assert tok.token_bytes(ids[0]) is None
    assert tok.token_bytes(ids[-1]) == tok.decode([ids[-1]]).encode() == b"The"


def test_text_that_is_not_valid_unicode_is_a_value_error_naming_the_character(tiny_tokenizer):
    """A lone surrogate (a terminal's undecodable byte read with surrogateescape, JSON's "\\ud800"): the
    tokenizers library raised a TypeError that named nothing, and `pagedrs chat` died of it."""
    with pytest.raises(ValueError, match=r"not valid Unicode: surrogates not allowed \(character '\\udcff' at index 1\)"):
        tiny_tokenizer.encode("a\udcffb")
    assert tiny_tokenizer.decode(tiny_tokenizer.encode("ab", add_special_tokens=False)) == "ab"  # valid text goes through


def test_byte_fallback_streams_match_full_decode(tmp_path):
    """A byte-fallback decode turns every byte of a run that is not valid UTF-8 as a whole into U+FFFD,
    its valid bytes too: the stream emitted a run's first bytes ("^R") before the invalid ones came, and
    its text ("n^R\\ufffd\\ufffd\\ufffd") was not the ids' decode ("n" and five U+FFFD), nor what stop
    strings and logprobs saw. A run is held until it ends; random streams over prompts with and
    without context now give the decode's text."""
    make_sentencepiece_tokenizer(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    assert len(tok.byte_fallback_ids) == 256
    byte = {b: tok.hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    letters = [tok.hf.convert_tokens_to_ids(c) for c in "Thequick"] + [tok.hf.convert_tokens_to_ids("\u2581q")]
    probe = [tok.hf.convert_tokens_to_ids("n")] + [byte[b] for b in (0x5E, 0x52, 0xAD, 0xAD, 0x30)]
    rng = random.Random(3)
    streams = [probe, probe + letters[:2]]
    interesting = [0x5E, 0x30, 0xAD, 0xE6, 0x88, 0x91, 0xF0, 0x9F, 0x98, 0x80, 0xC3, 0xA9]
    for _ in range(200):
        streams.append([rng.choice(letters) if rng.random() < 0.3 else byte[rng.choice(interesting)]
                        for _ in range(rng.randrange(1, 14))])
    for ids in streams:
        for prompt in ([], tok.encode("The quick")):
            detok = IncrementalDetokenizer(tok, prompt)
            deltas = [detok.step([t]) for t in ids] + [detok.flush()]
            whole = tok.decode(prompt + ids)
            assert "".join(deltas) == detok.text
            assert tok.decode(prompt) + detok.text == whole or (not prompt and detok.text == tok.decode(ids)), ids
