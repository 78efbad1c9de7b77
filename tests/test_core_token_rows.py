"""The steady decode rows in columns (``CoreTokenRows``, core/fast_rows.py ``record``): every request
gets, step by step, the RequestOutputs it got when each request had a ``CoreOutput`` of its own, in
every output kind, with stop strings, without text, with the core in another process and under
asynchronous scheduling; a request that fails on a steady row ends alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pagedrs import Engine, EngineArgs, RequestOutputKind, SamplingParams
from pagedrs.core import fast_rows
from pagedrs.core.protocol import CoreOutput, CoreSampleOutput, CoreTokenRows, RequestMetrics
from pagedrs.frontend.input_processor import InputProcessor
from pagedrs.frontend.output_processor import OutputProcessor
from pagedrs.server.engine_core import RemoteEngine
from pagedrs.tokenizer import IncrementalDetokenizer, Tokenizer
from test_engine import make_prompts

DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


def _args(model_dir: Any, **kw: Any) -> EngineArgs:
    args = dict(model=str(model_dir), block_size=4, num_gpu_blocks=96, swap_space_gb=0.001, max_model_len=64)
    args.update(kw)
    return EngineArgs(**args)


def _params(stop: str) -> list[SamplingParams]:
    """Rows that are steady (plain, one sample) in each output kind, beside rows that never are."""
    plain = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    return [
        dataclasses.replace(plain, output_kind=DELTA),
        dataclasses.replace(plain, output_kind=CUMULATIVE),
        dataclasses.replace(plain, output_kind=DELTA, detokenize=False),
        dataclasses.replace(plain, output_kind=DELTA, stop=[stop]),  # steady in the core, a text rule here
        dataclasses.replace(plain, output_kind=FINAL_ONLY, stop=[stop]),  # streamed to the front end only
        dataclasses.replace(plain, output_kind=FINAL_ONLY),  # never streamed
        dataclasses.replace(plain, output_kind=DELTA, max_tokens=40),  # ends at max_model_len
        SamplingParams(max_tokens=10, temperature=0.0, output_kind=DELTA),  # may stop at EOS
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, output_kind=DELTA),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2, output_kind=DELTA),
        SamplingParams(max_tokens=9, temperature=0.0, min_tokens=5, output_kind=CUMULATIVE),
        SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, output_kind=DELTA),
    ]


def _strip(out: Any) -> tuple[Any, ...]:
    """A RequestOutput without its timestamps (they differ between runs)."""
    return (out.request_id, out.finished, out.error, out.num_cached_tokens,
            [dataclasses.astuple(c) for c in out.outputs], out.prompt_logprobs)


def _run(engine: Any, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[Any]], int]:
    """Every step's RequestOutputs (as ``_strip`` gives them, by request id within the step), and how
    many steady rows crossed from the core."""
    rows = [0]
    step = engine.client.step

    def counting() -> Any:
        outputs = step()
        rows[0] += sum(len(o) for o in outputs.outputs if isinstance(o, CoreTokenRows))
        return outputs

    engine.client.step = counting
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sp)
    steps = []
    while engine.has_unfinished():
        steps.append(sorted(_strip(out) for out in engine.step()))
    return steps, rows[0]


def _per_request(steps: list[list[Any]]) -> dict[str, Any]:
    """Each request's samples' tokens and text as its outputs' deltas add up, and how it ended."""
    got: dict[str, Any] = {}
    for step in steps:
        for request_id, finished, error, _, completions, _ in step:
            samples = got.setdefault(request_id, {})
            for c in completions:
                index, delta_text, delta_ids, reason, stop_reason = c[0], c[3], c[4], c[5], c[6]
                tokens, text, _ = samples.get(index, ([], "", None))
                samples[index] = (tokens + list(delta_ids), text + delta_text, (reason, stop_reason, finished, error))
    return got


def _stop_string(engine: Any, prompt: list[int]) -> str:
    """Two characters from the middle of the prompt's greedy text: a stop string that matches."""
    engine.add_request("probe", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=14, temperature=0.0,
                                                                              ignore_eos=True))
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            text = out.outputs[0].text
    assert len(text) >= 8, text
    return text[len(text) // 2: len(text) // 2 + 2]


def _without_steady_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    real = fast_rows.record
    monkeypatch.setattr(fast_rows, "record", lambda core, fast, tokens, logprobs, touched, steady=None:
                        real(core, fast, tokens, logprobs, touched))


@pytest.mark.parametrize("mode", ["inproc", "async", "mp"])
def test_steady_rows_give_every_request_the_outputs_of_its_own_core_outputs(tiny_llama_dir, monkeypatch, mode):
    def engine() -> Any:
        if mode == "mp":
            return RemoteEngine(_args(tiny_llama_dir))
        return Engine(_args(tiny_llama_dir, async_scheduling=mode == "async"))

    reference = Engine(_args(tiny_llama_dir))
    prompts = make_prompts(reference, 12)
    params = _params(_stop_string(reference, prompts[3]))
    reference.shutdown()

    first = engine()
    try:
        got, rows = _run(first, prompts, params)
    finally:
        first.shutdown()
    assert rows >= 30, f"only {rows} steady rows crossed: the columns were not used"
    _without_steady_rows(monkeypatch)
    if mode == "mp":  # the core process imports fast_rows afresh: compare with the in-process engine there
        monkeypatch.undo()
        _without_steady_rows(monkeypatch)
        second: Any = Engine(_args(tiny_llama_dir))
    else:
        second = engine()
    try:
        want, none = _run(second, prompts, params)
    finally:
        second.shutdown()
    assert none == 0
    if mode == "mp":  # steps arrive grouped as the pipe delivers them: what each request got, in order
        assert _per_request(got) == _per_request(want)
    else:
        assert got == want
    assert any(c[5] == "stop" and isinstance(c[6], str) for step in got for out in step for c in out[4]), \
        "no stop string matched: the text rule on a steady row went untested"


def _tokens_and_ends(engine: Any, prompts: list[list[int]], params: SamplingParams,
                     first: int) -> tuple[dict[str, list[int]], dict[str, Any], int]:
    """Each request's tokens (DELTA's added up), how it ended, and the steady rows of request ``r{first + 1}``."""
    steady = [0]
    real_client_step = engine.client.step

    def counting() -> Any:
        outputs = real_client_step()
        steady[0] += sum(o.request_ids.count(f"r{first + 1}") for o in outputs.outputs if isinstance(o, CoreTokenRows))
        return outputs

    engine.client.step = counting
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{first + i}", {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {}
    ends: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids if out.outputs else [])
            if out.finished:
                ends[out.request_id] = (out.outputs[0].finish_reason if out.outputs else None, out.error)
    del engine.client.step
    return tokens, ends, steady[0]


def test_a_request_whose_text_fails_on_a_steady_row_ends_alone(tiny_llama_dir, monkeypatch):
    """The detokenizer raises on one request's fifth token (a steady row by then): it ends with
    "error" and its tokens up to that one (as the general path ends it), the core is told to abort it (its pages go back: the
    leak check of conftest), the others finish with the tokens they get without the failure."""
    engine = Engine(_args(tiny_llama_dir))
    prompts = make_prompts(engine, 3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, output_kind=DELTA)
    clean, _, _ = _tokens_and_ends(engine, prompts, params, first=0)

    failing: set[int] = set()  # id() of the failing request's detokenizer
    steps = [0]
    real_add, real_step = OutputProcessor.add, IncrementalDetokenizer.step

    def add(self: Any, processed: Any, queued_time: float) -> None:
        real_add(self, processed, queued_time)
        if processed.request_id == "r4":
            failing.add(id(self.requests["r4"].samples[0].detokenizer))

    def step(self: Any, token_ids: list[int]) -> str:
        if id(self) in failing:
            steps[0] += 1
            if steps[0] == 5:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "no character starts with this byte")
        return real_step(self, token_ids)

    monkeypatch.setattr(OutputProcessor, "add", add)
    monkeypatch.setattr(IncrementalDetokenizer, "step", step)
    tokens, ends, steady = _tokens_and_ends(engine, prompts, params, first=3)
    assert steady >= 3, "the failing request's tokens did not come as steady rows"
    assert ends["r4"][0] == "error" and "UnicodeDecodeError" in ends["r4"][1], ends["r4"]
    assert tokens["r4"] == clean["r1"][:5]  # as the general path: the token is in, its text is not
    for i in (0, 2):
        assert ends[f"r{i + 3}"] == ("length", None)
        assert tokens[f"r{i + 3}"] == clean[f"r{i}"]
    assert engine.core.scheduler.num_running == 0 and not engine.has_unfinished()
    engine.shutdown()


def test_rows_of_a_request_no_longer_here_are_dropped_and_later_outputs_still_apply(tiny_llama_dir):
    """A steady row of a request the front end no longer holds (aborted or failed here: the core
    was told) is dropped; a request's rows and CoreOutputs delivered together apply in order."""
    tokenizer = Tokenizer.from_folder(tiny_llama_dir, {0})
    out = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=5, output_kind=CUMULATIVE, detokenize=False)
    out.add(InputProcessor(tokenizer, 10**6, 512, 16).process("a", "x", params, 0), queued_time=1.0)
    first = CoreOutput("a", [CoreSampleOutput(0, [7], [-0.5])], False, RequestMetrics(0.5, 1.0))
    rows = CoreTokenRows(["gone", "a", "a"], [3, 8, 9], [-1.0, -0.25, -0.125])
    end = CoreOutput("a", [CoreSampleOutput(0, [10], [-0.125], None, "length")], True, None)
    (result,), commands = out.process([first, rows, end])
    assert commands == []
    assert result.finished and result.outputs[0].token_ids == [7, 8, 9, 10]
    assert result.outputs[0].cumulative_logprob == -1.0
    assert "a" not in out


class _RefusingScheduler:
    """The core's scheduler, whose ``append_tokens`` refuses one sequence from its ``after``-th call
    on (the core then finds it by appending row by row and fails its request alone)."""

    def __init__(self, inner: Any, seq_id: int, after: int) -> None:
        self._inner, self._seq_id, self._after, self.calls = inner, seq_id, after, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def append_tokens(self, ids: Any, tokens: Any) -> Any:
        self.calls += 1
        if self.calls >= self._after and self._seq_id in ids.tolist():
            raise ValueError(f"sequence {self._seq_id}: refused")
        return self._inner.append_tokens(ids, tokens)


def test_a_steady_row_whose_append_fails_ends_its_request_as_one_core_output_would(tiny_llama_dir, monkeypatch):
    """Its token went out in the columns, then its request failed in the same step: it ends with
    "error" and the tokens it ends with without the columns; the others run on; nothing leaks."""
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, output_kind=kind)
              for kind in (DELTA, CUMULATIVE, DELTA)]

    def run() -> tuple[list[list[Any]], int]:
        engine = Engine(_args(tiny_llama_dir))
        prompts = make_prompts(engine, 3)
        core = engine.core
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sp)
        engine.step()  # the prefill: r1's sequence exists now
        seq_id = core.requests["r1"].samples[0].seq_id
        core.scheduler = _RefusingScheduler(core.scheduler, seq_id, after=5)
        steps, rows = [], 0
        real_step = engine.client.step

        def counting() -> Any:
            nonlocal rows
            outputs = real_step()
            rows += sum(len(o) for o in outputs.outputs if isinstance(o, CoreTokenRows))
            return outputs

        engine.client.step = counting
        while engine.has_unfinished():
            steps.append(sorted(_strip(out) for out in engine.step()))
        assert core.scheduler.num_running == 0
        engine.shutdown()
        return steps, rows

    got, rows = run()
    assert rows > 0
    failed = [out for step in got for out in step if out[0] == "r1" and out[1]]
    assert len(failed) == 1 and failed[0][2] and "refused" in failed[0][2], failed
    _without_steady_rows(monkeypatch)
    want, none = run()
    assert none == 0 and got == want


def test_columns_of_unequal_lengths_are_refused_before_any_row_is_taken(tiny_llama_dir):
    """A malformed message (a row missing its token or logprob) is an error naming the counts, not
    rows silently dropped by a zip; no row of it is taken."""
    tokenizer = Tokenizer.from_folder(tiny_llama_dir, {0})
    out = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=5, output_kind=CUMULATIVE, detokenize=False)
    out.add(InputProcessor(tokenizer, 10**6, 512, 16).process("a", "x", params, 0), queued_time=1.0)
    out.process([CoreOutput("a", [CoreSampleOutput(0, [7], [-0.5])], False, RequestMetrics(0.5, 1.0))])
    for rows in (CoreTokenRows(["a", "a"], [8], [-0.25, -0.25]), CoreTokenRows(["a"], [8], [])):
        with pytest.raises(ValueError, match=r"CoreTokenRows: \d+ request ids, \d+ tokens and \d+ logprobs"):
            out.process([rows])
    assert out.requests["a"].samples[0].token_ids == [7]
