"""Cascade attention over shared prefix pages equals the padded attention it replaces.

The kernel-level test builds decode steps whose sequences share leading pages (groups of
several sizes, singletons, GQA) and compares the torch backend's output with the cascade
on and off; it also checks the plan really cascades (so the comparison is not vacuous).
The engine-level test runs chats behind one shared prompt against transformers' greedy
output, counting the cascade calls.
"""

from __future__ import annotations

import pytest
import torch

from pagedrs.attention import cascade as cascade_module
from pagedrs.attention.base import AttentionMetadata
from pagedrs.attention.torch_backend import TorchAttentionBackend

BLOCK = 4


def _decode_step(groups: list[tuple[int, int]], own: list[int], kv_heads: int, heads: int, seed: int):
    """groups: (members, shared pages); own[s]: tokens of sequence s after its shared pages (>= 1)."""
    g = torch.Generator().manual_seed(seed)
    head_dim = 16
    cache_blocks = 200
    key_cache = torch.randn(cache_blocks, BLOCK, kv_heads, head_dim, generator=g)
    value_cache = torch.randn(cache_blocks, BLOCK, kv_heads, head_dim, generator=g)
    free = iter(torch.randperm(cache_blocks, generator=g).tolist())
    tables, lens = [], []
    s = 0
    for members, shared in groups:
        prefix = [next(free) for _ in range(shared)]
        for _ in range(members):
            mine = [next(free) for _ in range(-(-own[s] // BLOCK))]
            tables.append(prefix + mine)
            lens.append(shared * BLOCK + own[s])
            s += 1
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(tables), dtype=torch.int64),
        query_start_loc=torch.arange(len(tables) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max(lens),
        query_start_loc_cpu=list(range(len(tables) + 1)),
        seq_lens_cpu=lens,
    )
    query = torch.randn(len(tables), heads, head_dim, generator=g)
    return query, key_cache, value_cache, meta


CASES = [
    # (groups, own tokens per sequence, kv heads, heads)
    ([(6, 5)], [1, 2, 3, 4, 5, 9], 2, 6),  # one shared prompt, GQA 3
    ([(3, 4), (2, 2), (1, 3)], [4, 1, 7, 2, 2, 5], 1, 4),  # two groups and a singleton, MQA
    ([(8, 10)], [1] * 8, 4, 4),  # forks right after a full page: one own token each, MHA
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cascade_equals_the_padded_attention(case: int, monkeypatch: pytest.MonkeyPatch) -> None:
    groups, own, kv_heads, heads = CASES[case]
    query, key_cache, value_cache, meta = _decode_step(groups, own, kv_heads, heads, seed=case)
    backend = TorchAttentionBackend()
    plan = backend.plan(meta, BLOCK)
    assert [b.cascade is not None for b in plan.buckets] == [True] * len(plan.buckets)
    got = backend.forward(query, key_cache, value_cache, meta, scale=0.25)
    monkeypatch.setattr(cascade_module, "MIN_SAVED_FRACTION", 2.0)  # never worth it: the padded path
    meta.plan = None
    plan = backend.plan(meta, BLOCK)
    assert all(b.cascade is None for b in plan.buckets)
    expected = backend.forward(query, key_cache, value_cache, meta, scale=0.25)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_a_step_without_shared_pages_does_not_cascade() -> None:
    query, key_cache, value_cache, meta = _decode_step([(1, 2), (1, 3), (1, 1)], [3, 5, 2], 2, 4, seed=7)
    assert all(b.cascade is None for b in TorchAttentionBackend().plan(meta, BLOCK).buckets)


def test_chats_behind_one_prompt_match_transformers(tiny_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from test_engine import greedy, hf_greedy, make_engine, make_prompts, run_all

    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()

    calls = []
    original = cascade_module.attend_cascade

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr("pagedrs.attention.torch_backend.attend_cascade", counted)
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=True, num_gpu_blocks=128)
    prompts = make_prompts(engine, 6, shared=33, seed=3)
    done = run_all(engine, prompts, greedy(max_tokens=12))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, 12), f"request r{i}"
    assert calls, "the shared prompt never took the cascade path"


def _poison_past_the_ends(key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata) -> int:
    """NaN in every slot the step's sequences must not read: each last page's tail, and page 0 (the tables'
    padding) when no sequence holds it. Returns how many slots were poisoned."""
    tables, poisoned = meta.block_tables.tolist(), 0
    used = {page for table, n in zip(tables, meta.seq_lens_cpu) for page in table[: -(-n // BLOCK)]}
    for table, n in zip(tables, meta.seq_lens_cpu):
        last = table[(n - 1) // BLOCK]
        for slot in range(n % BLOCK or BLOCK, BLOCK):
            key_cache[last, slot] = value_cache[last, slot] = float("nan")
            poisoned += 1
    if 0 not in used:
        key_cache[0] = value_cache[0] = float("nan")
        poisoned += BLOCK
    return poisoned


@pytest.mark.parametrize("cascade", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_what_a_pages_last_owner_left_past_a_sequences_end_is_never_read(case, cascade, monkeypatch):
    """A page's slots past a sequence's length hold what its last owner left (a NaN when that owner's K/V
    went NaN); they are masked, but a NaN times a zero weight is NaN: the output is the one clean pages give."""
    groups, own, kv_heads, heads = CASES[case]
    query, key_cache, value_cache, meta = _decode_step(groups, own, kv_heads, heads, seed=case)
    if not cascade:
        monkeypatch.setattr(cascade_module, "MIN_SAVED_FRACTION", 2.0)
    backend = TorchAttentionBackend()
    assert any(b.cascade is not None for b in backend.plan(meta, BLOCK).buckets) == cascade
    expected = backend.forward(query, key_cache, value_cache, meta, scale=0.25)
    assert _poison_past_the_ends(key_cache, value_cache, meta) > 0
    got = backend.forward(query, key_cache, value_cache, meta, scale=0.25)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
