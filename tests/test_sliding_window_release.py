"""The core releases pages that fell out of the sliding window (issue 16, model gaps).

A Mistral sequence whose context is far longer than its window holds only about the
window's pages once its prompt is computed; the output stays equal to transformers'
(so no released page is ever read), with prefix caching on and off, ``n = 2`` samples
sharing pages, chunked prefill, and preemption by swap and by recompute on a small pool.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY_CONFIGS, make_tiny_model
from pagedrs import LLM, BeamSearchParams, Engine, EngineArgs, SamplingParams
from pagedrs._core import BlockManager
from test_beam_search import assert_equal_to_hf
from test_model_gaps import _hf_greedy, _prompts

WINDOW = 32


def _tiny(model_type: str, folder: Path, **config) -> Path:
    """The conftest's tiny model of ``model_type`` with ``config`` fields overridden."""
    default = TINY_CONFIGS[model_type]
    TINY_CONFIGS[model_type] = dict(default, **config)
    try:
        make_tiny_model(model_type, folder)
    finally:
        TINY_CONFIGS[model_type] = default
    return folder


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory) -> Path:
    """A tiny Mistral with a window of 32, contexts up to ~200 tokens."""
    return _tiny("mistral", tmp_path_factory.mktemp("mistral-w32"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory) -> Path:
    """The same shape with full attention."""
    return _tiny("mistral", tmp_path_factory.mktemp("mistral-full"), sliding_window=None)


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[dict[str, list[list[int]]], int, int]:
    """Runs every prompt to the end, checking the core's invariants after every step.
    Returns each request's samples, the most pages a decoding sequence held (one with two
    tokens past its prompt, whose latest step was a decode, unless it was preempted by
    recompute and is prefilling again), and the most any sequence held."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    outs: dict[str, list[list[int]]] = {}
    peak = peak_any = 0
    for _ in range(5000):  # a stalled scheduler fails here instead of hanging
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = [c.token_ids for c in o.outputs]
        engine.check_invariants()
        for seq_id, (request, _) in engine.sequences.items():
            held = engine.scheduler.num_held_blocks(seq_id)
            peak_any = max(peak_any, held)
            if engine.scheduler.num_tokens(seq_id) > len(request.prompt_token_ids) + 1:
                peak = max(peak, held)
    assert not engine.has_unfinished(), "no progress in 5000 steps"
    return outs, peak, peak_any


def _engine(folder: Path, **kw) -> Engine:
    args = dict(model=str(folder), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=256,
                max_num_batched_tokens=64, skip_tokenizer_init=True)
    return Engine(EngineArgs(**{**args, **kw}))


@pytest.mark.parametrize(("block_size", "caching", "chunk", "n"), [
    (4, True, 16, 1), (8, False, 2048, 1), (8, True, 24, 2), (4, False, 2048, 2),
], ids=["bs4-cache-chunk16", "bs8-nocache-whole", "bs8-cache-chunk24-n2", "bs4-nocache-whole-n2"])
def test_window_release_is_exact_and_bounded(window_dir: Path, block_size: int, caching: bool, chunk: int,
                                             n: int) -> None:
    """Contexts of ~120..200 tokens (up to six windows): greedy equals transformers, pages held
    by a decoding sequence stay within ceil((W + 1) / bs) + 1 (all ~50 of a 200-token context
    without the release), and with chunked prefill by any sequence within two chunks and the
    window: a prompt's pages are taken chunk by chunk. Released pages are counted. With
    caching, a second request sharing an 80-token prefix hits the cache though that
    prefix's first pages were released."""
    engine = _engine(window_dir, block_size=block_size, enable_prefix_caching=caching, max_num_batched_tokens=chunk)
    vocab = engine.loaded.config.vocab_size
    prefix = _prompts(vocab, [80], seed=11)[0]
    prompts = _prompts(vocab, [60, 140], seed=7) + [prefix + [5, 6, 7]]
    params = SamplingParams(n=n, max_tokens=60, temperature=0.0, ignore_eos=True)
    got, peak, peak_any = _run(engine, prompts, params)
    later = prefix + [8, 9]
    got_later, _, _ = _run(engine, [later], params)
    want = _hf_greedy(window_dir, prompts + [later], 60)
    assert [got[f"r{i}"] for i in range(3)] + [got_later["r0"]] == [[w] * n for w in want]
    bound = -(-(WINDOW + 1) // block_size) + 1
    assert 0 < peak <= bound, (peak, bound)
    if chunk < 60:
        assert peak_any <= -(-(WINDOW + 2 * chunk) // block_size) + 2, peak_any
    stats = engine.stats()
    # the last query of a context of L = prompt + 59 computed tokens reads from L - W on
    assert stats["window_released_blocks"] >= sum((len(p) + 59 - WINDOW) // block_size for p in prompts)
    if caching:
        assert stats["prefix_hits"] >= 80 // block_size - 1, stats["prefix_hits"]


def test_a_full_attention_model_of_the_same_shape_keeps_every_page(full_dir: Path) -> None:
    engine = _engine(full_dir)
    assert engine.scheduler_config.sliding_window is None
    prompt = _prompts(engine.loaded.config.vocab_size, [140], seed=7)[0]
    _, peak, _ = _run(engine, [prompt], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    assert peak == -(-(140 + 59) // 4), peak  # the last sampled token is never written
    assert engine.stats()["window_released_blocks"] == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_window_release_under_preemption_on_a_small_pool(window_dir: Path, mode: str) -> None:
    """Six ~40-token prompts growing to ~190 tokens on a 48-page pool: admitted together they
    take every page, and each decoding sequence then holds about its window (~9 pages), so
    the pool stays short and sequences are swapped out or recomputed, and still match."""
    engine = _engine(window_dir, num_gpu_blocks=48, preemption_mode=mode, max_num_batched_tokens=256,
                     admission_policy="prompt_only",  # optimistic admission: the pool must preempt
                     swap_space_gb=0.01)  # a host tier to swap to (a CPU device has none by default)
    vocab = engine.loaded.config.vocab_size
    prompts = _prompts(vocab, [40, 44, 36, 40, 48, 40], seed=3)
    params = SamplingParams(max_tokens=140, temperature=0.0, ignore_eos=True)
    got, _, _ = _run(engine, prompts, params)
    assert [got[f"r{i}"][0] for i in range(len(prompts))] == _hf_greedy(window_dir, prompts, 140)
    stats = engine.stats()
    assert stats[f"num_{mode}_preemptions"] > 0, stats
    assert stats["window_released_blocks"] > 0


def test_a_windowed_prompt_longer_than_the_pool(window_dir: Path, full_dir: Path) -> None:
    """24 pages of 4 tokens hold 96; a 150-token prompt in 16-token chunks needs at most
    ceil((32 + 2 * 16) / 4) + 2 = 18 at a time with the window, so it is admitted and
    matches transformers; the full-attention model refuses it before anything runs."""
    kw = dict(num_gpu_blocks=24, max_num_batched_tokens=16)
    prompt = _prompts(300, [150], seed=9)[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="needs up to 48 blocks"):
        _engine(full_dir, **kw).add_request("r", {"prompt_token_ids": prompt}, params)
    engine = _engine(window_dir, **kw)
    got, _, peak_any = _run(engine, [prompt], params)
    assert got["r0"] == [_hf_greedy(window_dir, [prompt], 40)[0]]
    assert peak_any <= 18


def test_beam_search_on_released_pages_equals_transformers(window_dir: Path) -> None:
    """Beams fork and die every step on pages shared with released placeholders: 4 beams over
    70-token prompts grown by 40 (three windows) equal transformers' num_beams=4."""
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(window_dir), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=256)
    prompts = _prompts(llm.engine.loaded.config.vocab_size, [70, 66], seed=2)
    params = BeamSearchParams(beam_width=4, max_tokens=40, ignore_eos=True)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    model = AutoModelForCausalLM.from_pretrained(str(window_dir), dtype=torch.float32).eval()
    assert_equal_to_hf(results, model, prompts, params, set())
    assert llm.engine.stats()["window_released_blocks"] > 0


def test_mixed_full_and_window_layers_keep_every_page(tmp_path: Path) -> None:
    """Qwen2 with its window on layer 1 only: layer 0 reads every page, so none is released."""
    engine = _engine(_tiny("qwen2", tmp_path, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert engine.loaded.config.layer_sliding_window(1) == 8
    assert engine.scheduler_config.sliding_window is None
    engine.add_request("r", {"prompt_token_ids": list(range(3, 43))}, SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["window_released_blocks"] == 0


# ---- the BlockManager surface --------------------------------------------------------------


def test_block_manager_release_swap_and_slots() -> None:
    """Placeholders read as NULL_BLOCK, have no slots, are never swapped, and count in stats."""
    NULL_BLOCK = BlockManager.NULL_BLOCK
    assert NULL_BLOCK == 2**32 - 1
    bm = BlockManager(16, 4, num_cpu_blocks=16, sliding_window=6)
    assert bm.sliding_window == 6
    bm.allocate(1, list(range(100, 118)))
    bm.commit(1, 17)
    table = bm.block_table(1)
    assert bm.release_outside_window(1, 12) == 3
    assert bm.block_table(1) == [NULL_BLOCK] * 3 + table[3:]
    assert bm.num_held_blocks(1) == 2 and bm.stats()["window_released_blocks"] == 3
    assert bm.slot_mapping(1, 12, 14) == [table[3] * 4, table[3] * 4 + 1]
    with pytest.raises(ValueError, match="released out of the sliding window"):
        bm.slot_mapping(1, 11, 13)
    with pytest.raises(ValueError, match="past its 17 committed tokens"):
        bm.release_outside_window(1, 18)
    copies = bm.swap_out([1])
    assert [g for g, _ in copies] == table[3:]
    assert bm.block_table(1)[:3] == [NULL_BLOCK] * 3
    back = bm.swap_in([1])
    # Two pages come back: the full committed one is still cached on the device (a hit,
    # no copy), the partial one is copied.
    assert len(back) == 1 and bm.block_table(1)[:3] == [NULL_BLOCK] * 3 and bm.num_held_blocks(1) == 2
    assert bm.block_table(1)[3] == table[3]
    bm.check_invariants()
    bm.free(1)
    assert bm.num_free_gpu_blocks == 16
    bm.check_invariants()
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(4, 4, sliding_window=0)
