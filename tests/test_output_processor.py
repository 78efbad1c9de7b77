"""The front end decides where text ends (frontend/output_processor.py): stop strings cut at
the exact token, the core is told once, tokens a core computed past a stop string never reach
an output, and best_of > n ranks by the log-probability of the tokens kept."""

from __future__ import annotations

import pytest

from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.core.protocol import Abort, CoreOutput, CoreSampleOutput, FinishSample, RequestMetrics
from pagedrs.frontend.input_processor import InputProcessor
from pagedrs.frontend.output_processor import OutputProcessor
from pagedrs.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_folder(tiny_llama_dir, {0})


def _processor(tokenizer: Tokenizer, params: SamplingParams, prompt: str = "x") -> OutputProcessor:
    out = OutputProcessor(tokenizer)
    processed = InputProcessor(tokenizer, 10**6, 512, 16).process("r", prompt, params, 0)
    out.add(processed, queued_time=1.0)
    return out


def _core_output(tokens: list[int], finish: str | None = None, finished: bool = False, index: int = 0) -> CoreOutput:
    sample = CoreSampleOutput(index, tokens, logprobs=[-0.5] * len(tokens), finish_reason=finish)
    return CoreOutput("r", [sample], finished, RequestMetrics(0.5, 1.0))


def test_a_stop_string_cuts_the_text_at_its_token_and_finishes_the_sample_in_the_core_once(tokenizer) -> None:
    ids = tokenizer.encode("hello world and more", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids) + 1) if "lo w" in tokenizer.decode(ids[:i]))  # the token completing it
    out = _processor(tokenizer, SamplingParams(max_tokens=64, stop=["lo w"]))
    results, commands = out.process([_core_output(ids)])
    (result,) = results
    c = result.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("hel", "stop", "lo w")
    assert c.token_ids == ids[:cut], "the tokens after the one that completed the stop string are dropped"
    assert c.cumulative_logprob == pytest.approx(-0.5 * cut)
    assert result.finished and "finished_time" in result.metrics
    assert commands == [FinishSample("r", 0, "stop", "lo w")]
    # a core in another process computed one token more before it heard: it reaches no output
    assert out.process([_core_output([ids[0]], finish="stop", finished=True)]) == ([], [])


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot(tokenizer) -> None:
    ids = tokenizer.encode("abcd", add_special_tokens=False)
    out = _processor(tokenizer, SamplingParams(max_tokens=64, stop=["cdX"]))
    deltas = []
    for token in ids:
        (result,), _ = out.process([_core_output([token])])
        deltas.append(result.outputs[0].delta_text)
    assert "".join(deltas) == "ab", "the last two characters could still begin 'cdX'"
    (result,), _ = out.process([_core_output([], finish="length", finished=True)])
    assert result.outputs[0].delta_text == "cd" and result.outputs[0].text == "abcd"


def test_a_stop_token_is_in_token_ids_but_not_in_the_text(tokenizer) -> None:
    ids = tokenizer.encode("ab", add_special_tokens=False)
    out = _processor(tokenizer, SamplingParams(max_tokens=64, stop_token_ids=[ids[-1]]))
    sample = CoreSampleOutput(0, ids, [-1.0] * len(ids), finish_reason="stop", stop_reason=ids[-1])
    (result,), commands = out.process([CoreOutput("r", [sample], True, RequestMetrics(0.5, 1.0))])
    c = result.outputs[0]
    assert (c.token_ids, c.text, c.stop_reason, commands) == (ids, tokenizer.decode(ids[:-1]), ids[-1], [])


def test_a_failing_detokenizer_ends_its_request_and_aborts_it_in_the_core(tokenizer, monkeypatch) -> None:
    out = _processor(tokenizer, SamplingParams(max_tokens=64, n=2))
    monkeypatch.setattr(out.requests["r"].samples[0].detokenizer, "step", lambda ids: 1 / 0)
    (result,), commands = out.process([_core_output([5])])
    assert result.finished and "ZeroDivisionError" in result.error
    assert [c.finish_reason for c in result.outputs] == ["error", "error"], "the sample never forked ends too"
    assert commands == [Abort("r")] and "r" not in out


def test_best_of_ranks_by_the_logprob_of_the_tokens_a_stop_string_kept(tiny_llama_dir) -> None:
    """best_of=5, n=2 returns the two best of the five samples that n=5 returns (the same seeds
    draw the same samples), ranked by the sum of their kept tokens' log-probabilities."""
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=256, max_model_len=96))

    def run(**kw: object) -> list:
        engine.add_request("q", "the cat sat", SamplingParams(max_tokens=16, temperature=1.0, seed=7, stop=["e", "s"],
                                                              logprobs=0, **kw))
        done = [o for _ in range(200) for o in engine.step() if o.finished]
        return done[0].outputs

    every = run(n=5)
    assert any(isinstance(c.stop_reason, str) for c in every), "the workload must hit a stop string"
    for c in every:  # the cumulative logprob counts exactly the tokens kept
        assert c.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(c.logprobs, c.token_ids)))
    best = run(n=2, best_of=5)
    want = sorted(every, key=lambda c: (-c.cumulative_logprob, c.index))[:2]
    assert [(c.index, c.text, c.token_ids) for c in best] == [(i, c.text, c.token_ids) for i, c in enumerate(want)]


def test_several_core_steps_in_one_call_make_one_output_whose_logprobs_match_its_tokens(tokenizer) -> None:
    """A core in another process may deliver several steps at once. Each request then gets one
    output with every new token, and its logprobs (the sample's growing list) line up with its
    token ids; one output per core step once handed out entries of later tokens."""
    ids = tokenizer.encode("hello world", add_special_tokens=False)[:3]
    out = _processor(tokenizer, SamplingParams(max_tokens=64, logprobs=1))

    def step(token: int) -> CoreOutput:
        sample = CoreSampleOutput(0, [token], logprobs=[-0.5], top_logprobs=[{token: -0.5}])
        return CoreOutput("r", [sample], False, None)

    results, _ = out.process([step(t) for t in ids])
    (result,) = results
    c = result.outputs[0]
    assert c.delta_token_ids == ids and c.token_ids == ids
    assert [next(iter(d)) for d in c.logprobs] == ids


def test_positional_builders_match_the_field_order() -> None:
    """The hot path builds CoreSampleOutput, CompletionOutput and RequestOutput positionally
    (keywords cost a batch-256 step measurably): a field reordered or inserted must fail here,
    not shift values into the wrong field silently."""
    import dataclasses

    from pagedrs.core.protocol import CoreOutput, CoreSampleOutput
    from pagedrs.outputs import CompletionOutput, RequestOutput

    def names(cls: type) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    assert names(CoreSampleOutput)[:6] == ["index", "new_token_ids", "logprobs", "top_logprobs",
                                           "finish_reason", "stop_reason"]
    assert names(CoreOutput)[:8] == ["request_id", "samples", "finished", "metrics", "error",
                                     "num_cached_tokens", "cached_tokens_by_tier", "prompt_logprobs"]
    assert names(CompletionOutput) == ["index", "text", "token_ids", "delta_text", "delta_token_ids",
                                       "finish_reason", "stop_reason", "logprobs", "cumulative_logprob", "score"]
    assert names(RequestOutput)[:10] == ["request_id", "prompt", "prompt_token_ids", "outputs", "finished", "error",
                                         "metrics", "num_cached_tokens", "cached_tokens_by_tier", "prompt_logprobs"]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_one_sample_delta_request_gets_what_the_general_path_builds(tokenizer, logprobs) -> None:
    """``one_delta_completion`` (a running DELTA request of one sample, no stop string) against the
    general ``delta_completions`` path, step by step over text with multi-byte characters (a token
    with no new text yet), steps that bring several tokens or none, metrics that arrive late, and
    the finish (always the general path): the same outputs, field by field."""
    from pagedrs.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=64, logprobs=logprobs, output_kind=RequestOutputKind.DELTA)
    ids = tokenizer.encode("héllo wörld — 日本語 and more text", add_special_tokens=False)
    chunks = [ids[:1], ids[1:2], [], ids[2:5], ids[5:6], ids[6:9], ids[9:]]

    def core(tokens: list[int], step: int, finished: bool) -> CoreOutput:
        top = None if logprobs is None else [{t: -0.5, 7: -1.5} for t in tokens]
        sample = CoreSampleOutput(0, tokens, logprobs=[-0.5 - step] * len(tokens), top_logprobs=top,
                                  finish_reason="length" if finished else None)
        metrics = RequestMetrics(0.5, 1.0) if step in (0, 4) or finished else None
        return CoreOutput("r", [sample], finished, metrics)

    runs = {}
    for fast in (True, False):
        out = _processor(tokenizer, params)
        state = out._requests["r"]
        assert state.one_delta
        state.one_delta = fast
        got = []
        for step, chunk in enumerate(chunks):
            last = step == len(chunks) - 1
            results, _ = out.process([core(chunk, step, last)])
            got.append([(r.outputs, r.finished, r.error, r.metrics.keys(), r.prompt_logprobs) for r in results])
        runs[fast] = got
    assert runs[True] == runs[False]
    assert any(not step for step in runs[True]), "a step with nothing new gives no output"
    assert "".join(o.delta_text for step in runs[True] for r in step for o in r[0]) == tokenizer.decode(ids)


def test_requests_that_may_hold_text_or_have_several_samples_take_the_general_path(tokenizer) -> None:
    from pagedrs.sampling_params import RequestOutputKind

    delta = RequestOutputKind.DELTA
    for params, one in [(SamplingParams(output_kind=delta), True), (SamplingParams(output_kind=delta, stop=["x"]), False),
                        (SamplingParams(output_kind=delta, n=2), False), (SamplingParams(), False),
                        (SamplingParams(output_kind=delta, n=1, best_of=2), False)]:
        assert _processor(tokenizer, params)._requests["r"].one_delta is one, params
