"""A verification's rows attend with decode's numerics, bit for bit (attention/torch_backend.py, rowwise).

Greedy decoding with speculation must pick what sequential decode picks. With bf16-rounded
logits (the default int4/int8 weights on the CPU) two tokens often tie exactly, and SDPA's CPU
kernel computes a query row differently alone than in a block of rows, so a verify step that
attended its k + 1 rows as one block flipped such ties (SmolLM2, random prompt 0, token 9).
"""

from __future__ import annotations

import pytest
import torch

from pagedrs.attention.base import AttentionMetadata
from pagedrs.attention.torch_backend import ROWWISE_MAX_Q, TorchAttentionBackend

BLOCK = 16


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The engine's default (``cpu_threads`` 1). At more threads this torch build's CPU SDPA gives a
    row that a worker thread computes other low bits than the same row on the calling thread
    (measured: two equal heads at 2 threads differ by 6e-8), so a row's bits depend on where it
    sits in the batch, and no row-by-row scheme is bit-equal then. The bit-equality tests ran at
    whatever thread count the tests before them left (1 after any engine): now they say which."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _meta(q_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    width = max(map(len, tables))
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("rows", [2, 5, ROWWISE_MAX_Q])
def test_each_verify_row_equals_a_decode_of_its_position_bit_for_bit(heads, kv_heads, rows):
    torch.manual_seed(rows * 10 + heads)
    head_dim, num_blocks = 64, 96
    key_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim)
    value_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim)
    backend = TorchAttentionBackend()
    # three speculating sequences of different context lengths (two in one bucket, one alone),
    # contexts that end inside a page and on a page boundary
    contexts = [57, 64, 300]
    tables = [list(range(i * 30, i * 30 + -(-(c + rows) // BLOCK))) for i, c in enumerate(contexts)]
    query = torch.randn(len(contexts) * rows, heads, head_dim)
    verify = backend.forward(query, key_cache, value_cache,
                             _meta([rows] * 3, [c + rows for c in contexts], tables), scale=0.125)
    for s, context in enumerate(contexts):
        for j in range(rows):
            length = context + j + 1
            one = query[s * rows + j: s * rows + j + 1]
            decode = backend.forward(one, key_cache, value_cache,
                                     _meta([1], [length], [tables[s][: -(-length // BLOCK)]]), scale=0.125)
            assert torch.equal(verify[s * rows + j], decode[0]), (s, j)


def test_a_prompt_longer_than_the_rowwise_bound_keeps_the_blocked_kernel_and_is_close():
    """Past ROWWISE_MAX_Q rows the blocked kernel runs (fast for prompts); it agrees to rounding."""
    torch.manual_seed(1)
    key_cache, value_cache = torch.randn(8, BLOCK, 2, 32), torch.randn(8, BLOCK, 2, 32)
    backend = TorchAttentionBackend()
    rows = ROWWISE_MAX_Q + 3
    meta = _meta([rows], [40], [[0, 1, 2]])
    plan = backend.plan(meta, BLOCK)
    assert [b.rowwise for b in plan.buckets] == [False]
    query = torch.randn(rows, 4, 32)
    out = backend.forward(query, key_cache, value_cache, meta, scale=0.2)
    for j in range(rows):
        length = 40 - rows + j + 1
        decode = backend.forward(query[j: j + 1], key_cache, value_cache, _meta([1], [length], [[0, 1, 2][: -(-length // BLOCK)]]),
                                 scale=0.2)
        torch.testing.assert_close(out[j], decode[0], rtol=1e-5, atol=1e-5)


def test_smollm2_default_weights_with_prompt_lookup_give_the_tokens_of_sequential_decode():
    """The case that flipped: SmolLM2 in its default (quantized) weights, random prompt 0 of
    ``bench spec``, prompt lookup that speculates at every step; token 9 tied in bf16."""
    from pagedrs.engine import Engine
    from pagedrs.engine_args import EngineArgs
    from pagedrs.sampling_params import SamplingParams

    kw = dict(model="smollm2-135m", enable_prefix_caching=False, num_gpu_blocks=32, block_size=16, max_model_len=256)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2,
            "disable_by_batch_size": None}
    engines = {"plain": Engine(EngineArgs(**kw)), "spec": Engine(EngineArgs(**kw, speculative_config=spec))}
    prompt = torch.randint(100, engines["plain"].loaded.config.vocab_size, (48,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    outs = {}
    for name, engine in engines.items():
        engine.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[name] = list(out.outputs[0].token_ids)
    stats = engines["spec"].stats()
    for engine in engines.values():
        engine.shutdown()
    assert stats["spec_accepted"] > 0, stats  # it did verify drafts
    assert outs["spec"] == outs["plain"]


@pytest.mark.parametrize("threads", [1, 2])
def test_speculation_on_more_than_one_cpu_thread_says_at_start_that_ties_may_differ(tiny_llama_dir, caplog, threads):
    import logging

    from pagedrs.engine import Engine
    from pagedrs.engine_args import EngineArgs

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    with caplog.at_level(logging.WARNING, logger="pagedrs.engine"):
        for config in (spec, None):
            Engine(EngineArgs(model=str(tiny_llama_dir), num_gpu_blocks=8, block_size=4, max_model_len=32,
                              cpu_threads=threads, speculative_config=config)).shutdown()
    said = [r.getMessage() for r in caplog.records if "speculative decoding on the CPU" in r.getMessage()]
    assert said == ([] if threads == 1 else [
        "speculative decoding on the CPU with cpu_threads=2: its greedy output equals decoding without speculation "
        "bit for bit only at cpu_threads=1 (torch's CPU attention gives rows on its worker threads other low bits), "
        "so at an exact tie between two logits it can pick another token"])
