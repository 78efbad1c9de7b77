"""``SamplingParams.output_kind`` (vLLM's RequestOutputKind): CUMULATIVE, DELTA and FINAL_ONLY end
in the same text, tokens, logprobs and finish; DELTA's outputs hold only what is new and add up to
CUMULATIVE's last; FINAL_ONLY makes exactly one output per request (finished, aborted or failed),
and without stop strings decodes its text once, at the end, into the text the per-token path makes."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any, Optional

import pytest

from conftest import TINY_CORPUS
from pagedrs import LLM, Engine, EngineArgs, RequestOutputKind, SamplingParams
from pagedrs.core.protocol import Abort, CoreOutput, CoreSampleOutput, CoreTokenRows, RequestMetrics
from pagedrs.frontend.input_processor import InputProcessor
from pagedrs.frontend.output_processor import OutputProcessor
from pagedrs.outputs import RequestOutput
from pagedrs.tokenizer import Tokenizer

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
KINDS = (CUMULATIVE, DELTA, FINAL_ONLY)
PROMPTS = ["the cat sat", "naïve café 東京", "def main():"]

# What a request ends with, per sample index: the fields every kind must agree on.
Final = dict[int, tuple[Any, ...]]


# ---- validation ----------------------------------------------------------------------------

def test_the_default_is_cumulative_and_ints_become_members() -> None:
    assert SamplingParams().output_kind is CUMULATIVE
    assert SamplingParams(output_kind=2).output_kind is FINAL_ONLY
    assert type(SamplingParams(output_kind=1).output_kind) is RequestOutputKind
    assert [(k.name, int(k)) for k in RequestOutputKind] == [("CUMULATIVE", 0), ("DELTA", 1), ("FINAL_ONLY", 2)]


@pytest.mark.parametrize("bad", [3, -1, "final", "FINAL_ONLY", None, True, False, 2.0, [2]])
def test_a_bad_output_kind_is_refused_naming_the_field_the_value_and_what_is_allowed(bad: object) -> None:
    """A bool is an int to an IntEnum (True would be DELTA): refused like every bool where an int goes."""
    with pytest.raises(ValueError) as info:
        SamplingParams(output_kind=bad)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(f"SamplingParams.output_kind={bad!r} is out of range: allowed ")
    assert "CUMULATIVE (0), DELTA (1), FINAL_ONLY (2)" in message


# ---- one engine, each kind -----------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    eng = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=256, max_model_len=96))
    yield eng
    eng.shutdown()


_runs = 0


def _run(engine: Engine, params: SamplingParams, kind: RequestOutputKind,
         abort_after: Optional[int] = None) -> dict[str, list[RequestOutput]]:
    """Every output each prompt's request got, in order (``abort_after``: steps before an abort)."""
    global _runs
    _runs += 1
    ids = [f"k{_runs}-{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS):
        engine.add_request(request_id, prompt, dataclasses.replace(params, output_kind=kind))
    got: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished():
        if abort_after is not None and steps == abort_after:
            for request_id in ids:
                engine.abort(request_id)
        for out in engine.step():
            got[out.request_id].append(out)
        steps += 1
    return {PROMPTS[ids.index(r)]: outs for r, outs in got.items()}


def _fields(c: Any) -> tuple[Any, ...]:
    return (c.text, list(c.token_ids), c.logprobs, c.finish_reason, c.stop_reason, c.cumulative_logprob)


def _final(outs: list[RequestOutput], kind: RequestOutputKind) -> tuple[Final, Any]:
    """Per sample what the request ended with, and its prompt logprobs, read the way ``kind`` says."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    if kind != DELTA:
        if kind == FINAL_ONLY:
            assert len(outs) == 1, "FINAL_ONLY: exactly one output per request"
        return {c.index: _fields(c) for c in outs[-1].outputs}, outs[-1].prompt_logprobs
    return _add_up_deltas(outs)


def _add_up_deltas(outs: list[RequestOutput]) -> tuple[Final, Any]:
    """DELTA's outputs concatenated per sample, checking each holds only what is new."""
    text: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, Optional[list[dict[int, float]]]] = {}
    last: dict[int, Any] = {}
    prompt_logprobs = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(prompt_logprobs) <= 1, "DELTA: prompt logprobs come once"
    for out in outs:
        assert out.outputs, "DELTA: no output that brings nothing"
        for c in out.outputs:
            assert c.index not in last or last[c.index].finish_reason is None, "a finished sample is not repeated"
            assert c.text == c.delta_text and c.token_ids == c.delta_token_ids
            assert c.token_ids or c.text or c.finish_reason, "a sample is in a DELTA output only with news"
            text[c.index] = text.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids), "the new tokens' logprobs only"
                logprobs[c.index] = [*(logprobs.get(c.index) or []), *c.logprobs]
            last[c.index] = c
    final = {i: (text[i], tokens[i], logprobs.get(i), c.finish_reason, c.stop_reason, c.cumulative_logprob)
             for i, c in last.items()}
    return final, (prompt_logprobs[0] if prompt_logprobs else None)


WORKLOADS = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0),
    "n=2, logprobs": SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=2, logprobs=2),
    "stop strings": SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3, stop=["e", "s"], logprobs=0),
    "stop strings kept": SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3, stop=["e", "s"],
                                        include_stop_str_in_output=True),
    "best_of": SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=2, best_of=4, logprobs=1),
    "best_of, stop strings": SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=2, best_of=5, stop=["e", "s"]),
    "special tokens kept": SamplingParams(max_tokens=16, temperature=1.0, seed=11, skip_special_tokens=False),
    "prompt logprobs": SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, logprobs=1),
    "no text": SamplingParams(max_tokens=6, temperature=1.0, seed=2, detokenize=False, n=2),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_kind_ends_in_the_same_outputs(engine: Engine, name: str) -> None:
    params = WORKLOADS[name]
    runs = {kind: _run(engine, params, kind) for kind in KINDS}
    for prompt in PROMPTS:
        want, want_prompt_logprobs = _final(runs[CUMULATIVE][prompt], CUMULATIVE)
        assert len(want) == params.n
        for kind in (DELTA, FINAL_ONLY):
            got, prompt_logprobs = _final(runs[kind][prompt], kind)
            assert got == want, (kind.name, prompt)
            assert prompt_logprobs == want_prompt_logprobs
    if params.stop:  # the workload must reach the path it is about
        reasons = [c.stop_reason for outs in runs[CUMULATIVE].values() for c in outs[-1].outputs]
        assert any(isinstance(r, str) for r in reasons), reasons


def test_a_stop_token_and_a_length_finish_end_alike(engine: Engine) -> None:
    """The stop token is in token_ids and not in the text, for the deferred decode too."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    free = _final(_run(engine, greedy, CUMULATIVE)[PROMPTS[0]], CUMULATIVE)[0][0]
    stop_at = free[1][4]
    params = dataclasses.replace(greedy, stop_token_ids=[stop_at])
    runs = {kind: _run(engine, params, kind) for kind in KINDS}
    want = _final(runs[CUMULATIVE][PROMPTS[0]], CUMULATIVE)[0]
    assert want[0][3:5] == ("stop", stop_at) and want[0][1][-1] == stop_at
    for kind in (DELTA, FINAL_ONLY):
        for prompt in PROMPTS:
            assert _final(runs[kind][prompt], kind)[0] == _final(runs[CUMULATIVE][prompt], CUMULATIVE)[0]


@pytest.mark.parametrize("stop", [None, ["zq"]], ids=["deferred text", "incremental text"])
def test_an_aborted_final_only_request_gets_one_output_with_what_it_had(engine: Engine, stop) -> None:
    params = SamplingParams(max_tokens=60, temperature=0.0, n=2, stop=stop)
    runs = {kind: _run(engine, params, kind, abort_after=5) for kind in KINDS}
    for prompt in PROMPTS:
        (only,) = runs[FINAL_ONLY][prompt]
        assert only.finished and [c.finish_reason for c in only.outputs] == ["abort", "abort"]
        want = _final(runs[CUMULATIVE][prompt], CUMULATIVE)[0]
        assert all(fields[1] for fields in want.values()), "it was aborted after it had tokens"
        assert _final([only], FINAL_ONLY)[0] == want
        assert _final(runs[DELTA][prompt], DELTA)[0] == want


def test_final_only_makes_nothing_before_the_end_and_delta_only_news(engine: Engine) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for prompt, outs in _run(engine, params, FINAL_ONLY).items():
        assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 8, prompt
        assert outs[0].outputs[0].delta_token_ids == outs[0].outputs[0].token_ids, "the delta since no output"
    for outs in _run(engine, params, DELTA).values():
        assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 8


# ---- what the core sends ---------------------------------------------------------------------

def test_reads_tokens_as_they_come_says_when_the_core_may_send_a_request_once() -> None:
    from pagedrs.beam_search import BeamSearchParams
    from pagedrs.frontend.input_processor import outputs_before_end, reads_tokens_as_they_come

    cases = [  # params, (outputs before the end, tokens read as they come)
        (SamplingParams(output_kind=FINAL_ONLY), (False, False)),
        (SamplingParams(output_kind=FINAL_ONLY, stop=["x"]), (False, True)),  # a stop string: the text as it grows
        (SamplingParams(output_kind=FINAL_ONLY, detokenize=False, n=3), (False, False)),
        (SamplingParams(), (True, True)),
        (SamplingParams(output_kind=DELTA), (True, True)),
        (SamplingParams(n=2, best_of=3), (False, False)),  # ranked at the end
        (SamplingParams(n=2, best_of=3, stop=["x"]), (False, True)),
        (BeamSearchParams(beam_width=2, max_tokens=4), (False, False)),
    ]
    for params, want in cases:
        assert (outputs_before_end(params), reads_tokens_as_they_come(params)) == want, params


def _core_outputs_per_request(engine: Engine, params: SamplingParams, abort_after: Optional[int] = None
                              ) -> tuple[dict[str, int], dict[str, list[RequestOutput]]]:
    """How many CoreOutputs the core sent each request, and the request outputs ``_run`` gathers."""
    counts: dict[str, int] = {}
    step = engine.client.step

    def counting() -> Any:
        outputs = step()
        for out in outputs.outputs:
            for request_id in out.request_ids if isinstance(out, CoreTokenRows) else [out.request_id]:
                counts[request_id] = counts.get(request_id, 0) + 1
        return outputs

    engine.client.step = counting  # type: ignore[method-assign]
    try:
        runs = _run(engine, params, params.output_kind, abort_after=abort_after)
    finally:
        del engine.client.step
    return counts, runs


@pytest.mark.parametrize("name", ["greedy", "n=2, logprobs", "best_of", "prompt logprobs", "no text"])
def test_a_request_read_only_at_its_end_crosses_from_the_core_once(engine: Engine, name: str) -> None:
    """FINAL_ONLY (or best_of > n) without a stop string: one CoreOutput per request, at its end,
    with every token (and its metrics and prompt logprobs); the outputs equal CUMULATIVE's last."""
    params = WORKLOADS[name]
    quiet = dataclasses.replace(params, output_kind=FINAL_ONLY)
    counts, runs = _core_outputs_per_request(engine, quiet)
    assert sorted(counts.values()) == [1, 1, 1], counts
    want = _run(engine, params, CUMULATIVE)
    for prompt, outs in runs.items():
        assert _final(outs, FINAL_ONLY) == _final(want[prompt], CUMULATIVE), prompt
        metrics = outs[-1].metrics
        assert metrics["first_token_time"] <= metrics["finished_time"], "the core's metrics came with it"
        assert outs[-1].num_cached_tokens is not None and outs[-1].cached_tokens_by_tier is not None
        assert outs[-1].prompt_token_ids == want[prompt][-1].prompt_token_ids
    streamed, _ = _core_outputs_per_request(engine, dataclasses.replace(params, output_kind=CUMULATIVE))
    if params.best_of is not None:  # ranked at the end: CUMULATIVE has nothing to hand out before it either
        assert sorted(streamed.values()) == [1, 1, 1]
        return
    assert min(streamed.values()) > 1
    with_stop, _ = _core_outputs_per_request(engine, dataclasses.replace(quiet, stop=["zq"], detokenize=True))
    assert min(with_stop.values()) > 1, "a stop string: the front end reads the text as it grows"


def test_an_aborted_quiet_request_brings_every_token_it_had(engine: Engine) -> None:
    """The core's answer to an abort carries the tokens it never sent."""
    params = SamplingParams(max_tokens=60, temperature=0.0, output_kind=FINAL_ONLY)
    counts, runs = _core_outputs_per_request(engine, params, abort_after=6)
    assert sorted(counts.values()) == [1, 1, 1]
    want = _run(engine, params, CUMULATIVE, abort_after=6)
    for prompt, outs in runs.items():
        (only,) = outs
        assert only.outputs[0].finish_reason == "abort" and len(only.outputs[0].token_ids) >= 4
        assert _final(outs, FINAL_ONLY)[0] == _final(want[prompt], CUMULATIVE)[0]


# ---- LLM.generate ---------------------------------------------------------------------------

def test_llm_generate_submits_final_only_copies_and_returns_what_cumulative_ends_in(tiny_llama_dir) -> None:
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=256, max_model_len=96)
    try:
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=4, n=2, logprobs=1)
        submitted: list[Any] = []
        add = llm.engine.add_request

        def spy(request_id: str, prompt: Any, p: Any, *args: Any, **kwargs: Any) -> None:
            submitted.append(p)
            add(request_id, prompt, p, *args, **kwargs)

        llm.engine.add_request = spy  # type: ignore[method-assign]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert params.output_kind is CUMULATIVE, "the caller's params are not changed"
        assert all(p.output_kind is FINAL_ONLY and p is not params for p in submitted)
        assert len({id(p) for p in submitted}) == 1, "one copy for a batch sharing one params"
        assert dataclasses.replace(submitted[0], output_kind=CUMULATIVE) == params
        llm.engine.add_request = add  # type: ignore[method-assign]
        want = _run(llm.engine, params, CUMULATIVE)
        for out, prompt in zip(outs, PROMPTS):
            assert _final([out], FINAL_ONLY)[0] == _final(want[prompt], CUMULATIVE)[0]
        (default,) = llm.generate(PROMPTS[0], use_tqdm=False)
        assert len(default.outputs[0].token_ids) == SamplingParams().max_tokens
    finally:
        llm.shutdown()


# ---- the deferred decode on real tokenizers ---------------------------------------------------

def _feed(tokenizer: Tokenizer, kind: RequestOutputKind, prompt: list[int], tokens: list[int], finish: str,
          skip_special_tokens: bool) -> RequestOutput:
    """``tokens`` one per core step into an OutputProcessor; the last step ends it by ``finish``."""
    out = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=10**6, skip_special_tokens=skip_special_tokens, output_kind=kind)
    out.add(InputProcessor(tokenizer, 10**6, 10**7, 16).process("r", {"prompt_token_ids": prompt}, params, 0), 1.0)
    results: list[RequestOutput] = []
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        stop_reason = token if last and finish == "stop" else None
        sample = CoreSampleOutput(0, [token], [-0.25], None, finish if last else None, stop_reason)
        results += out.process([CoreOutput("r", [sample], last, RequestMetrics(0.5, 1.0))])[0]
    assert results[-1].finished and (kind != FINAL_ONLY or len(results) == 1)
    return results[-1]


def _random_outputs(tokenizer: Tokenizer, rng: random.Random) -> list[list[int]]:
    """Outputs that split characters across tokens, hold invalid byte runs, and carry special tokens."""
    texts = ["naïve café 東京 🙂🚀 ✓ résumé über straße", " Hello, world!\n\tdef f(): return 42", "北京 🙂 ok"]
    specials = sorted(getattr(tokenizer.hf, "all_special_ids", []))
    outputs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for _ in range(25):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        if specials and rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        if rng.random() < 0.5:  # a character's bytes cut off at the end
            ids += tokenizer.encode("🙂", add_special_tokens=False)[:1]
        outputs.append(ids)
    return outputs


def _byte_fallback_tokenizer(folder: Path) -> Tokenizer:
    """A SentencePiece-style BPE as Llama 2's tokenizer.json has it: "▁" for spaces, ``<0xXX>``
    byte-fallback tokens for what the vocabulary lacks (here every non-ASCII character), and a
    decoder that strips the leading space of a decode, so the text depends on its left context."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    def normalizer() -> Any:
        return normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])

    specials = ["<unk>", "<s>", "</s>"]
    trained = HFTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer()
    ascii_corpus = [t for t in TINY_CORPUS if t.isascii()]
    trained.train_from_iterator(ascii_corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=specials,
                                                                  show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {**{t: i for i, t in enumerate(specials)}, **{f"<0x{b:02X}>": len(specials) + b for b in range(256)}}
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module", params=["smollm2", "tiny byte-level", "byte-fallback"])
def real_tokenizer(request, tiny_llama_dir, tmp_path_factory) -> Tokenizer:
    """Byte-level ones take the one-decode path; the byte-fallback one replays the steps."""
    if request.param == "byte-fallback":
        tokenizer = _byte_fallback_tokenizer(tmp_path_factory.mktemp("byte-fallback"))
        assert "<0xE6>" in tokenizer.hf.convert_ids_to_tokens(tokenizer.encode("東", add_special_tokens=False))
        assert not tokenizer.decodes_by_bytes
        return tokenizer
    if request.param == "smollm2":
        tokenizer = request.getfixturevalue("smollm2").tokenizer
    else:
        tokenizer = Tokenizer.from_folder(tiny_llama_dir, {0})
    assert tokenizer.decodes_by_bytes
    return tokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("finish", ["length", "stop"])
def test_final_only_decoded_once_is_the_text_the_per_token_path_makes(real_tokenizer: Tokenizer, finish: str,
                                                                      skip_special_tokens: bool) -> None:
    rng = random.Random(f"{finish}-{skip_special_tokens}")
    prompts = [real_tokenizer.encode("The quick brown", add_special_tokens=False),
               real_tokenizer.encode("東京", add_special_tokens=False)[:-1] or [5]]  # a prompt ending mid-character
    cases = 0
    for tokens in _random_outputs(real_tokenizer, rng):
        for prompt in prompts:
            want = _feed(real_tokenizer, CUMULATIVE, prompt, tokens, finish, skip_special_tokens).outputs[0]
            got = _feed(real_tokenizer, FINAL_ONLY, prompt, tokens, finish, skip_special_tokens).outputs[0]
            assert _fields(got) == _fields(want), (prompt, tokens)
            cases += "\ufffd" in want.text or any("\x80" <= ch for ch in want.text)
    assert cases > 5, "the cases must include non-ASCII and broken byte sequences"


# ---- a failing request ------------------------------------------------------------------------

def _processor(tokenizer: Tokenizer, kind: RequestOutputKind, **kw: Any) -> OutputProcessor:
    out = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=64, output_kind=kind, **kw)
    out.add(InputProcessor(tokenizer, 10**6, 512, 16).process("r", "x", params, 0), queued_time=1.0)
    return out


@pytest.mark.parametrize("stop", [None, ["zq"]], ids=["deferred text", "incremental text"])
def test_a_request_the_core_fails_gets_one_final_only_output_with_its_error(tiny_llama_dir, stop) -> None:
    tokenizer = Tokenizer.from_folder(tiny_llama_dir, {0})
    ids = tokenizer.encode("naïve café", add_special_tokens=False)
    finals = {}
    for kind in KINDS:
        out = _processor(tokenizer, kind, n=2, stop=stop, logprobs=0)
        results = []
        for token in ids:
            sample = CoreSampleOutput(0, [token], [-0.5], [{token: -0.5}])
            results += out.process([CoreOutput("r", [sample], False, RequestMetrics(0.5, 1.0))])[0]
        results += out.process([CoreOutput("r", [], True, None, error="RuntimeError: boom")])[0]
        assert (len(results) == 1) == (kind == FINAL_ONLY) and "r" not in out
        assert results[-1].finished and results[-1].error == "RuntimeError: boom"
        finals[kind] = _final(results, kind)[0]
    assert finals[CUMULATIVE][0][0] == tokenizer.decode(ids), "the failure came after the text was whole"
    assert finals[CUMULATIVE] == finals[DELTA] == finals[FINAL_ONLY]
    assert [f[3] for f in finals[FINAL_ONLY].values()] == ["error", "error"]


def test_a_detokenizer_failing_at_the_deferred_decode_fails_its_request_alone(tiny_llama_dir, monkeypatch) -> None:
    tokenizer = Tokenizer.from_folder(tiny_llama_dir, {0})
    out = _processor(tokenizer, FINAL_ONLY)
    monkeypatch.setattr(out.requests["r"].samples[0].detokenizer, "finish_at_once", lambda ids: 1 / 0)
    assert out.process([CoreOutput("r", [CoreSampleOutput(0, [5], [-1.0])], False, None)]) == ([], [])
    (result,), commands = out.process([CoreOutput("r", [CoreSampleOutput(0, [6], [-1.0], None, "length")], True,
                                                  None)])
    assert result.finished and "ZeroDivisionError" in result.error and commands == [Abort("r")]
    assert result.outputs[0].finish_reason == "error" and result.outputs[0].token_ids == [5, 6]
    assert result.outputs[0].text == tokenizer.decode([5, 6]), "the text replayed token by token"


def test_a_final_only_output_carries_metrics_that_came_before_it(tiny_llama_dir) -> None:
    """A core in another process sends a request's metrics once, with its first token: the one
    output FINAL_ONLY makes must still carry them."""
    tokenizer = Tokenizer.from_folder(tiny_llama_dir, {0})
    out = _processor(tokenizer, FINAL_ONLY)
    first = RequestMetrics(0.5, 1.0, first_scheduled_time=1.5, first_token_time=2.0)
    assert out.process([CoreOutput("r", [CoreSampleOutput(0, [5], [-1.0])], False, first)]) == ([], [])
    (result,), _ = out.process([CoreOutput("r", [CoreSampleOutput(0, [6], [-1.0], None, "length")], True, None)])
    assert result.metrics["first_token_time"] == 2.0 and "finished_time" in result.metrics
