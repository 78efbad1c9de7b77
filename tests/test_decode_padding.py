"""The padded decode path's pieces without a GPU: the capture list, the static buffers, the scratch
page, pool sizing, the settings, and the graphs' fallbacks (out of memory, a replay that differs)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from pagedrs import EngineArgs
from pagedrs.decode_graphs import (
    DecodeGraphs,
    DecodePadding,
    StaticDecodeInputs,
    capture_sizes,
    graph_headroom_bytes,
    padded_size,
)
from pagedrs.memory import plan_kv_memory
from pagedrs.models.config import ModelConfig
from pagedrs.step_input import StepInput


def test_capture_sizes_follow_vllms_list_up_to_the_first_that_holds_max_num_seqs() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 4)
    assert capture_sizes(6) == (1, 2, 4, 8)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(9) == (1, 2, 4, 8, 16)
    assert capture_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert capture_sizes(256)[-3:] == (240, 248, 256) and len(capture_sizes(256)) == 3 + 32
    assert capture_sizes(4096)[-1] == 512  # vLLM's cap: wider decode steps run eagerly
    assert capture_sizes(100, limit=20) == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_capture_sizes_refuse_a_bad_max_num_seqs_naming_it(bad) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(bad)


def test_padded_size_is_the_smallest_size_that_holds_the_batch() -> None:
    sizes = capture_sizes(32)
    assert [padded_size(sizes, s) for s in (1, 2, 3, 5, 8, 9, 17, 32, 33)] == [1, 2, 4, 8, 8, 16, 24, 32, None]


def decode_step(tables: list[list[int]], lens: list[int], block_size: int = 4) -> StepInput:
    s = len(lens)
    pos = np.array(lens, dtype=np.int64) - 1
    slots = np.array([t[p // block_size] * block_size + p % block_size for t, p in zip(tables, pos, strict=True)])
    return StepInput(input_ids=np.arange(100, 100 + s, dtype=np.int64), positions=pos, slot_mapping=slots.astype(np.int64),
                     query_start_loc=np.arange(s + 1, dtype=np.int32), seq_lens=np.array(lens, dtype=np.int32),
                     block_tables=np.array(tables, dtype=np.int32))  # fmt: skip


def test_static_inputs_pad_onto_the_scratch_page_in_the_same_buffers_every_step() -> None:
    padding = DecodePadding(sizes=(1, 2, 4, 8), table_width=5)
    static = StaticDecodeInputs(padding, scratch_block=20, block_size=4, device=torch.device("cpu"))
    addresses = [t.data_ptr() for t in (static.input_ids, static.positions, static.slot_mapping, static.seq_lens,
                                        static.query_start_loc, static.block_tables)]  # fmt: skip
    first = static.fill(decode_step([[3, 4, 5], [7, 8, 9]], [9, 12]), 4)
    assert first.size == 4 and first.num_real == 2
    assert first.input_ids.tolist() == [100, 101, 0, 0]
    assert first.positions.tolist() == [8, 11, 0, 0]
    assert first.meta.slot_mapping.tolist() == [5 * 4 + 0, 9 * 4 + 3, 80, 80]  # padding rows: slot 0 of page 20
    assert first.meta.seq_lens.tolist() == [9, 12, 1, 1] and first.meta.seq_lens_cpu == [9, 12, 1, 1]
    assert first.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and first.meta.query_start_loc_cpu == [0, 1, 2, 3, 4]
    assert first.meta.block_tables.tolist() == [[3, 4, 5, 20, 20], [7, 8, 9, 20, 20], [20] * 5, [20] * 5]
    assert first.meta.is_decode_only and first.meta.max_seq_len == 12
    # a narrower step of one row: the wide rows of the last step are padding again
    second = static.fill(decode_step([[11]], [2]), 2)
    assert second.meta.block_tables.tolist() == [[11, 20, 20, 20, 20], [20] * 5]
    assert second.meta.slot_mapping.tolist() == [45, 80] and second.meta.seq_lens.tolist() == [2, 1]
    assert [t.data_ptr() for t in (static.input_ids, static.positions, static.slot_mapping, static.seq_lens,
                                   static.query_start_loc, static.block_tables)] == addresses  # fmt: skip
    assert second.meta.block_tables.data_ptr() == first.meta.block_tables.data_ptr()


def test_static_inputs_refuse_what_is_not_a_fitting_decode_step() -> None:
    static = StaticDecodeInputs(DecodePadding(sizes=(1, 2), table_width=2), scratch_block=9, block_size=4,
                                device=torch.device("cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="capture size"):
        static.fill(decode_step([[1], [2]], [1, 1]), 1)  # 2 rows into size 1
    with pytest.raises(ValueError, match="capture size"):
        static.fill(decode_step([[1]], [1]), 4)  # not a capture size
    with pytest.raises(ValueError, match="padded width 2"):
        static.fill(decode_step([[1, 2, 3]], [9]), 1)
    chunk = decode_step([[1]], [3])
    chunk = StepInput(**{**chunk.__dict__, "input_ids": np.array([5, 6], dtype=np.int64)})
    with pytest.raises(ValueError, match="1 token per sequence"):
        static.fill(chunk, 1)


@pytest.mark.parametrize(("sizes", "width"), [((), 4), ((2, 1), 4), ((1, 1), 4), ((1,), 0)])
def test_decode_padding_refuses_bad_shapes(sizes, width) -> None:
    with pytest.raises(ValueError, match="DecodePadding"):
        DecodePadding(sizes=sizes, table_width=width)


# ---- settings and sizing ------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "graphs", "padded"), [
    ({"device": "cpu"}, False, False),
    ({"device": "cpu", "pad_decode": True}, False, True),
    ({"device": "cuda"}, True, True),
    ({"device": "cuda:1"}, True, True),
    ({"device": "cuda", "enforce_eager": True}, False, False),
    ({"device": "cuda", "enforce_eager": True, "pad_decode": True}, False, True),
    ({"device": "cuda", "pad_decode": False}, False, False),
    ({"device": "cuda", "tensor_parallel_size": 2}, False, False),
    ({"device": "cpu", "pad_decode": True, "tensor_parallel_size": 2}, False, False),
])  # fmt: skip
def test_which_settings_pad_and_which_capture(kw, graphs, padded) -> None:
    args = EngineArgs(**kw)
    assert (args.uses_decode_graphs(), args.uses_decode_padding()) == (graphs, padded)


@pytest.mark.parametrize(("field", "value"), [("enforce_eager", 1), ("enforce_eager", None), ("pad_decode", "yes"),
                                              ("pad_decode", 0)])
def test_bad_graph_settings_are_refused_naming_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=f"{field} is {value!r}"):
        EngineArgs(**{field: value})


def plan(**kw):
    base = dict(bytes_per_token=100, block_size=4, num_parameters=1000, device=torch.device("cpu"),
                num_gpu_blocks=None, kv_cache_memory=4000, gpu_memory_utilization=0.9, swap_space_gb=0.0)  # fmt: skip
    base.update(kw)
    return plan_kv_memory(**base)


def test_the_scratch_page_comes_out_of_a_pool_sized_in_bytes_and_is_extra_to_an_explicit_count() -> None:
    assert plan().num_gpu_blocks == 10
    assert plan(reserved_blocks=1).num_gpu_blocks == 9  # 10 blocks of memory: 9 for the scheduler, 1 scratch
    assert plan(num_gpu_blocks=7, reserved_blocks=1).num_gpu_blocks == 7  # the scheduler gets what was asked
    with pytest.raises(ValueError, match="reserved"):
        plan(kv_cache_memory=400, reserved_blocks=1)


def test_graph_headroom_grows_with_the_largest_capture_size() -> None:
    config = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # fmt: skip
    small, large = (graph_headroom_bytes(config, n, 2, 8192) for n in (8, 256))
    assert 256 * 2**20 < small < large
    # logits alone (float32 and bf16) of 256 rows over 49152 words: about 75 MB; the estimate doubles it
    assert large - 256 * 2**20 > 2 * 256 * 49152 * 6


# ---- the graphs' fallbacks, with stand-in graphs ------------------------------------------------


class _StandInGraph:
    def __init__(self, out: torch.Tensor, shift: float) -> None:
        self.out, self.shift, self.replays = out, shift, 0

    def replay(self) -> None:
        self.replays += 1


class _StandInGraphs(DecodeGraphs):
    """DecodeGraphs whose capture is a call of the eager forward (or an out-of-memory error)."""

    def __init__(self, static, forward, oom_above: int, wrong: int | None = None) -> None:
        super().__init__(static, forward)
        self.oom_above, self.wrong = oom_above, wrong

    def _new_pool(self):
        return None

    def _capture_one(self, size, pool):
        if size > self.oom_above:
            raise torch.cuda.OutOfMemoryError("stand-in")
        step = self.static.padding_step(size)
        out = self._forward(step)
        return _StandInGraph(out, 0.0), out

    def replay(self, step):
        graph, out = self._graphs[step.size]
        graph.replay()
        got = self._forward(step)  # what a graph of this step computes
        if step.size == self.wrong:
            got = got.clone()
            got[0, 0] = torch.nextafter(got[0, 0], torch.tensor(float("inf")))  # one element, one ulp off
        out.copy_(got)
        return out


def _forward_of(static: StaticDecodeInputs):
    def forward(step):  # logits that depend on every input the graph reads
        m = step.meta
        base = step.input_ids.double() * 3 + step.positions.double() + m.seq_lens.double() * 7
        return (base[:, None] + m.block_tables.double().sum(1, keepdim=True) + torch.arange(5.0)[None]).float()

    return forward


def test_a_capture_out_of_memory_drops_that_size_and_says_so(caplog) -> None:
    static = StaticDecodeInputs(DecodePadding(sizes=(1, 2, 4, 8), table_width=3), scratch_block=6, block_size=4,
                                device=torch.device("cpu"))  # fmt: skip
    graphs = _StandInGraphs(static, _forward_of(static), oom_above=2)
    with caplog.at_level(logging.WARNING, logger="pagedrs.engine"):
        assert graphs.capture((1, 2, 4, 8)) == (1, 2)
    assert sorted(graphs.dropped) == [4, 8]
    assert "out of memory" in caplog.text and "[4, 8]" in caplog.text


def test_a_replay_that_differs_from_eager_by_one_bit_turns_graphs_off_naming_the_size(caplog) -> None:
    static = StaticDecodeInputs(DecodePadding(sizes=(1, 2, 4), table_width=3), scratch_block=6, block_size=4,
                                device=torch.device("cpu"))  # fmt: skip
    kv = torch.zeros((1, 2, 7, 4, 1, 8))
    exact = _StandInGraphs(static, _forward_of(static), oom_above=8)
    exact.capture((1, 2, 4))
    assert exact.validate(kv, num_blocks=6, vocab_size=50) is None and exact.sizes == (1, 2, 4)
    assert not kv.any(), "the test batch's pages are zeroed again"
    wrong = _StandInGraphs(static, _forward_of(static), oom_above=8, wrong=2)
    wrong.capture((1, 2, 4))
    with caplog.at_level(logging.WARNING, logger="pagedrs.engine"):
        assert wrong.validate(kv, num_blocks=6, vocab_size=50) == 2
    assert wrong.sizes == () and "decode batch size 2 differs" in caplog.text


class _BrokenCapture(_StandInGraphs):
    def _capture_one(self, size, pool):
        if size == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        if size == 4:
            raise RuntimeError("CUDA error: out of memory (capture invalidated)")
        return super()._capture_one(size, pool)


def test_a_capture_that_fails_otherwise_turns_graphs_off_and_an_oom_runtime_error_only_drops_its_size(caplog) -> None:
    static = StaticDecodeInputs(DecodePadding(sizes=(1, 2, 4, 8), table_width=3), scratch_block=6, block_size=4,
                                device=torch.device("cpu"))  # fmt: skip
    graphs = _BrokenCapture(static, _forward_of(static), oom_above=8)
    with caplog.at_level(logging.WARNING, logger="pagedrs.engine"):
        assert graphs.capture((1, 2, 4, 8)) == ()
    assert graphs.dropped == [4] and graphs.failed == 2
    assert "capturing decode batch size 2 failed" in caplog.text and "not permitted" in caplog.text
