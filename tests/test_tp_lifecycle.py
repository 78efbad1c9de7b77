"""A tensor-parallel LLM's lifecycle without an explicit shutdown: garbage collection, a
``with`` block and interpreter exit each stop the workers and destroy the process group,
so the next tensor-parallel LLM in the same process starts and answers.

Each scenario runs in a fresh interpreter (the process group is per process, and a broken
lifecycle must not leak into the other tests); the script prints what it saw as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

psutil = pytest.importorskip("psutil")

PREAMBLE = """
import gc, json, sys, time
import psutil, torch.distributed as dist
from pagedrs import LLM, SamplingParams

KW = dict(model=sys.argv[1], block_size=4, num_gpu_blocks=64, max_model_len=128, cpu_threads=1)
PROMPTS = [{"prompt_token_ids": [20 + (i * 13 + j * 7) % 250 for j in range(3 + 5 * i)]} for i in range(3)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def answer(llm):
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def live_children():
    return sorted(p.pid for p in psutil.Process().children(recursive=True)
                  if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()))


def settled_children(deadline_s=10.0):
    # shutdown joins the workers; give a busy machine a moment to reap them all the same
    end = time.monotonic() + deadline_s
    while live_children() and time.monotonic() < end:
        time.sleep(0.1)
    return live_children()
"""


def run_script(body: str, model_dir, timeout: float = 150) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PREAMBLE + textwrap.dedent(body), str(model_dir)],
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_tp_llms_one_after_the_other_without_shutdown_then_a_with_block(tiny_llama_dir):
    proc, _ = run_script("""
        one = LLM(**KW)
        expected = answer(one)
        del one
        seen = []
        for _ in range(2):  # no shutdown(): del + collection must stop the workers and the group
            llm = LLM(tensor_parallel_size=2, **KW)
            workers = [p.pid for p in llm.engine.executor._workers]
            got = answer(llm)
            del llm
            gc.collect()
            seen.append(dict(got=got, workers=workers, initialized=dist.is_initialized(),
                             left=settled_children()))
        with LLM(tensor_parallel_size=2, **KW) as llm:
            got = answer(llm)
            inside = dist.is_initialized()
        seen.append(dict(got=got, workers=[], initialized=dist.is_initialized(), left=settled_children(),
                         inside=inside))
        print(json.dumps(dict(expected=expected, seen=seen)))
    """, tiny_llama_dir)
    out = last_json(proc)
    assert len(out["expected"]) == 3 and all(len(t) == 8 for t in out["expected"])
    for i, s in enumerate(out["seen"]):
        assert s["got"] == out["expected"], f"LLM {i}: tensor-parallel greedy tokens differ from one rank"
        assert s["initialized"] is False, f"LLM {i}: the default process group outlived the LLM"
        assert s["left"] == [], f"LLM {i}: processes left behind: {s['left']} (its workers were {s['workers']})"
    assert out["seen"][2]["inside"] is True
    assert all(len(s["workers"]) == 1 for s in out["seen"][:2])


def test_interpreter_exit_stops_the_workers_of_a_live_tp_llm(tiny_llama_dir):
    """No del, no shutdown: at exit the workers get STOP and exit 0 (not terminated by
    multiprocessing's exit hook), and the process group is destroyed; none outlives it."""
    proc, _ = run_script("""
        import atexit
        seen = {}
        def report():  # registered before the engine's hooks, so it runs after them
            print(json.dumps(dict(workers=[p.pid for p in seen["workers"]], initialized=dist.is_initialized(),
                                  exitcodes=[p.exitcode for p in seen["workers"]])), flush=True)
        atexit.register(report)
        llm = LLM(tensor_parallel_size=2, **KW)
        answer(llm)
        seen["workers"] = list(llm.engine.executor._workers)
    """, tiny_llama_dir)
    out = last_json(proc)
    assert out["exitcodes"] == [0], f"the worker did not stop cleanly at exit: {out}"
    assert out["initialized"] is False, "the default process group outlived the interpreter's exit hooks"
    assert "cannot run another step" not in proc.stderr, proc.stderr[-4000:]
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(w) and psutil.Process(w).status() != psutil.STATUS_ZOMBIE for w in out["workers"]):
        assert time.monotonic() < deadline, f"worker {out['workers']} outlived its interpreter"
        time.sleep(0.1)
