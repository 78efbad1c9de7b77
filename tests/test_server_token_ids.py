"""vLLM's ``return_token_ids`` on both endpoints, streamed or not, on both core clients.

A client that keeps a conversation as token ids (a router, an RL trainer, ``bench dp``'s
users) needs the prompt as the engine saw it and the generated ids — text re-tokenized
need not give the same ids, and then the next turn misses the cache. The referee is the
offline engine on the same request: the same prompt ids and the same generated ids (stop
tokens included, as vLLM's ``token_ids`` are), whatever the text shows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedrs import LLM, SamplingParams  # noqa: E402
from server_fakes import assert_nothing_left, live_server  # noqa: E402

MODEL = "tiny-llama"
ENGINE_KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=8, num_gpu_blocks=48, max_num_seqs=8,
                                 max_model_len=128, swap_space_gb=0.01)
PROMPT = "Paged attention keeps the KV cache in pages of tokens"
GREEDY: dict[str, Any] = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why pages?"}]


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def served(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    with live_server(tiny_llama_dir, ENGINE_KW, MODEL, core_process=request.param == "core-process") as live:
        yield live
        assert_nothing_left(live.loop)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(model=str(tiny_llama_dir), **ENGINE_KW)


def post(served: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served.url + path, json={"model": MODEL, **GREEDY, **body}, timeout=120)


def events(served: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = post(served, path, {**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_returns_the_engines_ids(served: Any, llm: LLM) -> None:
    (offline,) = llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)
    choice = post(served, "/v1/completions", {"prompt": PROMPT, "return_token_ids": True}).json()["choices"][0]
    assert choice["prompt_token_ids"] == offline.prompt_token_ids
    assert choice["token_ids"] == offline.outputs[0].token_ids
    assert choice["text"] == offline.outputs[0].text


@pytest.mark.parametrize("flag", [None, False])
def test_without_the_flag_no_ids_are_sent(served: Any, flag: bool | None) -> None:
    body: dict[str, Any] = {"prompt": PROMPT} if flag is None else {"prompt": PROMPT, "return_token_ids": flag}
    choice = post(served, "/v1/completions", body).json()["choices"][0]
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    chat = post(served, "/v1/chat/completions", {"messages": MESSAGES, "return_token_ids": flag}).json()
    assert "prompt_token_ids" not in chat and "token_ids" not in chat["choices"][0]
    for event in events(served, "/v1/completions", body):
        assert all("token_ids" not in c and "prompt_token_ids" not in c for c in event["choices"])


def test_a_stop_token_is_in_the_ids_but_not_in_the_text(served: Any, llm: LLM) -> None:
    (free,) = llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)
    stop = free.outputs[0].token_ids[2]
    params = {**GREEDY, "stop_token_ids": [stop]}
    (offline,) = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)
    assert offline.outputs[0].token_ids[-1] == stop, "the referee: the engine keeps the stop token"
    choice = post(served, "/v1/completions", {"prompt": PROMPT, "stop_token_ids": [stop],
                                              "return_token_ids": True}).json()["choices"][0]
    assert choice["token_ids"] == offline.outputs[0].token_ids
    assert choice["finish_reason"] == "stop" and choice["text"] == offline.outputs[0].text


def test_completion_stream_sends_prompt_ids_once_per_choice_and_each_chunks_ids(served: Any, llm: LLM) -> None:
    prompts = [PROMPT, "A second prompt of other words"]
    offline = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    got: dict[int, list[int]] = {}
    prompt_ids: dict[int, list[list[int]]] = {}
    for event in events(served, "/v1/completions", {"prompt": prompts, "n": 2, "return_token_ids": True}):
        for c in event["choices"]:
            got.setdefault(c["index"], []).extend(c["token_ids"])
            if "prompt_token_ids" in c:
                prompt_ids.setdefault(c["index"], []).append(c["prompt_token_ids"])
    assert sorted(got) == [0, 1, 2, 3]
    for index, ids in got.items():
        out = offline[index // 2]
        assert ids == out.outputs[0].token_ids, f"choice {index}: greedy, so both samples equal the offline one"
        assert prompt_ids[index] == [out.prompt_token_ids], f"choice {index}: the prompt's ids exactly once"


@pytest.mark.parametrize("logprobs", [None, 1])
def test_echoed_stream_carries_the_prompt_ids_on_its_first_chunk(served: Any, llm: LLM, logprobs: int | None) -> None:
    (offline,) = llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)
    chunks = [c for e in events(served, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": logprobs,
                                                            "return_token_ids": True}) for c in e["choices"]]
    assert chunks[0]["text"] == PROMPT and chunks[0]["prompt_token_ids"] == offline.prompt_token_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c.get("token_ids") or []] == offline.outputs[0].token_ids


def test_chat_ids_equal_the_rendered_conversation_and_the_offline_reply(served: Any, llm: LLM) -> None:
    (offline,) = llm.chat(MESSAGES, SamplingParams(**GREEDY))
    body = post(served, "/v1/chat/completions", {"messages": MESSAGES, "return_token_ids": True}).json()
    assert body["prompt_token_ids"] == offline.prompt_token_ids
    assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])
    assert body["choices"][0]["token_ids"] == offline.outputs[0].token_ids
    stream = events(served, "/v1/chat/completions", {"messages": MESSAGES, "return_token_ids": True})
    assert stream[0]["prompt_token_ids"] == offline.prompt_token_ids
    assert all("prompt_token_ids" not in e for e in stream[1:]), "the first chunk only"
    ids = [t for e in stream for c in e["choices"] for t in c.get("token_ids") or []]
    assert ids == offline.outputs[0].token_ids


def test_the_next_turn_as_token_ids_hits_the_cache_through_the_reply(served: Any) -> None:
    """What the field is for: prompt + reply ids as the next prompt reuse every full page of both."""
    bs = ENGINE_KW["block_size"]
    first = post(served, "/v1/completions", {"prompt": PROMPT + " and more", "max_tokens": 2 * bs,
                                             "return_token_ids": True}).json()["choices"][0]
    history = first["prompt_token_ids"] + first["token_ids"]
    second = post(served, "/v1/completions", {"prompt": history + [42], "max_tokens": 1}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(history) // bs) * bs


@pytest.mark.parametrize("value", [1, "yes", [True]])
@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": PROMPT}),
                                       ("/v1/chat/completions", {"messages": MESSAGES})])
def test_a_non_boolean_flag_is_a_400_naming_it(served: Any, path: str, body: dict[str, Any], value: Any) -> None:
    response = post(served, path, {**body, "return_token_ids": value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "return_token_ids"
