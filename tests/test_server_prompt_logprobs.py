"""/v1/completions with echo and logprobs (OpenAI's legacy layout: the prompt's tokens first, the
first one's logprob null) and vLLM's prompt_logprobs field, streamed or not, on both core clients;
the values are the engine's RequestOutput.prompt_logprobs, which test_prompt_logprobs.py holds to
transformers."""

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
ENGINE_KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=8, num_gpu_blocks=24, max_num_seqs=8,
                                 max_model_len=128, swap_space_gb=0.01, max_num_batched_tokens=16)
PROMPT = "Paged attention keeps the KV cache in pages of tokens"
GREEDY = dict(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module", params=["in-process", "core-process"])
def served(tiny_llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    with live_server(tiny_llama_dir, ENGINE_KW, MODEL, core_process=request.param == "core-process") as live:
        yield live
        assert_nothing_left(live.loop)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> Any:
    """The offline engine's prompt logprobs and greedy tokens for PROMPT (k = 3)."""
    llm = LLM(model=str(tiny_llama_dir), **ENGINE_KW)
    (out,) = llm.generate([PROMPT], SamplingParams(prompt_logprobs=3, ignore_eos=True, **GREEDY), use_tqdm=False)
    return out


def post(served: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "ignore_eos": True,
                                                          **GREEDY, **body}, timeout=120)


def chunks(served: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = post(served, {**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_echo_with_logprobs_leads_with_the_prompt(served: Any, offline: Any) -> None:
    response = post(served, {"echo": True, "logprobs": 2})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    ids = offline.prompt_token_ids
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT + offline.outputs[0].text
    assert len(lp["tokens"]) == len(ids) + GREEDY["max_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(offline.prompt_logprobs[p][ids[p]], abs=1e-5)
        assert len(lp["top_logprobs"][p]) <= 2
        best = sorted(offline.prompt_logprobs[p].values(), reverse=True)[0]
        assert max(lp["top_logprobs"][p].values()) == pytest.approx(best, abs=1e-5)
    assert "".join(lp["tokens"][: len(ids)]) == PROMPT  # this byte-level BPE's token strings concatenate
    assert lp["text_offset"][len(ids)] == len(PROMPT), "the generated tokens start after the echo"
    assert lp["text_offset"][: len(ids)] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]
    generated = lp["token_logprobs"][len(ids):]
    assert all(v is not None and v <= 0 for v in generated)
    assert choice["prompt_logprobs"] is None, "not asked for"


def test_vllm_prompt_logprobs_field(served: Any, offline: Any) -> None:
    response = post(served, {"prompt_logprobs": 3})
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["prompt_logprobs"]
    ids = offline.prompt_token_ids
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        expected = offline.prompt_logprobs[p]
        assert str(ids[p]) in got[p]
        assert {int(t) for t in got[p]} == set(expected)
        ranks = sorted(v["rank"] for v in got[p].values() if v["rank"] is not None)
        assert ranks == [1, 2, 3]
        for token, value in got[p].items():
            assert value["logprob"] == pytest.approx(expected[int(token)], abs=1e-5)


def test_streamed_echo_with_logprobs_equals_the_response(served: Any) -> None:
    whole = post(served, {"echo": True, "logprobs": 2, "prompt_logprobs": 1}).json()["choices"][0]
    events = chunks(served, {"echo": True, "logprobs": 2, "prompt_logprobs": 1})
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    values = [v for c in choices if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert tokens == whole["logprobs"]["tokens"]
    assert values == pytest.approx(whole["logprobs"]["token_logprobs"])
    carried = [c["prompt_logprobs"] for c in choices if c["prompt_logprobs"] is not None]
    assert len(carried) == 1 and carried[0] == whole["prompt_logprobs"], "once, on the echo chunk"


def test_streamed_prompt_logprobs_ride_on_the_first_chunk(served: Any) -> None:
    events = chunks(served, {"prompt_logprobs": 0})
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["prompt_logprobs"] is not None and choices[0]["prompt_logprobs"][0] is None
    assert all(c["prompt_logprobs"] is None for c in choices[1:])
