"""Tokenizer wrapper and streaming detokenization."""

from __future__ import annotations

import random

import pytest

from conftest import TINY_CORPUS, make_tiny_tokenizer
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
