"""Text made in the API process from token ids equals the text the engine makes itself.

The served path runs requests in the core with ``detokenize=False`` and rebuilds their
text from the streamed token ids (``pagedrs.server.api_text``). These tests run the same
requests through one engine both ways and compare every delta, with random sampling on
a byte-level tokenizer (so outputs split multi-byte characters), outputs ending by
length, by a stop token id, by EOS, and by abort.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.server.api_text import RequestText, text_made_here
from pagedrs.tokenizer import TokenIdsOnly

ENGINE_KW: dict[str, Any] = dict(block_size=4, num_gpu_blocks=256, max_model_len=128)
PROMPTS = ["The quick brown fox", "Paged attention keeps", "def main():", "é ü 日本"]


def _run(engine: Engine, params: list[SamplingParams], abort_after: int | None = None) -> dict[str, Any]:
    """Per request: the outputs' (index, delta_text, delta_token_ids, finish_reason, stop_reason) in order."""
    for i, (prompt, p) in enumerate(zip(PROMPTS * 4, params)):
        engine.add_request(f"r{i}", prompt, p)
    seen: dict[str, list[tuple]] = {}
    prompts: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            prompts[out.request_id] = list(out.prompt_token_ids)
            for c in out.outputs:
                seen.setdefault(out.request_id, []).append(
                    (c.index, c.delta_text, list(c.delta_token_ids), c.finish_reason, c.stop_reason))
        steps += 1
        if abort_after is not None and steps == abort_after:
            engine.abort("r0")
    return {"seen": seen, "prompts": prompts}


def _params(detokenize: bool) -> list[SamplingParams]:
    base = dict(temperature=1.0, max_tokens=40, detokenize=detokenize)
    return [
        SamplingParams(seed=1, n=2, **base),                                        # length (or EOS)
        SamplingParams(seed=2, stop_token_ids=list(range(40, 140)), **base),         # a stop token id, soon
        SamplingParams(seed=3, skip_special_tokens=False, **base),                   # specials kept in the text
        SamplingParams(seed=4, ignore_eos=True, **base),
        SamplingParams(seed=5, min_tokens=5, stop_token_ids=list(range(30, 200)), **base),
        SamplingParams(seed=6, n=3, **base),
        SamplingParams(seed=7, temperature=0.0, max_tokens=25, detokenize=detokenize),
        SamplingParams(seed=8, logprobs=2, **base),
    ]


@pytest.mark.parametrize("abort_after", [None, 3])
def test_text_made_from_token_ids_equals_the_engines(tiny_llama_dir: Path, abort_after: int | None) -> None:
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), **ENGINE_KW))
    made_by_engine = _run(engine, _params(True), abort_after)
    ids_only = _run(engine, _params(False), abort_after)
    finish_reasons = set()
    for request_id, expected in made_by_engine["seen"].items():
        got = ids_only["seen"][request_id]
        assert [e[2] for e in expected] == [g[2] for g in got]  # same tokens: detokenizing changes nothing else
        assert all(g[1] == "" for g in got)  # the engine made no text
        params = _params(False)[int(request_id[1:])]
        text = RequestText(engine.tokenizer, params.skip_special_tokens)
        prompt = ids_only["prompts"][request_id]
        rebuilt = [text.delta(prompt, index, ids, reason, stop) for index, _, ids, reason, stop in got]
        assert rebuilt == [e[1] for e in expected], request_id
        finish_reasons |= {(e[3], type(e[4]).__name__) for e in expected if e[3]}
    # the cases the rules distinguish all happened: a stop token id (int), length, and abort when asked
    assert {("stop", "int"), ("length", "NoneType")} <= finish_reasons
    if abort_after is not None:
        assert ("abort", "NoneType") in finish_reasons


def test_which_requests_get_their_text_in_the_api_process(tiny_llama_dir: Path) -> None:
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), **ENGINE_KW))
    tok = engine.tokenizer
    assert text_made_here(SamplingParams(), tok)
    assert text_made_here(SamplingParams(n=3, stop_token_ids=[5]), tok)
    assert not text_made_here(SamplingParams(stop=["\n"]), tok)  # stopping needs the text in the core
    assert not text_made_here(SamplingParams(detokenize=False), tok)  # the client asked for no text
    assert not text_made_here(SamplingParams(), TokenIdsOnly({1}))  # skip_tokenizer_init: no text anywhere
    assert not text_made_here({"max_tokens": 3}, tok)


def test_detokenize_false_with_stop_strings_is_refused() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams.detokenize=False .*stop=\['x'\]"):
        SamplingParams(stop="x", detokenize=False)
    with pytest.raises(ValueError, match="SamplingParams.detokenize=1"):
        SamplingParams(detokenize=1)  # type: ignore[arg-type]
