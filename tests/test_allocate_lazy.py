"""BlockManager.allocate with prefix caching off keeps a Python list unconverted (the binding's
lazy path): everything the manager answers must be what the converted path answers."""

from __future__ import annotations

import pytest

from pagedrs import BlockManager


def _managers():
    # the lazy path (a list, caching off) against the converting one (a tuple goes through the sequence path)
    return BlockManager(32, 4, enable_prefix_caching=False), BlockManager(32, 4, enable_prefix_caching=False)


def test_lazy_prompt_reads_back_as_the_converted_one():
    lazy, eager = _managers()
    prompt = list(range(100, 110))
    assert lazy.allocate(1, prompt) == eager.allocate(1, tuple(prompt)) == 0
    lazy.append_tokens(1, [7, 8, 9])
    eager.append_tokens(1, [7, 8, 9])
    for bm in (lazy, eager):
        bm.fork(1, 2)
        bm.append_tokens(2, [5])
    for seq in (1, 2):
        assert lazy.tokens(seq) == eager.tokens(seq)
        assert lazy.block_table(seq) == eager.block_table(seq)
        assert lazy.num_tokens(seq) == eager.num_tokens(seq)
    assert lazy.tokens(2) == [*range(100, 110), 7, 8, 9, 5]
    lazy.free(1)
    assert lazy.tokens(2)[:10] == prompt  # the child keeps the prompt after its parent is freed
    lazy.free(2)
    assert lazy.num_free_gpu_blocks == 32
    lazy.check_invariants()


def test_a_freed_id_reused_with_another_prompt_reads_the_new_one():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    bm.allocate(1, [1, 2, 3])
    bm.free(1)
    bm.allocate(1, (4, 5))  # converted path: no stale lazy prompt may shadow it
    assert bm.tokens(1) == [4, 5]


def test_bad_ids_and_changed_lists_are_reported_when_read():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    bad = [1, -1, 3]
    assert bm.allocate(1, bad) == 0  # only the length is needed now
    with pytest.raises(ValueError, match=r"position 1 is -1"):
        bm.tokens(1)
    grown = [1, 2]
    bm.allocate(2, grown)
    grown.append(3)
    with pytest.raises(ValueError, match=r"sequence 2 had 2 tokens at allocate and has 3 now"):
        bm.tokens(2)
    with pytest.raises(ValueError, match="at least one token"):
        bm.allocate(3, [])


def test_prefix_caching_on_still_checks_ids_at_allocate():
    bm = BlockManager(8, 4)
    with pytest.raises(ValueError, match=r"position 0 is -5"):
        bm.allocate(1, [-5, 1])
    assert 1 not in bm
