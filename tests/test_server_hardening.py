"""Regression tests for issue 10 (server side), with the issue's exact inputs, on a real engine.

A live server over the tiny random llama; after every test the engine must hold no page
and no sequence (``nothing_left``), which is what the first defect broke: a request
rejected after it reached the scheduler kept its pages and a running slot for good.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedrs.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS  # noqa: E402
from server_fakes import LiveServer, assert_nothing_left, live_server  # noqa: E402

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
ENGINE_KW: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=16, num_gpu_blocks=64, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
    swap_space_gb=0.01,
)
# About 100 tokens of this tokenizer: the "600-word prompt", scaled to the tiny context.
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 3)


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def live(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[LiveServer]:
    """Every test runs against both placements of the engine (``pagedrs serve`` defaults to its own process)."""
    with live_server(tiny_llama_dir, ENGINE_KW, MODEL, core_process=request.param == "core-process") as server:
        yield server


def _post(live: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    content = json.dumps(body).encode()  # json.dumps writes NaN, Infinity and lone surrogates (as \ud800)
    return httpx.post(live.url + path, content=content, headers={"content-type": "application/json"}, timeout=120)


@pytest.fixture(autouse=True)
def nothing_left(live: LiveServer) -> Iterator[None]:
    yield
    stats = assert_nothing_left(live.loop)
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"] == ENGINE_KW["num_gpu_blocks"]


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, **fields}


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


BAD_INPUTS = [
    # (id, path, body, param, text in the message)
    ("seed 2**64", "/v1/completions", _completion(seed=18446744073709551616, temperature=1.0), "seed",
     "less than or equal to 9223372036854775807"),
    ("n 100000", "/v1/completions", _completion(n=100000, stream=True), "n", "less than or equal to 128"),
    ("top_k 2**63", "/v1/completions", _completion(top_k=2**63, temperature=1.0), "top_k",
     "less than or equal to 2147483647"),
    ("priority 2**63", "/v1/chat/completions", _chat("hi", priority=2**63), "priority",
     "less than or equal to 2147483647"),
    ("surrogate prompt", "/v1/completions", _completion(prompt="\ud800"), "prompt", "lone surrogate"),
    ("surrogate content", "/v1/chat/completions", _chat("a\ud800b"), "messages", "lone surrogate"),
    ("surrogate stop", "/v1/completions", _completion(stop=["\udfff"]), "stop", "unicode string"),
    ("NaN temperature", "/v1/completions", _completion(temperature=float("nan")), "temperature", "finite number"),
    ("Infinity top_p", "/v1/chat/completions", _chat("hi", top_p=float("inf")), "top_p", "finite number"),
    ("-Infinity penalty", "/v1/completions", _completion(presence_penalty=float("-inf")), "presence_penalty",
     "finite number"),
    ("booleans as token ids", "/v1/completions", _completion(prompt=[True, False]), "prompt",
     "expected an integer, got the boolean"),
    ("boolean stop token id", "/v1/completions", _completion(stop_token_ids=[True]), "stop_token_ids",
     "expected an integer, got the boolean"),
    ("max_tokens past the context", "/v1/completions", _completion(max_tokens=MAX_MODEL_LEN), "max_tokens",
     f"max_model_len is {MAX_MODEL_LEN}"),
    ("max_completion_tokens past the context", "/v1/chat/completions", _chat("hi", max_tokens=None, max_completion_tokens=10**6),
     "max_completion_tokens", f"max_model_len is {MAX_MODEL_LEN}"),
    ("too many stop strings", "/v1/completions", _completion(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop",
     f"at most {MAX_STOP_STRINGS} items"),
    ("a stop string too long", "/v1/completions", _completion(stop="x" * (MAX_STOP_CHARS + 1)), "stop",
     f"at most {MAX_STOP_CHARS} characters"),
    ("more prompts than --max-waiting", "/v1/completions", _completion(prompt=["a"] * 65), "prompt",
     "at most --max-waiting=64"),
    ("a text longer than any context", "/v1/completions", _completion(prompt="fox " * 300_000), "prompt",
     "more than the context can hold"),
]


@pytest.mark.parametrize("path,body,param,text", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_400_naming_the_field(live: LiveServer, path: str, body: dict[str, Any], param: str,
                                              text: str) -> None:
    response = _post(live, path, body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert text in error["message"]


def test_a_rejected_request_leaves_the_server_whole(live: LiveServer) -> None:
    """The issue's sequence: a rejected seeded request, then a valid one that must not hang."""
    bad = _post(live, "/v1/completions", _completion(seed=18446744073709551616, temperature=1.0))
    assert bad.status_code == 400
    good = _post(live, "/v1/completions", _completion(seed=7, temperature=1.0))
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"


def test_a_bad_request_does_not_end_anyone_elses(live: LiveServer) -> None:
    """top_k = 2**63 once ended every request in flight (the batched sampler overflowed)."""
    body = _completion(max_tokens=24, stream=True, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(lambda: _post(live, "/v1/completions", body))
        assert _post(live, "/v1/completions", _completion(top_k=2**63, temperature=1.0)).status_code == 400
        events = [e for e in bystander.result(timeout=120).text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_20_mb_body_gets_413(live: LiveServer) -> None:
    response = _post(live, "/v1/chat/completions", _chat("fox " * 5_000_000))
    assert response.status_code == 413 and response.headers["content-type"] == "application/json"
    assert "--max-request-bytes is 4194304" in response.json()["error"]["message"]


def test_the_server_tokenizes_text_prompts_itself(live: LiveServer) -> None:
    """The engine receives token ids only: tokenizing never runs on the engine thread."""
    seen: list[Any] = []
    name = "submit" if hasattr(live.engine, "submit") else "add_request"  # the core process takes adds by submit
    add = getattr(live.engine, name)

    def spy(request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(prompt)
        add(request_id, prompt, *args, **kwargs)

    setattr(live.engine, name, spy)
    try:
        assert _post(live, "/v1/completions", _completion(prompt=["fox", "dog"])).status_code == 200
        assert _post(live, "/v1/chat/completions", _chat("hi")).status_code == 200
    finally:
        delattr(live.engine, name)
    tokenizer = live.engine.tokenizer
    assert seen[:2] == [{"prompt_token_ids": tokenizer.encode("fox")}, {"prompt_token_ids": tokenizer.encode("dog")}]
    assert list(seen[2]) == ["prompt_token_ids"]
