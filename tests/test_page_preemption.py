"""Page-granular preemption end to end: greedy tokens equal to transformers on pools so
small that sequences are paused with some pages on the device and some on the host,
with prefix caching on and off, n > 1 (forked samples share pages), beam search, and
the host tier for evicted prefix pages; fewer pages move than with whole-sequence swap
on the same workload, and the counters in stats() say how many (and how many bytes).
"""

from __future__ import annotations

import pytest
import torch

from pagedrs import BeamSearchParams, BlockManager, Engine, OutOfBlocksError, SamplingParams
from test_beam_search import PROMPTS, hf_beam_search, make_llm
from test_engine import greedy, hf_greedy, make_engine, make_prompts
from test_engine_hardening import run_to_end


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict[str, list[list[int]]], bool]:
    """Every request to the end, invariants checked after each step. Returns each request's
    samples' tokens, and whether some paused sequence ever held device and host pages at once."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[list[int]]] = {}
    mixed = False
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        engine.scheduler.check_invariants()
        for seq_id in list(engine.sequences):
            if engine.scheduler.contains(seq_id):
                device, host = engine.scheduler.page_tiers(seq_id)
                mixed |= device > 0 and host > 0
    assert not engine.has_unfinished()
    return done, mixed


def test_block_manager_swaps_out_only_exclusive_pages_and_swaps_them_back():
    bm = BlockManager(8, 2, num_cpu_blocks=4)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.fork(1, 2)
    assert bm.num_swappable_pages(1) == 0  # every page shared with the fork: moving one frees nothing
    assert bm.append_tokens(2, [6]) == [(2, 3)]  # the fork copies the shared partial page on write
    assert bm.num_swappable_pages(1) == 1
    free = bm.num_free_gpu_blocks
    assert bm.swap_out_pages(1, 3) == [(2, 0)]  # only the exclusive page, however many are asked for
    assert bm.num_free_gpu_blocks == free + 1
    assert bm.block_table(1) == [0, 1, 0] and bm.host_entries(1) == [False, False, True]
    assert bm.is_swapped(1) and not bm.is_swapped(2)
    bm.check_invariants()
    with pytest.raises(ValueError, match="swapped out"):
        bm.append_tokens(1, [7])
    with pytest.raises(ValueError, match="n is 0"):
        bm.swap_out_pages(2, 0)
    with pytest.raises(ValueError, match="already swapped out"):
        bm.swap_out([1])  # the whole-sequence call keeps its meaning
    assert bm.can_swap_in([1]) == "ok"
    assert bm.swap_in([1]) == [(0, 2)]  # only the host page comes back
    assert bm.block_table(1) == [0, 1, 2] and not bm.is_swapped(1)
    bm.free(1)
    bm.free(2)
    assert (bm.num_free_gpu_blocks, bm.num_free_cpu_blocks) == (8, 4)
    bm.check_invariants()

    no_host = BlockManager(4, 2)
    no_host.allocate(1, [1, 2, 3])
    with pytest.raises(OutOfBlocksError):
        no_host.swap_out_pages(1, 1)
    assert no_host.block_table(1) == [0, 1] and not no_host.is_swapped(1)
    no_host.free(1)


def tiny_pool_engine(model_dir, *, whole_sequence_swap: bool = False, **kw) -> Engine:
    """12 blocks of 4 tokens for requests of up to ~45 tokens: constant preemption (optimistic
    admission, which lets the running set grow into the pool, so that preemption happens)."""
    args = dict(num_gpu_blocks=12, preemption_mode="swap", swap_space_gb=0.01, watermark=0.0,
                admission_policy="prompt_only")
    args.update(kw)
    engine = make_engine(model_dir, **args)
    engine.scheduler.set_whole_sequence_swap(whole_sequence_swap)
    return engine


def assert_counters_consistent(stats: dict) -> None:
    per_block = stats["kv_bytes_per_block"]
    assert stats["swap_bytes_out"] == per_block * stats["num_pages_swapped_out"]
    assert stats["swap_bytes_in"] == per_block * stats["num_pages_swapped_in"]
    assert stats["step_swap_bytes_out"] == per_block * stats["step_pages_swapped_out"]
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equals_transformers_and_fewer_pages_move_than_whole_sequence_swap(tiny_llama_dir, hf_model,
                                                                                  prefix_caching):
    stats = {}
    for whole in (False, True):
        engine = tiny_pool_engine(tiny_llama_dir, whole_sequence_swap=whole, enable_prefix_caching=prefix_caching)
        # A shared 8-token prefix: with prefix caching its pages are shared and never copied out.
        prompts = make_prompts(engine, 8, shared=8 if prefix_caching else 0, seed=1)
        done, mixed = run(engine, prompts, greedy(max_tokens=16))
        for i, p in enumerate(prompts):
            assert done[f"r{i}"] == [hf_greedy(hf_model, p, 16)], f"request r{i} (whole={whole})"
        s = stats[whole] = engine.stats()
        assert s["num_swap_preemptions"] > 0
        assert_counters_consistent(s)
        # Whole-sequence swap never leaves a table half on the device; page-granular does.
        assert mixed != whole
    page, whole = stats[False], stats[True]
    assert 0 < page["num_pages_swapped_out"] < whole["num_pages_swapped_out"]
    assert page["swap_bytes_out"] + page["swap_bytes_in"] < whole["swap_bytes_out"] + whole["swap_bytes_in"]


def test_forked_samples_share_pages_and_equal_transformers(tiny_llama_dir, hf_model):
    """n = 3 greedy samples fork the prompt's pages: shared pages stay on the device while
    private ones move, and every sample still equals transformers."""
    engine = tiny_pool_engine(tiny_llama_dir, num_gpu_blocks=20)
    prompts = make_prompts(engine, 5, seed=2)
    params = SamplingParams(n=3, max_tokens=14, temperature=0.0, ignore_eos=True)
    done, _ = run(engine, prompts, params)
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == [hf_greedy(hf_model, p, 14)] * 3, f"request r{i}"
    s = engine.stats()
    assert s["num_pages_swapped_out"] > 0
    assert_counters_consistent(s)


def test_host_tier_for_prefix_pages_with_page_preemption_equals_transformers(tiny_llama_dir, hf_model):
    """Evicted prefix pages and paused sequences' pages share the host tier."""
    engine = tiny_pool_engine(tiny_llama_dir, enable_prefix_caching=True, kv_host_cache_gb=0.001)
    prompts = make_prompts(engine, 8, shared=8, seed=3)
    for _ in range(2):  # the second round hits prefix pages the first pushed to the host
        done, _ = run(engine, prompts, greedy(max_tokens=16))
        for i, p in enumerate(prompts):
            assert done[f"r{i}"] == [hf_greedy(hf_model, p, 16)], f"request r{i}"
    s = engine.stats()
    assert s["num_pages_swapped_out"] > 0 and s["host_cache_saves"] > 0
    assert s["num_free_gpu_blocks"] == s["num_gpu_blocks"]


def test_beam_search_under_page_preemption_equals_transformers(tiny_llama_dir, hf_model):
    llm = make_llm(tiny_llama_dir, num_gpu_blocks=30, preemption_mode="swap", swap_space_gb=0.01,
                   max_num_batched_tokens=64, admission_policy="prompt_only")
    engine = llm.engine
    params = BeamSearchParams(beam_width=4, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    done = run_to_end(engine)  # checks the invariants after every step
    s = engine.stats()
    assert s["num_pages_swapped_out"] > 0, "the pool must be too small for every beam at once"
    for i, p in enumerate(PROMPTS):
        sequences, scores = hf_beam_search(hf_model, p, params, set())
        out = done[f"b{i}"]
        assert [p + c.token_ids for c in out.outputs] == sequences
        assert [c.score for c in out.outputs] == pytest.approx(scores, abs=1e-4, rel=1e-4)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_requests_read_only_at_their_end_equal_streamed_ones_under_preemption(tiny_llama_dir, hf_model, mode):
    """FINAL_ONLY requests without stop strings cross from the core once, at their end: through constant
    preemption (their sequences swapped out and back, or recomputed from their tokens) they end in
    what streamed (CUMULATIVE) requests end in, and in transformers' greedy tokens; every page is back."""
    from pagedrs import RequestOutputKind

    finals = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        engine = tiny_pool_engine(tiny_llama_dir, preemption_mode=mode)
        prompts = make_prompts(engine, 8, seed=3)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                output_kind=kind)
        for i, p in enumerate(prompts):
            engine.add_request(f"q{i}", p, params)
        outputs: dict[str, list] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        stats = engine.stats()
        assert stats["num_swap_preemptions" if mode == "swap" else "num_recompute_preemptions"] > 0
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
        if kind == RequestOutputKind.FINAL_ONLY:
            assert all(len(o) == 1 for o in outputs.values())
        finals[kind] = {r: [(c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason) for c in o[-1].outputs]
                        for r, o in outputs.items()}
        for i, p in enumerate(prompts):
            assert [c[0] for c in finals[kind][f"q{i}"]] == [hf_greedy(hf_model, p, 16)], (kind.name, i)
    assert finals[RequestOutputKind.FINAL_ONLY] == finals[RequestOutputKind.CUMULATIVE]
