"""The OpenAI-compatible server, end to end: a real Engine on a tiny random llama, a live
uvicorn on 127.0.0.1 (random free port), and the official `openai` client.

Expected outputs come from the offline API (`LLM.generate` / `LLM.chat`) on the same
weights and engine settings, so every comparison is exact.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pagedrs import LLM, SamplingParams  # noqa: E402
from server_fakes import LiveServer, assert_nothing_left, live_server  # noqa: E402

MODEL = "tiny-llama"
# A small pool (24 pages of 8 tokens) so that the load test runs out of pages and preempts.
ENGINE_KW: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=8, num_gpu_blocks=24, max_num_seqs=16, max_model_len=128,
    swap_space_gb=0.01,
)
MAX_MODEL_LEN = ENGINE_KW["max_model_len"]
PROMPTS = [
    "The quick brown fox",
    "Paged attention keeps the KV cache",
    "def main():",
    "naïve café résumé",
]
GREEDY = dict(temperature=0.0, max_tokens=8)


class Served:
    """A live server plus handles on its parts (the test reads metrics and changes max_waiting)."""

    def __init__(self, live: LiveServer) -> None:
        self.engine, self.loop, self.app, self.http, self.url = live.engine, live.loop, live.app, live.http, live.url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels folded into the name as name{k=v})."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, float]:
        """Poll /metrics (bounded) until no request is running, waiting or swapped."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            busy = m["pagedrs_requests_running"] + m["pagedrs_requests_waiting"] + m["pagedrs_requests_swapped"]
            if busy == 0:
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"the server still has {busy} requests after {timeout_s} s")
            time.sleep(0.05)


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def served(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    """The served path on both core clients: every test here must pass on each."""
    with live_server(tiny_llama_dir, ENGINE_KW, MODEL, core_process=request.param == "core-process") as live:
        yield Served(live)


@pytest.fixture(autouse=True)
def nothing_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that used the live server leaves no page, sequence or queued add behind."""
    yield
    if "served" in request.fixturenames:
        assert_nothing_left(request.getfixturevalue("served").loop)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(model=str(tiny_llama_dir), **ENGINE_KW)


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return served.client()


def test_health_and_models(served: Served, client: openai.OpenAI) -> None:
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    for path in ("/health", "/v1/models"):  # load balancers probe with HEAD (a 405 before)
        head = httpx.head(served.url + path)
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)


def test_completions_equal_offline_generate_with_usage(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    response = client.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    assert [c.index for c in response.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in response.choices] == [e.outputs[0].text for e in expected]
    assert [c.finish_reason for c in response.choices] == [e.outputs[0].finish_reason for e in expected]
    assert response.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert response.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_token_id_prompt_equals_text_prompt(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.engine.tokenizer.encode(PROMPTS[1])
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[1], **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage


def test_streaming_equals_non_streaming_for_greedy(client: openai.OpenAI) -> None:
    for prompt in PROMPTS:
        whole = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        chunks = list(client.completions.create(
            model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **GREEDY
        ))
        text_chunks, usage_chunk = chunks[:-1], chunks[-1]
        assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
        assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


def test_raw_event_stream_ends_with_done(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "stream": True, **GREEDY}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1


def test_n_samples_seeded_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    sampling = dict(n=3, temperature=1.0, seed=1234, max_tokens=6)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], **sampling)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) > 1, f"three seeded samples should differ, got {texts}"
    streamed = ["", "", ""]
    finished = [0, 0, 0]
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **sampling):
        choice = chunk.choices[0]
        streamed[choice.index] += choice.text
        finished[choice.index] += choice.finish_reason is not None
    assert streamed == texts and finished == [1, 1, 1]
    assert whole.usage.completion_tokens == 3 * 6  # max_tokens each, as all three ended by "length"
    assert [c.finish_reason for c in whole.choices] == ["length"] * 3


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_streams_send_each_choice_s_finish_once_when_they_end_apart(served: Served, client: openai.OpenAI,
                                                                     endpoint: str) -> None:
    """Choices that end at different steps: each gets exactly one chunk with a finish_reason, and no
    chunk after it (the engine's later outputs repeat a finished sample; the stream must not); the
    finished-requests counter still counts every choice's finish once."""
    finished_before = _finished_requests(served.metrics())
    sampling = dict(n=4, temperature=1.0, seed=77, max_tokens=24, stop=["e", "a"])
    if endpoint == "chat":
        messages = [{"role": "user", "content": PROMPTS[0]}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, **sampling)
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **sampling))
        texts = [c.message.content for c in whole.choices]
        pieces = [(c.choices[0].index, c.choices[0].delta.content or "", c.choices[0].finish_reason)
                  for c in chunks if c.choices]
    else:
        whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], **sampling)
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **sampling))
        texts = [c.text for c in whole.choices]
        pieces = [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason) for c in chunks]
    lengths = {len(t) for t in texts}
    assert len(lengths) > 1, f"the choices must end apart for this test to mean anything: {texts}"
    for index in range(4):
        mine = [p for p in pieces if p[0] == index]
        finishes = [i for i, p in enumerate(mine) if p[2] is not None]
        assert finishes == [len(mine) - 1], (index, mine)  # one finish, and it is the choice's last chunk
        assert "".join(p[1] for p in mine) == texts[index]
        assert mine[-1][2] == whole.choices[index].finish_reason
    assert _finished_requests(served.metrics()) - finished_before == 8  # 4 choices, streamed and not


def test_stop_string_cuts_the_text_before_it(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS[2], temperature=0.0, max_tokens=16).choices[0].text
    # a 2-character stop string taken from the middle of the greedy text
    at = next(i for i in range(1, len(full) - 1) if full[i : i + 2].isprintable() and full[i : i + 2].strip())
    stop = full[at : at + 2]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        result = client.completions.create(
            model=MODEL, prompt=PROMPTS[2], temperature=0.0, max_tokens=16, stop=[stop], stream=stream
        )
        chunks = list(result) if stream else [result]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo_and_logprobs(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], **GREEDY).choices[0]
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, **GREEDY).choices[0]
    assert echoed.text == PROMPTS[0] + plain.text
    with_logprobs = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, **GREEDY).choices[0]
    lp = with_logprobs.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == GREEDY["max_tokens"]
    # the tokens are the text where they are whole characters; a piece of one is "bytes:\\x.."
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        if not token.startswith("bytes:"):
            assert plain.text[offset:offset + len(token)] == token
    assert b"".join(_bytes_shown(t) for t in lp.tokens).decode("utf-8", "replace") == plain.text
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and token_logprob <= 0
        assert token_logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(plain.text)


def _bytes_shown(token: str) -> bytes:
    """The bytes of a token as logprobs show it (``_shown``)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode()


def test_logit_bias_and_allowed_token_ids_equal_offline_generate(client: openai.OpenAI, offline: LLM) -> None:
    """The OpenAI client's logit_bias (string keys) and vLLM's allowed_token_ids (extra_body) reach the
    sampler: the same tokens as the Python API with the same settings, streamed or not."""
    first = offline.generate(PROMPTS[0], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    bias = {first[0]: -100.0, first[1]: 3.0}
    allowed = sorted(set(first) | {5, 6, 7})
    expected = offline.generate(PROMPTS[0], SamplingParams(**GREEDY, logit_bias=bias, allowed_token_ids=allowed),
                                use_tqdm=False)[0].outputs[0]
    assert expected.token_ids[0] != first[0] and set(expected.token_ids) <= set(allowed)
    wire = {str(t): b for t, b in bias.items()}
    extra = {"allowed_token_ids": allowed, "return_token_ids": True}
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], logit_bias=wire, extra_body=extra, **GREEDY)
    assert whole.choices[0].token_ids == expected.token_ids and whole.choices[0].text == expected.text
    chunks = client.completions.create(model=MODEL, prompt=PROMPTS[0], logit_bias=wire, extra_body=extra, stream=True,
                                       **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == expected.text


def test_chat_equals_offline_chat_streaming_or_not(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox?"}]
    expected = offline.chat(messages, SamplingParams(**GREEDY))[0]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.outputs[0].text
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert whole.usage.completion_tokens == len(expected.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_chat_without_max_tokens_stops_within_the_context(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "def main():"}], temperature=0.0
    )
    usage = response.usage
    assert usage.total_tokens <= MAX_MODEL_LEN
    if response.choices[0].finish_reason == "length":
        assert usage.total_tokens == MAX_MODEL_LEN


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, **GREEDY
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def _split_character_tokens(tiny_llama_dir: Path) -> tuple[Any, list[int]]:
    """The tiny tokenizer and the ids of the tokens of CJK and emoji that it splits into bytes
    (none of them whole UTF-8 on its own): an output of only these is characters split across tokens."""
    from pagedrs.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(tiny_llama_dir)
    ids = sorted(set(tokenizer.encode("我喜欢吃😀🎉", add_special_tokens=False)))
    assert all(tokenizer.decode([i]) == "\ufffd" for i in ids)
    return tokenizer, ids


def _gpt2_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A byte-level BPE token's bytes, read by the referee: transformers' own GPT-2 byte table."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    return bytes(byte_of[char] for char in tokenizer.hf.convert_ids_to_tokens(token_id))


def _shown(raw: bytes) -> str:
    """A token as logprobs show it: its text, or "bytes:\\xe6\\x88" when it is not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_chat_logprob_bytes_are_the_tokens_own(client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    """Each token's ``bytes`` is its raw bytes (not U+FFFD's for a piece of a character): the
    content is them end to end, decoded; the same streamed."""
    tokenizer, pieces = _split_character_tokens(tiny_llama_dir)
    kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "emoji: 😀"}], logprobs=True,
                              top_logprobs=2, extra_body={"allowed_token_ids": pieces, "return_token_ids": True},
                              **GREEDY)
    choice = client.chat.completions.create(**kw).choices[0]
    content = choice.logprobs.content
    assert [bytes(entry.bytes) for entry in content] == [_gpt2_bytes(tokenizer, t) for t in choice.token_ids]
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace") == choice.message.content
    for entry in content:
        assert entry.token == _shown(bytes(entry.bytes)) and entry.token.startswith("bytes:\\x")
        # the likeliest tokens need not be allowed ones: each alternative's token and bytes agree
        assert all(top.token == _shown(bytes(top.bytes)) for top in entry.top_logprobs)
    streamed = [entry for chunk in client.chat.completions.create(**kw, stream=True) for c in chunk.choices
                if c.logprobs for entry in c.logprobs.content]
    # the same entries (the values to float noise: the second run reuses the first's cached prompt)
    assert [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_legacy_logprob_tokens_and_offsets_follow_the_text(client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    """Echo and logprobs over a prompt and an output of characters split across tokens: each token
    as "bytes:\\x.." (its own bytes), each offset the character its first byte is in."""
    tokenizer, pieces = _split_character_tokens(tiny_llama_dir)
    prompt = "吃 😀 The"
    choice = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, **GREEDY,
                                       extra_body={"allowed_token_ids": pieces, "return_token_ids": True}).choices[0]
    ids = tokenizer.encode(prompt) + choice.token_ids
    lp, data = choice.logprobs, b""
    assert len(lp.tokens) == len(ids)
    for token_id, token, offset in zip(ids, lp.tokens, lp.text_offset, strict=True):
        raw = _gpt2_bytes(tokenizer, token_id)
        assert token == _shown(raw)
        if not token.startswith("bytes:"):
            assert choice.text[offset:offset + len(token)] == token
        assert offset == len((data + raw[:1]).decode("utf-8", "replace")) - 1
        data += raw
    assert data.decode("utf-8", "replace") == choice.text


TOO_LONG = list(range(3, 3 + MAX_MODEL_LEN + 1))

ERROR_CASES = [
    # (endpoint, body, status, expected param or None, text in the message)
    ("completions", {"model": "nope", "prompt": "x"}, 404, "model", "'nope' does not exist"),
    ("chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "does not exist"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature", "temperature=-1"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "0 < top_p <= 1"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "SamplingParams.n=0"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens=0"),
    ("completions", {"model": MODEL, "prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty",
     "-2 <= value <= 2"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs=21"),
    ("completions", {"model": MODEL, "prompt": TOO_LONG}, 400, "prompt", f"max_model_len is {MAX_MODEL_LEN}"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "the prompt is empty"),
    # refused by the engine's input processor (a FieldError), not by the server's own checks
    ("completions", {"model": MODEL, "prompt": [[1, 2, 10**7]]}, 400, "prompt", "token id 10000000 is outside the vocabulary"),
    ("completions", {"model": MODEL, "prompt": 5}, 400, "prompt", "Input should be"),
    # logit_bias (OpenAI) and allowed_token_ids (vLLM): shape here, ranges in SamplingParams, ids in the engine
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias",
     "keys are token ids written as decimal integers"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, 400,
     "logit_bias", "finite numbers in [-100, 100]"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": True}}, 400, "logit_bias", "boolean"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"10000000": 1}}, 400, "logit_bias",
     "token id 10000000, outside the vocabulary"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "allowed_token_ids": [3, 10**7]}, 400,
     "allowed_token_ids", "outside the vocabulary"),
    ("completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids", "at least 1"),
    ("completions", {"model": MODEL}, 400, "prompt", "Field required"),
    ("completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    ("completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs",
     "prompt_logprobs=21"),
    ("completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs",
     "prompt_logprobs=-1"),
    ("completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": True}, 400, "prompt_logprobs", "bool"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}, 400,
     "prompt_logprobs", "/v1/completions only"),
    ("chat", {"model": MODEL, "messages": []}, 400, "messages", "messages is empty"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "fox " * 200}]}, 400, "messages",
     f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "requires logprobs"),
]


@pytest.mark.parametrize("endpoint,body,status,param,text", ERROR_CASES)
@pytest.mark.parametrize("stream", [False, True])
def test_errors_have_openai_shape_and_status(
    served: Served, endpoint: str, body: dict[str, Any], status: int, param: str | None, text: str, stream: bool
) -> None:
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]
    response = httpx.post(served.url + path, json={**body, "stream": stream}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert error["param"] == param
    assert text in error["message"]


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=2)


def test_503_when_the_waiting_queue_would_exceed_max_waiting(served: Served, client: openai.OpenAI) -> None:
    ctx = served.app.state.ctx
    before = served.metrics().get('pagedrs_requests_rejected_total{status=503}', 0.0)
    ctx.max_waiting = 0  # every new request would wait at least a moment
    try:
        with pytest.raises(openai.APIStatusError) as rejected:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    finally:
        ctx.max_waiting = 64
    assert rejected.value.status_code == 503 and int(rejected.value.response.headers["retry-after"]) >= 1
    assert rejected.value.body["type"] == "server_overloaded_error"
    assert "--max-waiting is 0" in rejected.value.body["message"]
    assert served.metrics()['pagedrs_requests_rejected_total{status=503}'] == before + 1
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].finish_reason


def test_load_with_disconnects_frees_every_page_and_matches_offline(served: Served, offline: LLM) -> None:
    """32 concurrent streaming clients; every 4th disconnects after 3 chunks of a 100-token request."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    leavers = set(range(0, 32, 4))
    stayers = [i for i in range(32) if i not in leavers]
    finished_before, aborted_before = _finished_requests(served.metrics()), _finished_requests(served.metrics(), "abort")

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        if i in leavers:
            stream = await client.completions.create(
                model=MODEL, prompt=prompts[i], temperature=0.0, max_tokens=100, extra_body={"ignore_eos": True},
                stream=True,
            )
            received = 0
            async for _ in stream:
                received += 1
                if received == 3:
                    break
            await stream.close()
            return "", None
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], stream=True, **GREEDY)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run_all() -> list[tuple[str, str | None]]:
        client = served.async_client()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), timeout=300)
        finally:
            await client.close()

    results = asyncio.run(run_all())
    metrics = served.wait_idle()
    assert metrics["pagedrs_kv_free_blocks"] == metrics["pagedrs_kv_total_blocks"] == ENGINE_KW["num_gpu_blocks"]
    # the leavers were aborted, not run to their 100 tokens: the stayers finished, and a leaver only where
    # it ran to its end before its disconnect reached the engine (seen on a loaded 2-core machine: 2 of
    # 8: its 100 decode steps take a fraction of a second); broken aborts would finish all 8
    finished = _finished_requests(metrics) - finished_before
    assert len(stayers) <= finished <= len(stayers) + len(leavers) // 2, finished
    # and every leaver the engine did not finish is counted as aborted (they went uncounted before)
    assert _finished_requests(metrics, "abort") - aborted_before == len(stayers) + len(leavers) - finished
    expected = offline.generate([prompts[i] for i in stayers], SamplingParams(**GREEDY), use_tqdm=False)
    assert [results[i][0] for i in stayers] == [e.outputs[0].text for e in expected]
    assert [results[i][1] for i in stayers] == [e.outputs[0].finish_reason for e in expected]
    assert metrics["pagedrs_generated_tokens_total"] > 0
    assert metrics["pagedrs_time_to_first_token_seconds_count"] >= 32


def _finished_requests(metrics: dict[str, float], *reasons: str) -> float:
    """Requests finished with one of ``reasons`` (default: by their samples, "stop" or "length")."""
    wanted = reasons or ("stop", "length")
    return sum(v for k, v in metrics.items() if k.startswith("pagedrs_requests_finished_total{")
               and any(f"finish_reason={r}}}" in k for r in wanted))


def test_metrics_expose_every_required_series(served: Served) -> None:
    names = set(served.metrics())
    for name in (
        "pagedrs_kv_total_blocks", "pagedrs_kv_free_blocks", "pagedrs_kv_utilization",
        "pagedrs_requests_running", "pagedrs_requests_waiting", "pagedrs_prefix_cache_queries_total",
        "pagedrs_prefix_cache_hits_total", "pagedrs_preemptions_total", "pagedrs_swapped_pages_total",
        "pagedrs_generated_tokens_total", "pagedrs_time_to_first_token_seconds_count",
        "pagedrs_inter_token_latency_seconds_count",
    ):
        assert name in names, name


def test_serve_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedrs.server import main

    assert main(["--max-waiting", "-1"]) == 2
    assert "--max-waiting=-1 must be >= 0" in capsys.readouterr().err
    assert main(["--model", "/nonexistent/model/dir", "--port", "1"]) == 2
    assert "cannot start the engine" in capsys.readouterr().err
    assert main(["--max-request-bytes", "10"]) == 2
    assert "ServerOptions.max_request_bytes=10 is out of range: allowed >= 1024" in capsys.readouterr().err
    assert main(["--read-timeout", "0"]) == 2
    assert "read_timeout_s=0.0 is out of range" in capsys.readouterr().err


def test_tokenize_and_detokenize_use_the_models_tokenizer(served: Served, offline: LLM) -> None:
    tok = offline.engine.tokenizer
    for add_special in (True, False):
        got = httpx.post(served.url + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[3],
                                                         "add_special_tokens": add_special}).json()
        assert got["tokens"] == tok.encode(PROMPTS[3], add_special_tokens=add_special)
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(served.url + "/detokenize", json={"model": MODEL, "tokens": got["tokens"]}).json()
    assert back["prompt"] == tok.decode(got["tokens"], skip_special_tokens=False)
    too_big = httpx.post(served.url + "/detokenize", json={"model": MODEL, "tokens": [offline.engine.vocab_size]})
    assert too_big.status_code == 400 and "must be in [0," in too_big.json()["error"]["message"]
