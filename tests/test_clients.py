"""Both core clients serve the same outputs: the core in this process (InprocClient) and in its
own process (MPClient, behind the server's RemoteEngine), where every text is made by the
API process's OutputProcessor from token ids alone."""

from __future__ import annotations

import threading
import time

import pytest

from pagedrs import BeamSearchParams, Engine, EngineArgs, SamplingParams
from pagedrs.server.engine_core import RemoteEngine

KW = dict(block_size=4, num_gpu_blocks=256, max_model_len=96, swap_space_gb=0.001)
PROMPTS = ["hello world", "the cat sat", [5, 6, 7, 8, 9]]
CASES = {
    "greedy": SamplingParams(max_tokens=12, temperature=0),
    "stop_strings": SamplingParams(max_tokens=24, temperature=1.0, seed=3, stop=["e", "a"]),
    "include_stop": SamplingParams(max_tokens=24, temperature=1.0, seed=4, stop=[" "], include_stop_str_in_output=True),
    "n_with_stops": SamplingParams(max_tokens=12, temperature=1.0, seed=6, n=3, stop=["o"], logprobs=1),
    "best_of": SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2, best_of=4, stop=["e", "s"]),
    "stop_tokens": SamplingParams(max_tokens=24, temperature=1.0, seed=10, stop_token_ids=[5, 9, 11, 20, 30]),
    "beam": BeamSearchParams(beam_width=3, max_tokens=8),
}


def _close(outputs: dict[str, list]) -> dict[str, list]:
    """``outputs`` with their log-probabilities and scores as approximations (``_rounded``)."""
    return {rid: [(*o[:6], _rounded(o[6]), _rounded(o[7])) for o in outs] for rid, outs in outputs.items()}


def _rounded(value: object) -> object:
    """Log-probabilities as ``pytest.approx`` to 1e-4: the two processes may run the model with
    different thread counts (an earlier test sets this one's), which moves the last bits of a
    float (rounding both sides to 4 decimals failed now and then at a rounding boundary)."""
    if isinstance(value, float):
        return pytest.approx(value, abs=1e-4)
    if isinstance(value, list):
        return [{t: pytest.approx(lp, abs=1e-4) for t, lp in d.items()} for d in value]
    return value


def _run(engine: Engine) -> dict[str, list]:
    got: dict[str, list] = {}
    for name, params in CASES.items():
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{name}-{i}", prompt, params)
        texts: dict[str, str] = {}
        while engine.has_unfinished():
            for out in engine.step():
                for c in out.outputs:
                    texts[f"{out.request_id}/{c.index}"] = texts.get(f"{out.request_id}/{c.index}", "") + c.delta_text
                if out.finished:
                    got[out.request_id] = [(c.index, c.text, texts.get(f"{out.request_id}/{c.index}"), c.token_ids,
                                            c.finish_reason, c.stop_reason, c.logprobs, c.score)
                                           for c in out.outputs]
    return got


def test_the_in_process_and_the_multiprocess_client_give_the_same_outputs(tiny_llama_dir) -> None:
    args = EngineArgs(model=str(tiny_llama_dir), **KW)
    with Engine(args) as inproc:
        want = _run(inproc)
    remote = RemoteEngine(args)
    try:
        got = _run(remote)
    finally:
        remote.shutdown(timeout_s=5.0)
    assert any(isinstance(o[5], str) for outs in want.values() for o in outs), "the workload must hit stop strings"
    assert got == _close(want)


@pytest.mark.parametrize("client", ["inproc", "mp"])
def test_submit_and_abort_mean_the_same_on_both_clients(tiny_llama_dir, client: str) -> None:
    """The serving loop's way in (``submit`` from another thread, answered at a step boundary)
    and ``abort`` (of a running request, and of an add still on its way) behave alike on both
    clients: the refusal is raised at submit, each final output comes from the core with a later
    step, and no page is left."""
    args = EngineArgs(model=str(tiny_llama_dir), **KW)
    engine = RemoteEngine(args) if client == "mp" else Engine(args)  # RemoteEngine: Engine on the mp client
    try:
        acks: dict[str, BaseException | None] = {}
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        submitter = threading.Thread(target=lambda: [
            engine.submit(rid, "hello world", params, 0, lambda error, rid=rid: acks.__setitem__(rid, error))
            for rid in ("running", "on-its-way")])
        submitter.start()
        submitter.join()
        with pytest.raises(ValueError, match="max_model_len"):
            engine.submit("too-long", [5] * 500, params, 0, lambda error: acks.__setitem__("too-long", error))
        assert engine.abort("on-its-way"), "an add on its way is abortable"
        assert not engine.abort("never-added")
        finals: dict[str, object] = {}
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].finish_reason
                elif out.request_id == "running" and len(out.outputs[0].token_ids) >= 3:
                    engine.abort("running")
            steps += 1
            assert steps < 200, "the engine never went idle"
        assert acks == {"running": None, "on-its-way": None}
        assert finals == {"running": "abort", "on-its-way": "abort"}
        stats = engine.stats()
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"], f"pages left: {stats}"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("client", ["inproc", "mp"])
def test_a_stop_string_frees_its_pages_and_the_stats_say_so_without_another_step(tiny_llama_dir, client: str) -> None:
    """The front end ends a sample at a stop string and tells the core (FinishSample); the core
    frees its pages and, in its own process, sends the stats that changed: ``stats()`` shows
    nothing held although no request is left to step (a stale page count once leaked here)."""
    args = EngineArgs(model=str(tiny_llama_dir), **KW)
    engine = RemoteEngine(args) if client == "mp" else Engine(args)
    try:
        def run(request_id: str, params: SamplingParams) -> tuple[str, object]:
            engine.add_request(request_id, "the cat sat", params)
            text, reason = "", None
            while engine.has_unfinished():
                for out in engine.step():
                    text += out.outputs[0].delta_text
                    reason = out.outputs[0].finish_reason if out.finished else reason
            return text, reason

        full, _ = run("full", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        at = next(i for i in range(1, len(full) - 1) if full[i:i + 2].isprintable() and full[i:i + 2].strip())
        cut, reason = run("cut", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[full[at:at + 2]]))
        assert (cut, reason) == (full[:full.index(full[at:at + 2])], "stop")
        deadline = time.monotonic() + 10
        while (stats := engine.stats())["num_running"] or stats["num_free_gpu_blocks"] != stats["num_gpu_blocks"]:
            assert time.monotonic() < deadline, f"the stats never showed the stopped request freed: {stats}"
            time.sleep(0.01)
        assert stats["num_unfinished_requests"] == 0
        # A core in its own process may have computed one token past the stop before it heard:
        # that output is taken by the next step and dropped (its request already ended here).
        for _ in range(3):
            if not engine.has_unfinished():
                break
            assert engine.step() == []
        assert not engine.has_unfinished()
    finally:
        engine.shutdown()


def test_output_kinds_cross_to_a_core_in_its_own_process(tiny_llama_dir) -> None:
    """The kind rides on SamplingParams through the codec; the API process's OutputProcessor
    honours it: FINAL_ONLY one output per request (with the first token's metrics, which the core
    sends once), DELTA outputs that add up to what the in-process engine's CUMULATIVE ends in."""
    from pagedrs import RequestOutputKind

    # with a stop string the core streams every request's tokens; without, a FINAL_ONLY request's
    # tokens cross once, at its end (CoreRequest.stream_tokens False)
    workloads = [SamplingParams(max_tokens=12, temperature=1.0, seed=6, n=2, stop=["o"], logprobs=1),
                 SamplingParams(max_tokens=12, temperature=1.0, seed=6, n=2, logprobs=1)]
    args = EngineArgs(model=str(tiny_llama_dir), **KW)
    with Engine(args) as inproc:
        wants = [_final_texts(inproc, params, RequestOutputKind.CUMULATIVE) for params in workloads]
    remote = RemoteEngine(args)
    try:
        for params, want in zip(workloads, wants):
            for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
                assert _final_texts(remote, params, kind) == want, (kind.name, params.stop)
    finally:
        remote.shutdown(timeout_s=5.0)


def _final_texts(engine: Engine, params: SamplingParams, kind: object) -> dict[str, list]:
    """Per request and sample: (text, token ids, finish reason), gathered the way ``kind`` hands them out."""
    import dataclasses

    from pagedrs import RequestOutputKind

    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"k{int(kind)}{bool(params.stop)}-{i}", prompt, dataclasses.replace(params, output_kind=kind))
    samples: dict[str, dict[int, list]] = {}
    count: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            key = out.request_id.split("-")[1]
            count[key] = count.get(key, 0) + 1
            for c in out.outputs:
                text, ids, _ = samples.setdefault(key, {}).setdefault(c.index, ["", [], None])
                if kind == RequestOutputKind.DELTA:
                    samples[key][c.index] = [text + c.text, ids + c.token_ids, c.finish_reason or None]
                else:
                    samples[key][c.index] = [c.text, list(c.token_ids), c.finish_reason]
            if out.finished and kind == RequestOutputKind.FINAL_ONLY:
                assert count[key] == 1 and "first_token_time" in out.metrics
    return {k: [tuple(v[i]) for i in sorted(v)] for k, v in samples.items()}


@pytest.mark.parametrize("client", ["inproc", "mp"])
def test_whose_fault_an_error_is_travels_as_a_flag_on_both_clients(tiny_llama_dir, client: str) -> None:
    """A request ended by its own grammar (a dead end: the request's fault, a 400) carries
    ``error_by_request``; a request ended by a front-end failure that is the engine's (a 500) does
    not. The server reads the flag, not the error text's first word: before, a type name read back
    out of a message decided the status."""
    from pagedrs.sampling_params import StructuredOutputsParams

    dead_end = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
                "additionalProperties": False, "$defs": {"a": {"$ref": "#/$defs/a"}}}
    args = EngineArgs(model=str(tiny_llama_dir), **KW)
    engine = RemoteEngine(args) if client == "mp" else Engine(args)
    try:
        engine.add_request("dead", [5, 6, 7], SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(
            json=dead_end)))
        engine.add_request("plain", [8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
        finals = {}
        while engine.has_unfinished():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert finals["dead"].error is not None and finals["dead"].error.startswith("GrammarDeadEnd: ")
        assert finals["dead"].error_by_request is True
        assert finals["plain"].error is None and finals["plain"].error_by_request is False
    finally:
        engine.shutdown()


@pytest.mark.parametrize("client", ["inproc", "mp"])
def test_a_request_the_pool_can_never_hold_names_its_field_on_both_clients(tiny_llama_dir, client: str) -> None:
    """The core's refusal names the field to change (``FieldError.param``: "prompt" or "max_tokens"), and a
    server's 400 reports it; a core in its own process sent the message alone, so that client raised a
    plain ValueError and the 400's ``param`` was null."""
    from pagedrs.errors import FieldError

    args = EngineArgs(model=str(tiny_llama_dir), **{**KW, "num_gpu_blocks": 16})  # 64 tokens of pages
    engine = RemoteEngine(args) if client == "mp" else Engine(args)
    try:
        for prompt, max_tokens, param in (([5] * 10, 80, "max_tokens"), ([5] * 70, 20, "prompt")):
            with pytest.raises(FieldError, match="the request needs up to") as refused:
                engine.add_request(f"r-{param}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
            assert refused.value.param == param
        engine.add_request("fits", [5] * 10, SamplingParams(max_tokens=4, temperature=0))
        finals = {}
        while engine.has_unfinished():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert list(finals) == ["fits"] and len(finals["fits"].outputs[0].token_ids) == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("client", ["inproc", "mp"])
def test_the_field_of_an_error_met_while_running_crosses_to_the_client(tiny_llama_dir, client: str) -> None:
    """allowed_token_ids = {EOS} with min_tokens = 2 leaves nothing to draw: the request ends with a FieldError
    the core meets mid-answer. Its field (``error_param``) now travels beside the text and the flag, so a
    server's 400 names it (``param`` was null)."""
    args = EngineArgs(model=str(tiny_llama_dir), **KW)
    engine = RemoteEngine(args) if client == "mp" else Engine(args)
    try:
        eos = min(engine.tokenizer.eos_token_ids)
        engine.add_request("stuck", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2,
                                                              allowed_token_ids=[eos]))
        finals = {}
        while engine.has_unfinished():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        out = finals["stuck"]
        assert "every allowed token is masked" in str(out.error)
        assert (out.error_by_request, out.error_param) == (True, "allowed_token_ids")
    finally:
        engine.shutdown()
