"""CUDA graphs for decode on a real GPU (``pytest -m gpu``; benches/gpu_check.sh runs them).

Graphs against the eager engine (greedy, float32, with prefix caching, chunked prefill and
preemption) and against transformers; each graph's replay bit-identical to the eager padded
forward of the same batch; a decode step wider than the largest capture size runs eagerly.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.attention.cuda_backend import CudaAttentionBackend
from pagedrs.decode_graphs import capture_sizes
from pagedrs.decode_graphs.capture import validation_step
from test_kernels_engine import hf_greedy, make_head64_model, prompts, run_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs a CUDA device and CuPy"),  # fmt: skip
]


@pytest.fixture(scope="module")
def head64_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("head64-llama-graphs")
    return folder, make_head64_model("llama", folder)


def gpu_engine(folder, **kw) -> Engine:
    args = dict(model=str(folder), device="cuda", dtype="float32", block_size=8, num_gpu_blocks=24, max_model_len=256,
                max_num_batched_tokens=24, max_num_seqs=6, swap_space_gb=0.01, preemption_mode="swap",
                enable_prefix_caching=True, admission_policy="prompt_only", watermark=0.0)  # fmt: skip
    args.update(kw)
    return Engine(EngineArgs(**args), attention_backend=CudaAttentionBackend())


def test_graphs_equal_the_eager_engine_and_transformers(head64_llama):
    folder, hf = head64_llama
    graphs = gpu_engine(folder)
    executor = graphs.core.executor
    assert executor.decode_graph_sizes == (1, 2, 4, 8)
    eager = gpu_engine(folder, enforce_eager=True)
    assert eager.core.executor.decode_graph_sizes == () and eager.core.executor.runner.padding is None
    ps = prompts(graphs.loaded.config.vocab_size, 8, shared=17, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(ps)}
    got, want = run_all(graphs, requests), run_all(eager, requests)
    assert got == want
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == [hf_greedy(hf, p, 16)], f"request r{i}"
    assert graphs.stats()["num_preemptions"] > 0 and graphs.stats()["prefix_hits"] > 0


@torch.inference_mode()
def test_each_replay_is_bit_identical_to_the_eager_padded_forward(head64_llama):
    folder, _ = head64_llama
    engine = gpu_engine(folder, num_gpu_blocks=64, max_num_seqs=32)
    runner = engine.core.executor.runner
    assert runner.graphs is not None and runner.graphs.sizes == (1, 2, 4, 8, 16, 24, 32)
    for size in runner.graphs.sizes:
        step = validation_step(size, 32, 8, engine.loaded.config.vocab_size, runner.static.scratch_block, seed=size)
        want = runner.padded_forward(runner.static.fill(step, size)).clone()
        got = runner.graphs.replay(runner.static.fill(step, size))
        assert torch.equal(got, want), f"size {size}"
        real = runner.execute(step)  # the runner's own path: the graph, the padding rows dropped
        assert torch.equal(real, want[:size])


def test_a_decode_step_wider_than_the_largest_capture_size_runs_eagerly(head64_llama, monkeypatch):
    folder, _ = head64_llama
    monkeypatch.setattr("pagedrs.executor.local.capture_sizes", lambda n: capture_sizes(n, limit=2))
    engine = gpu_engine(folder, num_gpu_blocks=64)
    runner = engine.core.executor.runner
    assert runner.graphs is not None and runner.graphs.sizes == (1, 2)
    ps = prompts(engine.loaded.config.vocab_size, 5, shared=0, seed=2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = gpu_engine(folder, num_gpu_blocks=64, enforce_eager=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(ps)}
    assert run_all(engine, requests) == run_all(eager, requests)
