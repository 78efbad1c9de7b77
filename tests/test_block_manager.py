"""pagedrs.BlockManager through the bindings: exact outcomes, errors, and a Hypothesis
state machine that simulates the runner's memory and reads every sequence back."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedrs import BlockManager, OutOfBlocksError
from pagedrs._core import PLACEHOLDER_TOKEN


def test_allocate_free_exact_blocks_and_slots():
    bm = BlockManager(8, 4)
    assert bm.allocate(1, [1, 2, 3, 4, 5]) == 0
    assert bm.block_table(1) == [0, 1]
    assert bm.slot_mapping(1, 2, 5) == [2, 3, 4]
    assert bm.slot_mapping_array(1, 0, 5).tolist() == [0, 1, 2, 3, 4]
    assert bm.num_free_gpu_blocks == 6 and bm.num_tokens(1) == 5
    bm.free(1)
    assert bm.num_free_gpu_blocks == 8
    bm.check_invariants()


@pytest.mark.parametrize("dtype", [np.uint32, np.int32, np.int64, np.uint64])
def test_numpy_arrays_equal_lists(dtype):
    bm = BlockManager(16, 4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    bm.allocate(1, prompt)
    bm.commit(1, len(prompt))
    assert bm.allocate(2, np.array(prompt, dtype=dtype)) == 8
    assert bm.tokens(2) == prompt
    # Non-contiguous arrays work too.
    assert bm.allocate(3, np.array(prompt * 2, dtype=dtype)[::2]) == 0
    assert bm.tokens(3) == (prompt * 2)[::2]


def test_prefix_hits_only_after_commit():
    bm = BlockManager(8, 4)
    prompt = list(range(10))
    bm.allocate(1, prompt)
    assert bm.num_blocks_to_allocate(prompt) == 3
    bm.commit(1, 10)
    assert bm.allocate(2, prompt) == 8
    assert bm.block_table(2) == [0, 1, 3]
    assert bm.stats()["prefix_hits"] == 2 and bm.stats()["prefix_queries"] == 4


def test_fork_and_copy_on_write():
    bm = BlockManager(8, 4)
    bm.allocate(1, [1, 2, 3, 4, 5, 6])
    bm.fork(1, 2)
    assert bm.append_tokens(2, [7]) == [(1, 2)]
    assert bm.append_tokens(1, np.array([8], dtype=np.int64)) == []
    assert bm.block_table(1) == [0, 1] and bm.block_table(2) == [0, 2]
    assert bm.stats()["cow_copies"] == 1


def test_swap_round_trip():
    bm = BlockManager(8, 2, num_cpu_blocks=8)
    bm.allocate(1, [1, 2, 3])
    bm.fork(1, 2)
    bm.fork(1, 3)
    assert bm.swap_out([1, 2]) == [(0, 0), (1, 1)]
    assert bm.is_swapped(1) and not bm.is_swapped(3)
    assert bm.can_swap_in([1, 2]) == "ok"
    assert bm.swap_in([1, 2]) == [(0, 2), (1, 3)]
    assert bm.num_free_cpu_blocks == 8
    bm.check_invariants()


def test_errors_name_the_problem_and_change_nothing():
    bm = BlockManager(2, 2)
    bm.allocate(1, [1, 2, 3])
    before = (bm.num_free_gpu_blocks, bm.stats(), bm.block_table(1))
    with pytest.raises(OutOfBlocksError, match="needed 3, only 0 free"):
        bm.allocate(2, [1, 2, 3, 4, 5])
    with pytest.raises(OutOfBlocksError):
        bm.append_tokens(1, [4, 5, 6])
    assert (bm.num_free_gpu_blocks, bm.stats(), bm.block_table(1)) == before
    assert bm.tokens(1) == [1, 2, 3]
    with pytest.raises(KeyError, match="unknown sequence id 9"):
        bm.free(9)
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate(1, [1])
    with pytest.raises(ValueError, match="position 1 is -2"):
        bm.allocate(3, [1, -2])
    with pytest.raises(ValueError, match="position 0 is 4294967296"):
        bm.allocate(3, np.array([2**32], dtype=np.int64))
    with pytest.raises(TypeError, match="position 1 must be an int, got str"):
        bm.allocate(3, [1, "x"])
    with pytest.raises(TypeError, match="2-D"):
        bm.allocate(3, np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        BlockManager(4, 0)
    with pytest.raises(ValueError, match="sequence 1: it is on the device"):
        bm.can_swap_in([1])
    assert issubclass(OutOfBlocksError, RuntimeError)
    bm.check_invariants()


def test_host_cache_switch_reports_copies():
    bm = BlockManager(2, 2, num_cpu_blocks=2, host_cache_evicted=True)
    bm.allocate(1, [1, 2, 3])
    bm.commit(1, 3)
    bm.free(1)
    bm.allocate(2, [8, 8, 8, 8])
    assert bm.take_pending_host_copies() == ([(0, 0)], [])
    bm.free(2)
    assert bm.allocate(3, [1, 2, 5]) == 2
    assert bm.take_pending_host_copies() == ([], [(0, bm.block_table(3)[0])])
    assert bm.stats()["host_cache_hits"] == 1


def test_truncate_releases_pages_of_dropped_tokens_and_refuses_what_it_must_not_cut():
    bm = BlockManager(8, 4)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.commit(1, 5)  # the first page is in the prefix cache now
    bm.append_tokens(1, [PLACEHOLDER_TOKEN] * 6)  # drafts at positions 5..10: three pages in all
    bm.commit(1, 11)
    free = bm.num_free_gpu_blocks
    assert bm.truncate(1, 6) == 1 and bm.num_free_gpu_blocks == free + 1
    bm.set_token(1, 5, 9)
    assert bm.tokens(1) == [1, 2, 3, 4, 5, 9] and bm.num_committed_tokens(1) == 6
    with pytest.raises(ValueError, match="would cut into its first 4 tokens, whose pages are in the prefix cache"):
        bm.truncate(1, 3)
    for bad in (0, 7):
        with pytest.raises(ValueError, match=f"num_tokens = {bad} must be in 1..=6"):
            bm.truncate(1, bad)
    with pytest.raises(KeyError):
        bm.truncate(2, 1)
    bm.check_invariants()
    bm.free(1)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random calls; simulated memory (one token per slot per tier) must read back every
    live sequence's tokens; failed calls change nothing."""

    BS = 2

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(10, self.BS, num_cpu_blocks=6, host_cache_evicted=True)
        self.gpu = [None] * (10 * self.BS)
        self.cpu = [None] * (6 * self.BS)
        self.seqs: dict[int, list[int]] = {}

    def _copy(self, pairs, src_mem, dst_mem):
        for s, d in pairs:
            for o in range(self.BS):
                dst_mem[d * self.BS + o] = src_mem[s * self.BS + o]

    def _host_copies(self):
        evict, hits = self.bm.take_pending_host_copies()
        self._copy(evict, self.gpu, self.cpu)
        self._copy(hits, self.cpu, self.gpu)

    def _write(self, seq, start):
        toks = self.seqs[seq]
        for slot, t in zip(self.bm.slot_mapping(seq, start, len(toks)), toks[start:]):
            self.gpu[slot] = t

    def _state(self):
        return (self.bm.num_free_gpu_blocks, self.bm.num_free_cpu_blocks, self.bm.stats(),
                {s: (self.bm.block_table(s), self.bm.is_swapped(s)) for s in self.seqs})

    @rule(seq=st.integers(0, 4), prefix=st.integers(0, 6), tail=st.lists(st.integers(0, 2), max_size=6),
          as_array=st.booleans())
    def allocate(self, seq, prefix, tail, as_array):
        prompt = [0, 1, 2, 0, 1, 2][:prefix] + tail
        arg = np.array(prompt, dtype=np.int64) if as_array else prompt
        before = self._state()
        if seq in self.seqs or not prompt:
            with pytest.raises(ValueError):
                self.bm.allocate(seq, arg)
            assert self._state() == before
            return
        cost = self.bm.num_blocks_to_allocate(prompt)
        try:
            cached = self.bm.allocate(seq, arg)
        except OutOfBlocksError:
            assert cost > before[0] and self._state() == before
            return
        assert cached % self.BS == 0 and cached < len(prompt)
        self.seqs[seq] = prompt
        self._host_copies()
        table = self.bm.block_table(seq)
        assert [self.gpu[table[p // self.BS] * self.BS + p % self.BS] for p in range(cached)] == prompt[:cached]
        self._write(seq, cached)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(100, 999), min_size=1, max_size=4))
    def append(self, data, new):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        before = self._state()
        try:
            cow = self.bm.append_tokens(seq, new)
        except (OutOfBlocksError, ValueError):
            assert self._state() == before
            return
        start = len(self.seqs[seq])
        self.seqs[seq] = self.seqs[seq] + new
        self._host_copies()
        self._copy(cow, self.gpu, self.gpu)
        self._write(seq, start)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), frac=st.floats(0, 1))
    def commit(self, data, frac):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        try:
            self.bm.commit(seq, int(len(self.seqs[seq]) * frac))
        except ValueError:
            assert self.bm.is_swapped(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), child=st.integers(0, 4))
    def fork(self, data, child):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        if child in self.seqs:
            with pytest.raises(ValueError):
                self.bm.fork(parent, child)
            return
        self.bm.fork(parent, child)
        self.seqs[child] = list(self.seqs[parent])

    @rule(seq=st.integers(0, 5))
    def free(self, seq):
        if seq not in self.seqs:
            with pytest.raises(KeyError):
                self.bm.free(seq)
            return
        self.bm.free(seq)
        del self.seqs[seq]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap(self, data):
        group = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, max_size=2, unique=True))
        before = self._state()
        out = all(not self.bm.is_swapped(s) for s in group)
        inn = all(self.bm.is_swapped(s) for s in group)
        try:
            if out:
                self._copy(self.bm.swap_out(group), self.gpu, self.cpu)
            elif inn:
                status = self.bm.can_swap_in(group)
                self._copy(self.bm.swap_in(group), self.cpu, self.gpu)
                assert status == "ok"
            else:
                with pytest.raises(ValueError):
                    self.bm.swap_out(group)
        except OutOfBlocksError:
            assert self._state() == before

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=5), accepted=st.integers(0, 5))
    def speculate(self, data, drafts, accepted):
        """A verify step: drafts appended as PLACEHOLDER_TOKEN, their K/V written and committed, the
        first ``accepted`` kept (truncate, then set_token). Drafts share the prompts' alphabet, so a
        page of rejected drafts that reached the cache would be hit, and read back wrong, by allocate."""
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        before = self._state()
        try:
            cow = self.bm.append_tokens(seq, [PLACEHOLDER_TOKEN] * len(drafts))
        except (OutOfBlocksError, ValueError):
            assert self._state() == before
            return
        self._host_copies()
        self._copy(cow, self.gpu, self.gpu)
        start, kept = len(self.seqs[seq]), min(accepted, len(drafts))
        for slot, t in zip(self.bm.slot_mapping(seq, start, start + len(drafts)), drafts):
            self.gpu[slot] = t
        self.bm.commit(seq, start + len(drafts))
        self.bm.truncate(seq, start + kept)
        for i in range(kept):
            self.bm.set_token(seq, start + i, drafts[i])
        self.seqs[seq] = self.seqs[seq] + drafts[:kept]

    @invariant()
    def reads_back_and_invariants_hold(self):
        self.bm.check_invariants()
        for seq, toks in self.seqs.items():
            mem = self.cpu if self.bm.is_swapped(seq) else self.gpu
            table = self.bm.block_table(seq)
            assert [mem[table[p // self.BS] * self.BS + p % self.BS] for p in range(len(toks))] == toks
            assert self.bm.tokens(seq) == toks


TestBlockManagerMachine = BlockManagerMachine.TestCase
# Fixed examples in `make test` (a CI run passes or fails on the code alone); `make fuzz`
# searches afresh with PAGEDRS_FUZZ_RANDOM=1 and more examples.
TestBlockManagerMachine.settings = settings(
    max_examples=int(os.environ.get("PAGEDRS_FUZZ_EXAMPLES", "60")), stateful_step_count=30, deadline=None,
    derandomize=os.environ.get("PAGEDRS_FUZZ_RANDOM") != "1", database=None,
)
