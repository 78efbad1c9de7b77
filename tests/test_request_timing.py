"""Where a request's time to first token goes: the engine's per-request stamps (vLLM's
RequestMetrics), the prefill-first step order, the server's histograms and request trace."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import pytest

from pagedrs import Engine, EngineArgs, SamplingParams

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from server_fakes import assert_nothing_left, live_server  # noqa: E402

KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks=64, max_model_len=64,
                          swap_space_gb=0.001)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(engine: Engine) -> dict[str, Any]:
    """Steps to the end; each request's final metrics."""
    metrics: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            metrics[out.request_id] = out.metrics
    return metrics


def test_metrics_count_the_steps_waited_and_the_prompt_chunks(tiny_llama_dir: Path) -> None:
    # One sequence at a time, 8 tokens a step: a's 20-token prompt takes 3 steps (8, 8, 4) and
    # its second token a 4th; b (4 tokens) waits those 4 steps, then prefills in one.
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), max_num_seqs=1, max_num_batched_tokens=8, **KW))
    sent = time.monotonic() - 5.0  # a front end stamped it 5 s ago
    engine.add_request("a", {"prompt_token_ids": list(range(3, 23))}, greedy(2))
    engine.add_request("b", {"prompt_token_ids": [5, 6, 7, 8]}, greedy(2), arrival_time=sent)
    m = run(engine)
    assert (m["a"]["num_steps_queued"], m["a"]["num_prefill_steps"]) == (0, 3)
    assert (m["b"]["num_steps_queued"], m["b"]["num_prefill_steps"]) == (4, 1)
    assert m["b"]["arrival_time"] == sent and m["b"]["queued_time"] > sent
    # b was scheduled only after a had finished; a's first token came at the end of its 3rd step
    assert m["a"]["queued_time"] <= m["a"]["first_scheduled_time"] < m["a"]["first_token_time"]
    assert m["b"]["first_scheduled_time"] >= m["a"]["finished_time"]
    assert m["b"]["time_in_queue"] == m["b"]["first_scheduled_time"] - m["b"]["queued_time"]
    assert m["b"]["first_token_time"] > m["b"]["first_scheduled_time"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "12.5", True])
def test_a_bad_arrival_time_is_refused_naming_it_and_changes_nothing(tiny_llama_dir: Path, bad: object) -> None:
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), **KW))
    with pytest.raises(ValueError, match=r"arrival_time is .*; it must be a finite time.monotonic\(\) value or None"):
        engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, greedy(2), arrival_time=bad)  # type: ignore[arg-type]
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, greedy(2))  # the id was not taken
    assert run(engine)["x"]["num_prefill_steps"] == 1


def _step(engine: Engine, got: dict[str, list[int]]) -> list[str]:
    """Runs one step, collecting its tokens into ``got``; the requests that gained one."""
    outs = [o for o in engine.step() if o.outputs[0].delta_token_ids]
    for o in outs:
        got.setdefault(o.request_id, []).extend(o.outputs[0].delta_token_ids)
    return sorted(o.request_id for o in outs)


def test_prefill_first_runs_a_new_prompt_alone_and_changes_no_token(tiny_llama_dir: Path) -> None:
    tokens: dict[bool, dict[str, list[int]]] = {}
    for on in (False, True):
        engine = Engine(EngineArgs(model=str(tiny_llama_dir), prefill_first=on, **KW))
        got: dict[str, list[int]] = {}
        progress = functools.partial(_step, engine, got)

        engine.add_request("r1", {"prompt_token_ids": [5, 6, 7, 8, 9]}, greedy(6))
        engine.add_request("r2", {"prompt_token_ids": [9, 8, 7]}, greedy(6))
        assert progress() == ["r1", "r2"]
        assert progress() == ["r1", "r2"]
        engine.add_request("r3", {"prompt_token_ids": [11, 12, 13, 14, 15, 16]}, greedy(4))
        # prefill first: r3's step runs r3 only, and the next one every decode (never two in a row)
        assert progress() == (["r3"] if on else ["r1", "r2", "r3"])
        assert progress() == ["r1", "r2", "r3"]
        while engine.has_unfinished():
            progress()
        tokens[on] = got
    assert tokens[True] == tokens[False]
    assert [len(tokens[True][r]) for r in ("r1", "r2", "r3")] == [6, 6, 4]


def test_prefill_first_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="prefill_first is 'yes'; it must be True or False"):
        EngineArgs(prefill_first="yes")  # type: ignore[arg-type]


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_the_server_records_where_the_first_token_went(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from pagedrs.server.request_trace import RequestTrace

    trace = RequestTrace(str(tmp_path / "trace.jsonl"))
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    with live_server(tiny_llama_dir, KW, "tiny", trace=trace) as live:
        r = httpx.post(live.url + "/v1/completions", json=body, headers={"X-Request-Id": "bench.7"}, timeout=60)
        assert r.status_code == 200
        bad = httpx.post(live.url + "/v1/completions", json=body, headers={"X-Request-Id": "a b"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
        assert "1-128 characters" in bad.json()["error"]["message"]
        metrics = httpx.get(live.url + "/metrics", timeout=60).text
        assert_nothing_left(live.loop)
    trace.close()
    for name in ("handoff_time", "queue_time", "prefill_time"):
        assert _metric(metrics, f"pagedrs_request_{name}_seconds_count") == 1.0
    lines = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert len(lines) == 1
    line = lines[0]
    assert line["request_id"].startswith("bench.7-") and line["request_id"].endswith("-0")
    stamps = [line[k] for k in ("api_arrival", "queued", "first_scheduled", "first_token", "dispatched")]
    assert stamps == sorted(stamps), line
    assert (line["num_steps_queued"], line["num_prefill_steps"]) == (0, 1)


@pytest.mark.parametrize(("argv", "expected"), [
    ([], True),  # the CPU default: a step costs the sum of its parts there
    (["--device", "cuda"], False),
    (["--no-prefill-first"], False),
    (["--device", "cuda", "--prefill-first"], True),
])
def test_serve_turns_prefill_first_on_for_the_cpu_unless_told(argv: list[str], expected: bool) -> None:
    from pagedrs.server.cli import build_parser, engine_kwargs

    assert engine_kwargs(build_parser().parse_args(argv))["prefill_first"] is expected


def test_the_bench_breakdown_joins_client_and_trace_and_its_parts_add_up(tmp_path: Path) -> None:
    from pagedrs.bench import ttft_breakdown as tb

    stamps = {"api_arrival": 10.5, "queued": 11.0, "first_scheduled": 11.25, "first_token": 12.0, "dispatched": 12.5}
    lines = [{"request_id": "bench7-0a1b-0", **stamps, "num_steps_queued": 2, "num_prefill_steps": 3},
             {"request_id": "bench8-0a1c-0", **stamps, "num_steps_queued": 0, "num_prefill_steps": 1}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = tb.read_trace(str(path))
    assert sorted(trace) == ["bench7", "bench8"]
    # bench8 arrived before the server was full: left out of the steady set
    client = {"bench7": (10.0, 13.0, True), "bench8": (10.0, 13.0, False), "bench9": (10.0, 13.0, True)}
    (timeline,) = tb.join(client, trace)
    parts = {name: timeline.part(name) for name, _, _ in tb.PARTS}
    assert parts == {"client_to_api": 0.5, "handoff": 0.5, "queue": 0.25, "prefill": 0.75, "core_to_api": 0.5,
                     "api_to_client": 0.5}
    assert sum(parts.values()) == timeline.ttft == 3.0
    summary = tb.summarize([timeline])
    assert summary["num_prefill_steps"]["p99"] == 3.0 and summary["queue"]["p50"] == 0.25
    assert len(tb.join(client, trace, steady_only=False)) == 2


def test_a_torn_or_foreign_trace_line_is_skipped_not_fatal(tmp_path: Path) -> None:
    """The server killed mid-write leaves a torn last line; junk, non-objects and non-UTF-8 bytes are skipped too."""
    from pagedrs.bench import ttft_breakdown as tb

    good = json.dumps({"request_id": "bench1-0a1b-0", "queued": 1.0})
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\n".join([good.encode(), b"[1, 2]", b'{"request_id": 7}', b"\xff\xfe{", good[:20].encode()]))
    assert list(tb.read_trace(str(path))) == ["bench1"]


def test_an_unopenable_request_trace_is_refused_before_any_engine_starts(tmp_path: Path, capsys, monkeypatch) -> None:
    """A directory, or a path under a missing one: exit 2 naming the flag, and no engine (core process) built."""
    import pagedrs
    from pagedrs.server.cli import main

    monkeypatch.setattr(pagedrs, "EngineArgs", lambda **kw: pytest.fail("the engine was configured"))
    for path in (tmp_path, tmp_path / "missing" / "trace.jsonl"):
        assert main(["--model", "unused", "--request-trace", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"--request-trace {str(path)!r} cannot be opened for appending" in err

