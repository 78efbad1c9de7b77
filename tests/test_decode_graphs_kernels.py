"""The CUDA side of the padded decode path, without a GPU: the kernels under the CPU emulator.

A graph replays the launches of its capture, so per capture size the attention must launch the
same grid with the same ``part_tokens`` over the same split-K buffers whatever the step's
contexts (``CudaAttentionBackend.plan_padded_decode``). The split then covers the table width,
not the longest context, and short rows leave partitions empty; both kernels mark those and the
reduce skips them. Here: the fixed split's output equals the per-step split's (and the float64
reference) on poisoned caches, the launches do not change between steps of one size, and the
engine on the emulated kernels with padded decode steps equals transformers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cuda_emu.build import SUPPORTED_MACHINE
from cuda_emu.runtime import EmulatedRuntime
from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.attention import TorchAttentionBackend
from pagedrs.attention.cuda_backend import CudaAttentionBackend
from pagedrs.kernels.dispatch import VARIANTS
from pagedrs.kernels.planning import V1
from test_kernels_emulated import DTYPES, _case, _rel_err
from test_kernels_engine import (
    WINDOW,
    emulated_engine,
    hf_greedy,
    make_head64_model,
    prompts,
    run_all,
    window_requests,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not SUPPORTED_MACHINE, reason="the CUDA emulator runs on x86-64 only")


def _widen(meta, width: int, poison_id: int):
    """The metadata with its block tables widened to ``width`` columns of an id past the cache
    (what the padded path's fixed width adds; a read of one would fail)."""
    tables = meta.block_tables
    wide = torch.full((tables.shape[0], width), poison_id, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    return dataclasses.replace(meta, block_tables=wide, plan=None)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("dtype_name", "group", "head", "block", "seq_lens"), [
    ("bfloat16", 4, 64, 16, [1, 17, 300, 1100]),
    ("float32", 1, 128, 16, [5, 2000]),
    ("float16", 3, 64, 8, [1, 1, 9, 700]),
])  # fmt: skip
def test_the_fixed_split_gives_the_per_step_splits_output(variant, dtype_name, group, head, block, seq_lens) -> None:
    dtype, tol = DTYPES[dtype_name]
    kv_heads, max_keys = 2, 2048
    q, kc, vc, clean_k, clean_v, clean_tables, meta = _case(dtype, seq_lens, [1] * len(seq_lens), kv_heads, group,
                                                            head, block, seed=len(seq_lens))  # fmt: skip
    scale = head**-0.5
    want = TorchAttentionBackend().forward(q.double(), clean_k.double(), clean_v.double(),
                                           dataclasses.replace(meta, block_tables=clean_tables), scale)  # fmt: skip
    runtime = EmulatedRuntime(schedule="warp-random", seed=1)
    backend = CudaAttentionBackend(num_sms=1000, runtime=runtime, variant=variant, split_rule=V1)
    per_step = backend.forward(q, kc, vc, meta, scale, out=torch.full(q.shape, float("nan"), dtype=dtype))
    fixed_meta = _widen(meta, max_keys // block, kc.shape[0] + 7)
    plan = backend.plan_padded_decode(fixed_meta, block, kv_heads * group, kv_heads, max_keys)
    fixed = backend.forward(q, kc, vc, fixed_meta, scale, out=torch.full(q.shape, float("nan"), dtype=dtype))
    split, step_split = plan.split, meta.plan.split
    assert split.num_parts * split.part_tokens >= max_keys and split.num_parts > 1
    assert split.num_parts >= step_split.num_parts
    assert min(seq_lens) <= (split.num_parts - 1) * split.part_tokens, "a short row leaves partitions empty"
    assert not fixed.isnan().any(), "an empty partition was merged, or a poisoned page was read"
    assert _rel_err(fixed, want) <= tol and _rel_err(per_step, want) <= tol
    assert _rel_err(fixed, per_step) <= tol
    grids = [grid for name, grid, _ in runtime.launches if "paged_attention" in name]
    assert grids[-1][2] == split.num_parts


@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_of_one_capture_size_launch_the_same_work_over_the_same_buffers(variant) -> None:
    """Two steps of four rows with other contexts: one plan object, the same grids and split, the same
    split-K buffers; outputs right for both (the second step's contexts are all short)."""
    runtime = EmulatedRuntime(schedule="forward")
    backend = CudaAttentionBackend(num_sms=1000, runtime=runtime, variant=variant, split_rule=V1)
    kv_heads, group, head, block, max_keys = 1, 4, 64, 16, 4096
    results, plans = [], []
    for seed, lens in ((1, [1500, 3, 40, 900]), (2, [2, 1, 17, 5])):
        q, kc, vc, clean_k, clean_v, clean_tables, meta = _case(torch.bfloat16, lens, [1] * 4, kv_heads, group, head,
                                                                block, seed)  # fmt: skip
        meta = _widen(meta, max_keys // block, kc.shape[0] + 7)
        plans.append(backend.plan_padded_decode(meta, block, kv_heads * group, kv_heads, max_keys))
        start = len(runtime.launches)
        got = backend.forward(q, kc, vc, meta, head**-0.5)
        results.append([(name, grid) for name, grid, _ in runtime.launches[start:]])
        want = TorchAttentionBackend().forward(q.double(), clean_k.double(), clean_v.double(),
                                               dataclasses.replace(meta, block_tables=clean_tables, plan=None),
                                               head**-0.5)  # fmt: skip
        assert _rel_err(got, want) <= DTYPES["bfloat16"][1]
    assert plans[0] is plans[1]
    assert results[0] == results[1] and any("reduce" in name for name, _ in results[0])
    buffers = plans[0].split_buffers
    assert list(buffers) == [plans[0].split.num_parts]


def test_plan_padded_decode_refuses_a_step_with_prefill_rows() -> None:
    backend = CudaAttentionBackend(num_sms=8, runtime=EmulatedRuntime(schedule="forward"))
    *_, meta = _case(torch.float32, [5, 9], [1, 3], 1, 1, 64, 16, seed=0)
    with pytest.raises(ValueError, match="decode-only"):
        backend.plan_padded_decode(meta, 16, 1, 1, 256)


@pytest.fixture(scope="module")
def head64_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("head64-llama-padded")
    return folder, make_head64_model("llama", folder)


@pytest.mark.parametrize(("variant", "split"), [("v1", False), ("v2", False), ("v2", True)])
def test_padded_decode_on_the_emulated_kernels_equals_transformers(head64_llama, variant, split) -> None:
    """The padded path as a GPU runs it before capture: static buffers, scratch page, the fixed
    split over the table width, with prefix caching, chunked prefill and swapping; every padded
    decode launch of one size has the same grid. ``split``: 2048 positions and 1000 SMs, so the
    fixed split has 8 partitions of 256 keys, and rows of under 100 keys leave 7 of them empty."""
    folder, hf = head64_llama
    runtime = EmulatedRuntime(schedule="warp-random", seed=2)
    kw = dict(num_gpu_blocks=14, max_num_batched_tokens=24, max_num_seqs=5, preemption_mode="swap",
              enable_prefix_caching=True, admission_policy="prompt_only", pad_decode=True)
    if split:
        backend = CudaAttentionBackend(num_sms=1000, runtime=runtime, variant=variant, split_rule=V1)
        engine = Engine(EngineArgs(model=str(folder), block_size=8, swap_space_gb=0.01, max_model_len=2048,
                                   watermark=0.0, **kw), attention_backend=backend)  # fmt: skip
    else:
        engine = emulated_engine(folder, runtime, variant, **kw)
    runner = engine.core.executor.runner
    assert runner.padding is not None and runner.padding.sizes == (1, 2, 4, 8) and runner.kv_cache.shape[2] == 15
    assert runner.padding.table_width == (256 if split else 32)
    ps = prompts(engine.loaded.config.vocab_size, 6, shared=17, seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    done = run_all(engine, {f"r{i}": (p, params) for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert done[f"r{i}"] == [hf_greedy(hf, p, 12)], f"request r{i}"
    stats = engine.stats()
    assert stats["prefix_hits"] > 0 and stats["num_swap_preemptions"] > 0
    # padded decode launches: one grid per capture size (the work items of P rows, the fixed split)
    padded = {}
    for name, grid, _ in runtime.launches:
        if "paged_attention" in name:
            padded.setdefault(grid[1], set()).add(grid)
    plans = runner.backend._padded_plans.values()
    assert plans, "no decode step ran padded"
    for plan in plans:
        items = plan.work_items.shape[0]
        assert (engine.loaded.config.num_key_value_heads, items, plan.split.num_parts) in padded[items]
        assert plan.split.num_parts == (8 if split else 1)


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    folder = tmp_path_factory.mktemp("head64-mistral-window-padded")
    return folder, make_head64_model("mistral", folder, seed=2, sliding_window=WINDOW)


def test_padded_decode_with_a_sliding_window_equals_transformers(mistral_window) -> None:
    """The fixed split of a window covers min(table width, window) keys; released pages (the core's
    placeholder ids in the tables) stay unread with the fixed width too."""
    folder, hf = mistral_window
    runtime = EmulatedRuntime(schedule="reverse", seed=4)
    backend = CudaAttentionBackend(num_sms=1000, runtime=runtime, variant="v2", split_rule=V1)
    engine = Engine(EngineArgs(model=str(folder), block_size=8, num_gpu_blocks=64, max_model_len=2048, watermark=0.0,
                               max_num_batched_tokens=16, enable_prefix_caching=True, pad_decode=True),
                    attention_backend=backend)  # fmt: skip
    requests = window_requests(engine.loaded.config.vocab_size)
    assert run_all(engine, requests) == {rid: [hf_greedy(hf, p, 40)] for rid, (p, _) in requests.items()}
    assert engine.stats()["window_released_blocks"] > 0
    plans = list(backend._padded_plans.values())
    assert plans and all(plan.split_for(WINDOW).num_parts == 1 and plan.split.num_parts == 8 for plan in plans)
