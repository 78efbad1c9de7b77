"""Tensor parallelism on the CPU (gloo, spawned ranks): the same greedy tokens as one rank and
as transformers, in every mode; clear refusals; a killed worker never hangs the engine and
leaves no orphan process.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

psutil = pytest.importorskip("psutil")

from engine_runs import final_outputs  # noqa: E402
from pagedrs import Engine, EngineArgs, SamplingParams  # noqa: E402
from pagedrs.distributed.tp_executor import ExecutorDeadError  # noqa: E402

BASE = dict(block_size=4, num_gpu_blocks=64, max_model_len=128, swap_space_gb=0.001, cpu_threads=1)


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(max_new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def run(engine: Engine, prompts, params) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in final_outputs(engine, prompts, params)]


def prompts_for(shared: int = 0) -> list[list[int]]:
    prefix = [7 + (3 * i) % 200 for i in range(shared)]
    return [prefix + [20 + (i * 13 + j * 7) % 250 for j in range(3 + (5 * i) % 17)] for i in range(6)]


@pytest.fixture
def tp2(request):
    engines = []

    def make(model_dir, **kw):
        engine = Engine(EngineArgs(model=str(model_dir), tensor_parallel_size=2, **{**BASE, **kw}))
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.shutdown()


def test_tp2_equals_transformers_and_tp1_on_every_tiny_model(tiny_model_dir, tp2):
    """llama (2 KV heads: split), qwen2 (q/k/v biases), mistral (1 KV head: replicated on both ranks)."""
    prompts = prompts_for()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = hf_greedy(tiny_model_dir, prompts, 10)
    got = run(tp2(tiny_model_dir), prompts, params)
    assert [g[0] for g in got] == expected


@pytest.mark.parametrize(
    "mode",
    [dict(enable_prefix_caching=True), dict(enable_prefix_caching=False, max_num_batched_tokens=5),
     # prompt-only admission: a pool this small must preempt
     dict(num_gpu_blocks=14, preemption_mode="swap", watermark=0.0, admission_policy="prompt_only"),
     dict(num_gpu_blocks=14, preemption_mode="recompute", watermark=0.0, admission_policy="prompt_only")],
    ids=["prefix-caching", "chunked-prefill", "swap", "recompute"],
)
def test_tp2_equals_tp1_in_every_mode(tiny_llama_dir, tp2, mode):
    prompts = prompts_for(shared=9)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = Engine(EngineArgs(model=str(tiny_llama_dir), **{**BASE, **mode}))
    expected = run(one, prompts, params)
    engine = tp2(tiny_llama_dir, **mode)
    assert run(engine, prompts, params) == expected
    stats = engine.stats()
    if "preemption_mode" in mode:
        assert stats["num_preemptions"] > 0
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]


def test_tp2_n_samples_with_copy_on_write_equal_tp1(tiny_llama_dir, tp2):
    params = SamplingParams(n=3, max_tokens=9, temperature=0.8, seed=5, ignore_eos=True)
    prompts = prompts_for()[:3]
    one = run(Engine(EngineArgs(model=str(tiny_llama_dir), **BASE)), prompts, params)
    assert run(tp2(tiny_llama_dir), prompts, params) == one


@pytest.mark.parametrize(
    "mode",
    [dict(enable_prefix_caching=True),
     dict(num_gpu_blocks=14, preemption_mode="swap", watermark=0.0, admission_policy="prompt_only")],
    ids=["prefix-caching", "swap"],
)
def test_tp2_with_asynchronous_scheduling_equals_tp1(tiny_llama_dir, tp2, mode):
    """The step worker drives the ranks (rank 0's forward and the step broadcast) while the core
    plans the next step: greedy tokens and seeded n > 1 samples (copy-on-write forks) equal one
    synchronous rank's, through prefix hits and swaps, and every page comes back."""
    prompts = prompts_for(shared=9)
    greedy_params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(n=3, max_tokens=9, temperature=0.8, seed=5, ignore_eos=True)
    one = Engine(EngineArgs(model=str(tiny_llama_dir), **{**BASE, **mode}))
    expected = run(one, prompts, greedy_params), run(one, prompts[:3], sampled)
    engine = tp2(tiny_llama_dir, async_scheduling=True, **mode)
    assert type(engine.executor).__name__ == "AsyncExecution"
    assert (run(engine, prompts, greedy_params), run(engine, prompts[:3], sampled)) == expected
    stats = engine.stats()
    if "preemption_mode" in mode:
        assert stats["num_preemptions"] > 0
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]


def test_heads_not_divisible_by_tp_are_refused_before_serving(tiny_llama_dir):
    """The tiny llama has 4 attention heads: 3 ranks cannot split them."""
    before = {p.pid for p in _live_children()}
    with pytest.raises(ValueError, match="num_heads"):
        Engine(EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=3, **BASE))
    deadline = time.monotonic() + 60
    while {p.pid for p in _live_children()} - before:
        assert time.monotonic() < deadline, "worker processes left behind after a refused start"
        time.sleep(0.1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_killed_worker_fails_requests_and_leaves_no_orphans(tiny_llama_dir, async_scheduling):
    before = {p.pid for p in _live_children()}
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, async_scheduling=async_scheduling,
                               **BASE))
    workers = (engine.executor.inner if async_scheduling else engine.executor)._workers
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    os.kill(workers[0].pid, signal.SIGKILL)
    with pytest.raises(ExecutorDeadError):
        for _ in range(1000):  # a dead worker is noticed at the next collective: never 1000 steps
            engine.step()
    assert engine.num_unfinished() == 0
    engine.shutdown()
    assert all(not p.is_alive() for p in workers)
    deadline = time.monotonic() + 60
    while {p.pid for p in _live_children()} - before:  # reaping may take a moment on a busy machine
        assert time.monotonic() < deadline, f"orphan processes left behind: {_live_children()}"
        time.sleep(0.1)


def _live_children() -> list:
    """Child processes still running, but multiprocessing's own resource tracker (it lives as long as we do)."""
    live = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                live.append(p)
        except psutil.NoSuchProcess:
            pass
    return live


def test_the_embedded_smollm2_runs_on_three_ranks_and_refuses_two():
    """9 attention heads and 3 KV heads: tp=3 splits both; tp=2 cannot split the heads."""
    kw = dict(model="smollm2-135m", weight_dtype="float32", block_size=16, num_gpu_blocks=64, max_model_len=256,
              cpu_threads=1)
    with pytest.raises(ValueError, match="num_heads=9 is not divisible by tp_size=2"):
        Engine(EngineArgs(tensor_parallel_size=2, **kw))
    prompts = ["The capital of France is", "def fib(n):"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = run(Engine(EngineArgs(**kw)), prompts, params)
    engine = Engine(EngineArgs(tensor_parallel_size=3, **kw))
    try:
        assert run(engine, prompts, params) == expected
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 CUDA devices")
def test_tp_on_cuda_equals_one_rank(tmp_path, monkeypatch):
    """NCCL across 2 ranks against the one-rank CUDA engine, through the CUDA kernels (a geometry they
    are built for: heads of 64, block 8; PAGEDRS_ATTENTION_BACKEND=cuda refuses a silent fallback)."""
    from conftest import make_tiny_model

    make_tiny_model("llama", tmp_path, hidden_size=256, intermediate_size=256, head_dim=64)
    monkeypatch.setenv("PAGEDRS_ATTENTION_BACKEND", "cuda")
    kw = dict(BASE, device="cuda", block_size=8)
    prompts = prompts_for(shared=9)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = Engine(EngineArgs(model=str(tmp_path), **kw))
    expected = run(one, prompts, params)
    one.shutdown()
    engine = Engine(EngineArgs(model=str(tmp_path), tensor_parallel_size=2, **kw))
    try:
        assert run(engine, prompts, params) == expected
    finally:
        engine.shutdown()


def test_serve_with_two_ranks_answers_the_openai_client_and_sigterm_stops_every_rank(tiny_llama_dir):
    """`pagedrs serve --tensor-parallel-size 2`: the API process, its engine core process and the
    core's worker rank; SIGTERM drains and every process exits."""
    import subprocess
    import sys

    openai = pytest.importorskip("openai")
    from pagedrs.net import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedrs.server", "--model", str(tiny_llama_dir), "--port", str(port),
         "--tensor-parallel-size", "2", "--block-size", "4", "--num-gpu-blocks", "64", "--max-model-len", "128",
         "--cpu-threads", "1", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                out = client.completions.create(model=str(tiny_llama_dir), prompt=[5, 6, 7], max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True})
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        assert out.usage.completion_tokens == 6
        tree = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) >= 3  # API process, engine core, worker rank (and the resource tracker)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        deadline = time.monotonic() + 60
        while [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]:
            assert time.monotonic() < deadline, "a rank outlived the server"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
