"""Logprobs of tokens that are pieces of a multi-byte character (an emoji's, a CJK character's),
on the fake engine with a real tokenizer (the tests' tiny byte-level BPE, which splits every
character outside its corpus into bytes).

Chat: ``bytes`` is each token's raw bytes, so that the content's UTF-8 is them end to end, and
each top alternative's bytes are its own token's; ``token`` is never U+FFFD standing for real
bytes (a piece of a character shows as "bytes:\\xe6\\x88"). Legacy completions: the tokens are the
text wherever they are whole characters, ``text_offset`` is each token's character in the text
(with echo too), and a stream gives the same entries as a whole response.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest import make_sentencepiece_tokenizer, make_tiny_tokenizer  # noqa: E402
from pagedrs.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedrs.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402
from server_fakes import MODEL, FakeEngine, Served, served_factory  # noqa: E402

# CJK and emoji the tiny tokenizer has no merges for (bytes, split across tokens), between ones it has
ANSWER = "我喜欢吃 😀🎉 東京 naïve ✓"
PROMPT = "吃 😀 The quick"


class ScriptedEngine(FakeEngine):
    """The fake engine with a real tokenizer, whose every sample is ANSWER's tokens (over again);
    asked for logprobs, each position ranks its token first and the script's next tokens after it
    (pieces of characters among them); asked for prompt logprobs, the prompt's the same way."""

    def __init__(self, tokenizer: Tokenizer, answer: str = ANSWER) -> None:
        super().__init__(max_model_len=256)
        self.tokenizer = tokenizer  # type: ignore[assignment]
        self.vocab_size = tokenizer.vocab_size
        self.script = tokenizer.encode(answer, add_special_tokens=False)

    def entry(self, token: int, alternatives: list[int], k: int) -> dict[int, float]:
        others = [t for t in dict.fromkeys(alternatives) if t != token][:k]
        return {token: -0.25, **{t: -1.0 - rank for rank, t in enumerate(others)}}

    def step(self) -> list[RequestOutput]:
        self._apply_inbox()
        self._record("step", None)
        outputs = []
        for request_id, r in list(self._requests.items()):
            params = r["params"]
            first = "detokenizers" not in r
            detokenizers = r.setdefault("detokenizers", [
                IncrementalDetokenizer(self.tokenizer, r["ids"], params.skip_special_tokens) for _ in r["samples"]])
            completions = []
            for index, tokens in enumerate(r["samples"]):
                at = len(tokens) % len(self.script)
                token = self.script[at]
                tokens.append(token)
                done = len(tokens) >= params.max_tokens
                detok = detokenizers[index]
                delta = detok.step([token]) + (detok.flush() if done else "")
                completion = CompletionOutput(index, detok.text, tokens, delta, [token], "length" if done else None)
                if params.logprobs is not None:
                    completion.logprobs = [self.entry(token, self.script[at + 1:] + self.script, params.logprobs)]
                completions.append(completion)
            finished = all(c.finish_reason for c in completions)
            output = RequestOutput(request_id, None, r["ids"], completions, finished)
            output.num_cached_tokens = r["cached"]  # type: ignore[attr-defined]
            if first and params.prompt_logprobs is not None:
                ids = r["ids"]
                output.prompt_logprobs = [None] + [
                    self.entry(ids[p], ids[p + 1:] + self.script, params.prompt_logprobs) for p in range(1, len(ids))]
            outputs.append(output)
            if finished:
                del self._requests[request_id]
        return outputs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tiny_tokenizer(folder)
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def make_module_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


@pytest.fixture(scope="module")
def served(make_module_served: Callable[..., Served], tokenizer: Tokenizer) -> Served:
    return make_module_served(ScriptedEngine(tokenizer))


def _post(served: Served, path: str, body: dict[str, Any]) -> Any:
    reply = httpx.post(served.url + path, json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _events(served: Served, path: str, body: dict[str, Any]) -> list[Any]:
    reply = httpx.post(served.url + path, json={"model": MODEL, "stream": True, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    data = [line[len("data: "):] for line in reply.text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _bytes_of(tokenizer: Tokenizer, token_id: int) -> bytes:
    """A byte-level BPE token's bytes, read by the referee: transformers' own GPT-2 byte table."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    return bytes(byte_of[char] for char in tokenizer.hf.convert_ids_to_tokens(token_id))


def _whole_answer_tokens(tokenizer: Tokenizer) -> int:
    return len(tokenizer.encode(ANSWER, add_special_tokens=False))


CHAT = {"messages": [{"role": "user", "content": "Reply with only emoji: 😀🎉"}], "logprobs": True, "top_logprobs": 2}


def test_the_script_splits_characters_across_tokens(tokenizer: Tokenizer) -> None:
    """The premise: some of ANSWER's tokens are not whole UTF-8 on their own."""
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(ANSWER, add_special_tokens=False)]
    assert sum("\ufffd" in p for p in pieces) >= 6


def test_chat_bytes_rebuild_the_content(served: Served, tokenizer: Tokenizer) -> None:
    response = _post(served, "/v1/chat/completions", {**CHAT, "max_tokens": _whole_answer_tokens(tokenizer)})
    choice = response["choices"][0]
    assert choice["message"]["content"] == ANSWER
    content = choice["logprobs"]["content"]
    assert b"".join(bytes(entry["bytes"]) for entry in content) == ANSWER.encode("utf-8")
    for entry in content:
        raw = bytes(entry["bytes"])
        assert "\ufffd" not in entry["token"]
        try:
            assert entry["token"] == raw.decode("utf-8")
        except UnicodeDecodeError:
            assert entry["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]
        assert all("\ufffd" not in top["token"] for top in entry["top_logprobs"])


def test_chat_top_logprobs_carry_their_own_bytes(served: Served, tokenizer: Tokenizer) -> None:
    script = served.engine.script
    response = _post(served, "/v1/chat/completions", {**CHAT, "max_tokens": 4})
    for at, entry in enumerate(response["choices"][0]["logprobs"]["content"]):
        expected = [script[at], *[t for t in dict.fromkeys(script[at + 1:] + script) if t != script[at]][:1]]
        assert [bytes(top["bytes"]) for top in entry["top_logprobs"]] == [_bytes_of(tokenizer, t) for t in expected]


def test_chat_stream_gives_the_same_logprobs(served: Served, tokenizer: Tokenizer) -> None:
    body = {**CHAT, "max_tokens": _whole_answer_tokens(tokenizer)}
    whole = _post(served, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    streamed = [entry for event in _events(served, "/v1/chat/completions", body) for choice in event["choices"]
                if choice.get("logprobs") for entry in choice["logprobs"]["content"]]
    assert streamed == whole
    assert b"".join(bytes(entry["bytes"]) for entry in streamed) == ANSWER.encode("utf-8")


def _check_legacy(text: str, logprobs: dict[str, Any]) -> None:
    """Every whole-character token is the text at its offset; the offsets are where each token's
    bytes start (the character they start in), counted over the tokens' bytes."""
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(tokens) == len(offsets)
    data = b""
    for token, offset in zip(tokens, offsets, strict=True):
        assert "\ufffd" not in token
        if token.startswith("bytes:"):
            raw = bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
        else:
            raw = token.encode()
            assert text[offset:offset + len(token)] == token
        # the character token's first byte is in: the text's characters before that byte's
        assert offset == (len((data + raw[:1]).decode("utf-8", "replace")) - 1 if raw else len(data.decode()))
        data += raw
    assert data.decode("utf-8") == text


def test_legacy_tokens_and_offsets_follow_the_text(served: Served, tokenizer: Tokenizer) -> None:
    body = {"prompt": PROMPT, "logprobs": 3, "max_tokens": _whole_answer_tokens(tokenizer)}
    choice = _post(served, "/v1/completions", body)["choices"][0]
    assert choice["text"] == ANSWER
    _check_legacy(choice["text"], choice["logprobs"])
    assert sum(t.startswith("bytes:") for t in choice["logprobs"]["tokens"]) >= 6
    assert all("\ufffd" not in key for top in choice["logprobs"]["top_logprobs"] for key in top)


def test_legacy_echo_offsets_follow_prompt_and_answer(served: Served, tokenizer: Tokenizer) -> None:
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": _whole_answer_tokens(tokenizer)}
    choice = _post(served, "/v1/completions", body)["choices"][0]
    assert choice["text"] == PROMPT + ANSWER
    _check_legacy(choice["text"], choice["logprobs"])
    assert choice["logprobs"]["token_logprobs"][0] is None


@pytest.mark.parametrize("echo", [False, True])
def test_legacy_stream_gives_the_same_logprobs(served: Served, tokenizer: Tokenizer, echo: bool) -> None:
    body = {"prompt": PROMPT, "echo": echo, "logprobs": 2, "max_tokens": _whole_answer_tokens(tokenizer) - 3}
    whole = _post(served, "/v1/completions", body)["choices"][0]
    events = _events(served, "/v1/completions", body)
    parts = [choice["logprobs"] for event in events for choice in event["choices"] if choice.get("logprobs")]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for part in parts for v in part[name]] == whole["logprobs"][name], name
    assert not any("\ufffd" in token for part in parts for token in part["tokens"])
    assert "".join(choice["text"] for event in events for choice in event["choices"]) == whole["text"]


def test_a_special_token_the_text_leaves_out_takes_no_room(make_module_served: Callable[..., Served],
                                                          tokenizer: Tokenizer) -> None:
    served = make_module_served(ScriptedEngine(tokenizer, answer="我喜<|im_end|>欢 😀"))
    n = len(served.engine.script)
    for skip, text in ((True, "我喜欢 😀"), (False, "我喜<|im_end|>欢 😀")):
        body = {"prompt": PROMPT, "logprobs": 1, "max_tokens": n, "skip_special_tokens": skip}
        choice = _post(served, "/v1/completions", body)["choices"][0]
        assert choice["text"] == text
        lp = choice["logprobs"]
        special = lp["tokens"].index("<|im_end|>")
        assert lp["text_offset"][special] == 2
        assert lp["text_offset"][special + 1] == text.index("欢")
        assert lp["text_offset"][-1] == len(text) - 1  # the last of the emoji's bytes


@pytest.mark.parametrize("skip", [True, False])
def test_an_echoed_token_id_prompt_is_decoded_as_the_request_asks(served: Served, tokenizer: Tokenizer,
                                                                  skip: bool) -> None:
    """The echo of a token-id prompt dropped its special tokens even with skip_special_tokens false (it
    was decoded with the default), while the answer kept its own: the echo decodes as the answer does."""
    ids = tokenizer.encode("<|im_start|>The quick<|im_end|>", add_special_tokens=False)
    expected = "<|im_start|>The quick<|im_end|>" if not skip else "The quick"
    assert tokenizer.decode(ids, skip_special_tokens=skip) == expected
    body = {"prompt": ids, "echo": True, "max_tokens": 2, "skip_special_tokens": skip}
    assert _post(served, "/v1/completions", body)["choices"][0]["text"].startswith(expected)


def test_character_count_is_a_lossy_decode_of_the_bytes() -> None:
    """_CharCount against Python's decoder (U+FFFD for each maximal invalid part, as the tokenizer's
    Rust decode): the character a token's first byte is in, however the bytes are cut into tokens,
    valid UTF-8 or not."""
    from pagedrs.server.completions import _CharCount

    rng = random.Random(7)
    alphabet = [b"a", b" ", "é".encode(), "我".encode(), "😀".encode(), b"\xe6", b"\x88", b"\xf0\x9f", b"\x80",
                b"\xed\xa0", b"\xe0\x80", b"\xf4\x90", b"\xff", b"\xc0"]
    for _ in range(300):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12)))
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(0, 6)))) if len(data) > 1 else []
        count, start = _CharCount(0), 0
        for end in [*cuts, len(data)]:
            offset = count.feed(data[start:end])
            assert offset == len(data[:start + 1].decode("utf-8", "replace")) - 1, (data, start)
            start = end
        assert count.chars == len(data.decode("utf-8", "replace")), data


def test_legacy_echo_offsets_with_a_sentencepiece_tokenizer(make_module_served: Callable[..., Served],
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """Llama 2 style: byte-fallback tokens (<0xE6>) are their byte; the echoed prompt leaves out the
    BOS the encode added and the space its first word's U+2581 stands for (a decode strips it)."""
    folder = tmp_path_factory.mktemp("sentencepiece")
    make_sentencepiece_tokenizer(folder)
    tokenizer = Tokenizer.from_folder(folder)
    served = make_module_served(ScriptedEngine(tokenizer, answer="fox 😀"))
    prompt, script = "The quick 我", served.engine.script
    prompt_ids = tokenizer.encode(prompt)
    assert tokenizer.hf.convert_ids_to_tokens(prompt_ids)[:2] == ["<s>", "\u2581T"]
    for echo in (False, True):
        body = {"prompt": prompt, "echo": echo, "logprobs": 1, "max_tokens": len(script)}
        choice = _post(served, "/v1/completions", body)["choices"][0]
        assert choice["text"] == (prompt if echo else "") + " fox 😀"
        ids = (prompt_ids if echo else []) + script
        pieces = [tokenizer.token_bytes(i) or b"" for i in ids]
        assert pieces[-4:] == [bytes([b]) for b in "😀".encode()]
        if echo:  # what the echoed text has of the BOS and the first word
            pieces[0], pieces[1] = b"", pieces[1][1:]
        lp, data = choice["logprobs"], b""
        assert len(lp["tokens"]) == len(ids)
        for raw, offset in zip(pieces, lp["text_offset"], strict=True):
            assert offset == (len((data + raw[:1]).decode("utf-8", "replace")) - 1 if raw else len(data.decode()))
            data += raw
        assert data.decode("utf-8") == choice["text"]


@pytest.mark.parametrize("prompt", [" The quick", "  The  quick", "The quick"])
def test_sentencepiece_echo_offsets_of_a_prompt_that_starts_with_a_space(
        make_module_served: Callable[..., Served], tmp_path_factory: pytest.TempPathFactory, prompt: str) -> None:
    """A prompt that starts with a space encodes to the prepended U+2581 and then its own ("\\u2581",
    "\\u2581T"): the first one matched the text's space, and every offset after it was one on (the
    probe's " The quick": "\\u2581T" at 1, "h" at 3). The prepended one takes no room."""
    folder = tmp_path_factory.mktemp("sentencepiece-space")
    make_sentencepiece_tokenizer(folder)
    tokenizer = Tokenizer.from_folder(folder)
    served = make_module_served(ScriptedEngine(tokenizer, answer="fox"))
    ids = tokenizer.encode(prompt)
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1}
    choice = _post(served, "/v1/completions", body)["choices"][0]
    assert choice["text"].startswith(prompt)
    pieces = [tokenizer.token_bytes(i) or b"" for i in ids]
    pieces[0], pieces[1] = b"", pieces[1][1:]  # the BOS, and the space the encode prepended
    assert b"".join(pieces).decode() == prompt
    expected = [len(b"".join(pieces[:i]).decode()) for i in range(len(ids))]
    assert choice["logprobs"]["text_offset"][:len(ids)] == expected
