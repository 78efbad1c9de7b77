"""The engine end to end with ``CudaAttentionBackend``, its kernels executed by the CPU emulator.

This is the path a GPU takes, minus the GPU: the runner builds the step's
metadata, the backend plans work items and split-K, ``ops`` launches
reshape_and_cache, paged attention, copy_blocks and the swap copies -- and the
greedy tokens must equal transformers' on the tiny models of conftest.py (llama
with GQA, mistral with MQA, qwen2 with q/k/v bias), with prefix caching, chunked
prefill and preemption by swapping all happening in the same run; and on a tiny
Mistral whose sliding window is much shorter than its contexts.

The tiny models here have head_dim 64 (conftest's use 16, which the kernels'
dispatch table does not list); everything else is conftest's configuration.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import TINY_CONFIGS, make_tiny_model
from cuda_emu.build import SUPPORTED_MACHINE
from cuda_emu.runtime import EmulatedRuntime
from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.attention import TorchAttentionBackend
from pagedrs.attention.cuda_backend import CudaAttentionBackend

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not SUPPORTED_MACHINE, reason="the CUDA emulator runs on x86-64 only")

# One schedule per model: together they cover all three in `make test`.
SCHEDULE = {"llama": "forward", "mistral": "warp-random", "qwen2": "reverse"}


def make_head64_model(model_type: str, folder: Path, seed: int = 0, **sizes):
    """conftest.make_tiny_model with 4 heads of 64 (hidden 256), a size the kernels are built for."""
    return make_tiny_model(model_type, folder, seed, **{"hidden_size": 256, "intermediate_size": 256, "head_dim": 64, **sizes})


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def head64(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"head64-{request.param}")
    model = make_head64_model(request.param, folder)
    return request.param, folder, model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt_ids) :]


def emulated_engine(folder: Path, runtime: EmulatedRuntime, variant: str = "v1", **kw) -> Engine:
    args = dict(model=str(folder), block_size=8, num_gpu_blocks=64, swap_space_gb=0.01, max_model_len=256, watermark=0.0)
    args.update(kw)
    return Engine(EngineArgs(**args), attention_backend=CudaAttentionBackend(runtime=runtime, variant=variant))


# the attention kernels each variant launches over a run with prefill chunks and decode steps
KERNELS = {"v1": {"pagedrs::paged_attention_kernel"},
           "v2": {"pagedrs::paged_attention_kernel", "pagedrs::paged_attention_v2_kernel"}}  # fmt: skip


def run_all(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[list[int]]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
        engine.scheduler.check_invariants()
    return done


def prompts(vocab: int, count: int, shared: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (3 + (7 * i + 5) % 23,), generator=g).tolist() for i in range(count)]


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_greedy_equals_transformers_with_prefix_caching_chunked_prefill_and_swapping(head64, variant):
    """v2: decode tokens by the v2 kernel, also inside steps whose prefill chunks go to v1
    (the tiny models' groups: llama 2, mistral 4 (MQA), qwen2 2)."""
    model_type, folder, hf = head64
    runtime = EmulatedRuntime(schedule=SCHEDULE[model_type])
    # 10 pages of 8 tokens for 8 requests of up to ~60 tokens: preemption by swapping;
    # a 24-token budget cuts prompts into chunks; a 17-token shared prefix gives prefix hits.
    engine = emulated_engine(folder, runtime, variant, num_gpu_blocks=10, max_num_batched_tokens=24, max_num_seqs=6,
                             preemption_mode="swap", enable_prefix_caching=True,
                             admission_policy="prompt_only")  # optimistic admission: the pool must preempt
    ps = prompts(engine.loaded.config.vocab_size, 8, shared=17, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    done = run_all(engine, {f"r{i}": (p, params) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert done[f"r{i}"] == [hf_greedy(hf, p, 16)], f"request r{i} ({model_type}, {runtime.schedule})"
    stats = engine.stats()
    assert stats["prefix_hits"] > 0
    assert stats["num_swap_preemptions"] > 0 and stats["swap_in_blocks"] == stats["swap_out_blocks"] > 0
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    kernels = {name.split("<")[0] for name, _, _ in runtime.launches}
    assert kernels == KERNELS[variant] | {"pagedrs::reshape_and_cache_kernel"}
    chunks = [grid for name, grid, _ in runtime.launches if "paged_attention" in name and grid[1] > 1]
    assert chunks, "no step attended with more than one work item"


def test_forked_samples_copy_on_write_through_the_kernels(tiny_head64_llama):
    """n = 3 seeded samples share the prompt's pages and copy the partly filled last one
    (copy_blocks); they must equal the same run on the PyTorch reference backend."""
    folder = tiny_head64_llama
    runtime = EmulatedRuntime(schedule="warp-random", seed=3)
    engine = emulated_engine(folder, runtime)
    prompt = prompts(engine.loaded.config.vocab_size, 2, shared=0, seed=4)[1]
    assert len(prompt) % 8 != 0
    params = SamplingParams(n=3, seed=123, max_tokens=10, temperature=1.0, ignore_eos=True)
    got = run_all(engine, {"n3": (prompt, params)})["n3"]
    assert engine.stats()["cow_copies"] >= 2
    assert any(name == "pagedrs::copy_blocks_kernel" for name, _, _ in runtime.launches)
    ref_engine = Engine(EngineArgs(model=str(folder), block_size=8, num_gpu_blocks=64, max_model_len=256),
                        attention_backend=TorchAttentionBackend())  # fmt: skip
    want = run_all(ref_engine, {"n3": (prompt, params)})["n3"]
    assert got == want
    assert len({tuple(t) for t in got}) > 1  # the samples really differ


@pytest.fixture(scope="module")
def tiny_head64_llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("head64-llama-fork")
    make_head64_model("llama", folder)
    return folder


# ---------------------------------------------------------------- sliding window

WINDOW = 12  # positions each token sees; pages of 8, so windows start mid-page


@pytest.fixture(scope="module")
def head64_mistral_window(tmp_path_factory):
    folder = tmp_path_factory.mktemp("head64-mistral-window")
    return folder, make_head64_model("mistral", folder, seed=2, sliding_window=WINDOW)


def window_requests(vocab: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Prompts of 3 to 64 tokens and 40 new ones (contexts up to 104: over eight windows), two
    sharing a 24-token prefix; prompts longer than the 16-token step budget are chunked."""
    ps = prompts(vocab, 4, shared=24, seed=6)[2:] + prompts(vocab, 3, shared=0, seed=7)
    ps[-1] = ps[-1][:3]
    ps[0] = ps[0] + ps[1][-10:] + ps[2][:16]  # 64 tokens
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    return {f"w{i}": (p, params) for i, p in enumerate(ps)}


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_sliding_window_greedy_equals_transformers(head64_mistral_window, variant):
    """The window reaches the kernels (per layer) and the result is transformers' greedy output;
    the same model with full attention generates other tokens, so ignoring it cannot pass."""
    folder, hf = head64_mistral_window
    runtime = EmulatedRuntime(schedule="warp-random", seed=1)
    engine = emulated_engine(folder, runtime, variant, max_num_batched_tokens=16, enable_prefix_caching=True)
    assert engine.loaded.config.sliding_window == WINDOW
    requests = window_requests(engine.loaded.config.vocab_size)
    done = run_all(engine, requests)
    want = {rid: [hf_greedy(hf, p, 40)] for rid, (p, _) in requests.items()}
    assert done == want
    stats = engine.stats()
    assert stats["prefix_hits"] > 0
    # the core released pages that fell out of the window: their table entries hold its
    # placeholder id, which the kernels must never have read
    assert stats["window_released_blocks"] > 0
    assert {name.split("<")[0] for name, _, _ in runtime.launches if "paged_attention" in name} == KERNELS[variant]
    hf.config.sliding_window = None  # transformers without the window
    try:
        assert any(hf_greedy(hf, p, 40) != want[rid][0] for rid, (p, _) in requests.items())
    finally:
        hf.config.sliding_window = WINDOW


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                    reason="needs a CUDA device and CuPy")  # fmt: skip
@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_sliding_window_on_the_gpu_equals_transformers(head64_mistral_window, variant):
    """The same run on a real GPU, the kernels compiled by NVRTC and launched by CuPy."""
    folder, hf = head64_mistral_window
    args = EngineArgs(model=str(folder), device="cuda", dtype="float32", block_size=8, num_gpu_blocks=64,
                      max_model_len=256, max_num_batched_tokens=16, enable_prefix_caching=True)  # fmt: skip
    engine = Engine(args, attention_backend=CudaAttentionBackend(variant=variant))
    requests = window_requests(engine.loaded.config.vocab_size)
    assert run_all(engine, requests) == {rid: [hf_greedy(hf, p, 40)] for rid, (p, _) in requests.items()}


def test_window_on_some_layers_only_equals_transformers(tmp_path):
    """Qwen2 slides from layer max_window_layers on: each step attends with the window on
    layer 1 and without on layer 0, each with its own split plan (decode steps split here)."""
    hf = make_head64_model("qwen2", tmp_path, seed=3, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                           max_position_embeddings=2048)  # fmt: skip
    runtime = EmulatedRuntime(schedule="forward", sms=10_000)  # many "SMs": decode contexts over 1024 split
    engine = emulated_engine(tmp_path, runtime, max_model_len=1100, num_gpu_blocks=140, max_num_batched_tokens=2048)
    config = engine.loaded.config
    assert [config.layer_sliding_window(i) for i in range(2)] == [None, 8]
    long_prompt = prompts(config.vocab_size, 1, shared=0, seed=8)[0] * 150  # 8 tokens, repeated
    requests = {"long": (long_prompt[:1030], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)),
                "short": (long_prompt[:30], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))}  # fmt: skip
    done = run_all(engine, requests)
    assert done == {rid: [hf_greedy(hf, p, sp.max_tokens)] for rid, (p, sp) in requests.items()}
    grids = [grid for name, grid, _ in runtime.launches if "paged_attention" in name]
    split_at = [i for i, grid in enumerate(grids) if grid[2] > 1]
    assert split_at, "layer 0 never split the long context"
    assert all(grids[i + 1][2] == 1 for i in split_at), "layer 1 split its 8-key window"
