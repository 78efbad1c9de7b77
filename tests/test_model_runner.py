"""ModelRunner block movement: copy-on-write and swap run as indexed copies, in the contract's order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_driver import BlockPool, PagedSeq, build_step, greedy_generate
from pagedrs.attention import TorchAttentionBackend, get_backend
from pagedrs.model_runner import ModelRunner
from pagedrs.models import load_model
from pagedrs.step_input import StepInput, Transfer


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _pairs(v) -> np.ndarray:
    return np.array(v, dtype=np.int64).reshape(-1, 2)


def _moves(swap_out=(), swap_in=()) -> tuple[Transfer, ...]:
    """Transfers as the core hands them out: device->host first, then host->device."""
    moves = [Transfer(1, "gpu", "cpu", _pairs(swap_out)), Transfer(2, "cpu", "gpu", _pairs(swap_in))]
    return tuple(t for t in moves if len(t.pairs))


def _empty_step(swap_out=(), swap_in=(), copies=()) -> StepInput:
    z = np.zeros(0, dtype=np.int64)
    return StepInput(
        input_ids=z, positions=z, slot_mapping=z, query_start_loc=np.zeros(1, dtype=np.int32),
        seq_lens=np.zeros(0, dtype=np.int32), block_tables=np.zeros((0, 1), dtype=np.int32),
        transfers=_moves(swap_out, swap_in), copies=_pairs(copies),
    )


def test_cache_layout_and_dtype(loaded):
    r = ModelRunner(loaded, num_gpu_blocks=5, num_cpu_blocks=3, block_size=4)
    c = loaded.config
    assert r.kv_cache.shape == (c.num_hidden_layers, 2, 5, 4, c.num_key_value_heads, c.head_dim)
    assert r.cpu_cache.shape == (c.num_hidden_layers, 2, 3, 4, c.num_key_value_heads, c.head_dim)
    assert r.kv_cache.dtype == r.cpu_cache.dtype == torch.float32
    assert isinstance(r.backend, TorchAttentionBackend) and isinstance(get_backend("cpu"), TorchAttentionBackend)


def test_copies_and_swaps_in_contract_order(loaded):
    r = ModelRunner(loaded, num_gpu_blocks=6, num_cpu_blocks=4, block_size=2)
    torch.manual_seed(0)
    r.kv_cache.copy_(torch.randn_like(r.kv_cache))
    r.cpu_cache.copy_(torch.randn_like(r.cpu_cache))
    gpu0, cpu0 = r.kv_cache.clone(), r.cpu_cache.clone()
    # swap out gpu 1 -> cpu 0 and gpu 4 -> cpu 2; then swap in cpu 0 -> gpu 4 (the block that was just
    # swapped out, so order matters) and cpu 3 -> gpu 5; then copy gpu 5 -> gpu 0 and gpu 2 -> gpu 3
    logits = r.execute(_empty_step(swap_out=[[1, 0], [4, 2]], swap_in=[[0, 4], [3, 5]], copies=[[5, 0], [2, 3]]))
    assert logits.shape == (0, loaded.config.vocab_size)
    exp_cpu = cpu0.clone()
    exp_cpu[:, :, 0], exp_cpu[:, :, 2] = gpu0[:, :, 1], gpu0[:, :, 4]
    exp_gpu = gpu0.clone()
    exp_gpu[:, :, 4], exp_gpu[:, :, 5] = exp_cpu[:, :, 0], exp_cpu[:, :, 3]
    exp_gpu[:, :, 0], exp_gpu[:, :, 3] = exp_gpu[:, :, 5], exp_gpu[:, :, 2]
    assert torch.equal(r.cpu_cache, exp_cpu)
    assert torch.equal(r.kv_cache, exp_gpu)


def test_swap_round_trip_keeps_generation(loaded, tiny_llama_dir):
    """Prefill, swap the sequence's pages out, poison the device blocks, swap into other blocks: same tokens."""
    prompt = [5, 9, 17, 33, 65, 129, 250, 4, 8]
    ref_runner = ModelRunner(loaded, num_gpu_blocks=16, num_cpu_blocks=0, block_size=4)
    expected = greedy_generate(ref_runner, [prompt], 4)[0]

    r = ModelRunner(loaded, num_gpu_blocks=16, num_cpu_blocks=8, block_size=4)
    pool = BlockPool(16)
    seq = PagedSeq(list(prompt))
    logits = r.execute(build_step([seq], [len(prompt)], 4, pool))
    seq.num_computed = len(prompt)
    seq.token_ids.append(int(logits.argmax()))
    old = list(seq.block_table)
    new = [13, 14, 15]
    r.execute(_empty_step(swap_out=[[b, i] for i, b in enumerate(old)]))
    r.kv_cache[:, :, old] = float("nan")
    seq.block_table = list(new)
    got = [seq.token_ids[-1]]
    step = build_step([seq], [1], 4, pool)
    step = StepInput(**{**step.__dict__, "transfers": _moves(swap_in=[[i, b] for i, b in enumerate(new)])})
    while True:
        logits = r.execute(step)
        seq.num_computed += 1
        if len(got) == 4:
            break
        seq.token_ids.append(int(logits.argmax()))
        got.append(seq.token_ids[-1])
        step = build_step([seq], [1], 4, pool)
    assert got == expected


def test_zero_query_sequence_is_rejected(loaded):
    r = ModelRunner(loaded, num_gpu_blocks=4, num_cpu_blocks=0, block_size=4)
    seqs = [PagedSeq([5, 6]), PagedSeq([7])]
    step = build_step(seqs, [2, 1], 4, BlockPool(4))
    bad = StepInput(**{**step.__dict__, "query_start_loc": np.array([0, 3, 3], dtype=np.int32)})
    with pytest.raises(ValueError, match=r"at least one new token; query lengths \[3, 0\]"):
        r.execute(bad)
    # as many tokens as sequences, but not one each: a decode step's check names the query starts
    one_each = build_step(seqs[:1] + [PagedSeq([8])], [1, 1], 4, BlockPool(4))
    bad = StepInput(**{**one_each.__dict__, "query_start_loc": np.array([0, 2, 2], dtype=np.int32)})
    with pytest.raises(ValueError, match=r"at least one new token; query starts \[0, 2, 2\]"):
        r.execute(bad)


def _reference_attention(query, key_cache, value_cache, meta, scale):
    """One sequence at a time, unpadded: gather its pages, causal SDPA at its positions."""
    out = torch.empty_like(query)
    bs = key_cache.shape[1]
    starts = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        q = query[starts[i] : starts[i + 1]]
        blocks = meta.block_tables[i, : -(-seq_len // bs)].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len]
        v = value_cache[blocks].flatten(0, 1)[:seq_len]
        q_pos = torch.arange(seq_len - len(q), seq_len)
        mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[starts[i] : starts[i + 1]] = o.transpose(0, 1)
    return out


def test_torch_backend_buckets_match_per_sequence_attention():
    """Decode rows and varlen prefill chunks of very different lengths (several buckets) in one step."""
    from pagedrs.attention import AttentionMetadata

    g = torch.Generator().manual_seed(0)
    bs, kv_heads, heads, d, num_blocks = 4, 2, 6, 8, 64
    q_lens = [1, 7, 1, 1, 30, 2, 1, 12]
    seq_lens = [5, 7, 40, 3, 45, 9, 17, 12]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(q_lens), 12, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        for b in range(-(-n // bs)):
            tables[i, b] = perm.pop()
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )
    key_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
    value_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
    query = torch.randn(starts[-1], heads, d, generator=g)
    backend = TorchAttentionBackend()
    got = backend.forward(query, key_cache, value_cache, meta, 0.3)
    assert len(backend.plan(meta, bs).buckets) >= 4  # the lengths above really spread over buckets
    torch.testing.assert_close(got, _reference_attention(query, key_cache, value_cache, meta, 0.3))
    decode_only = [i for i, q in enumerate(q_lens) if q == 1]  # the single-bucket fast path
    dm = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:4], query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens=torch.tensor([5, 3, 6, 7], dtype=torch.int32), block_tables=tables[decode_only], max_query_len=1,
        max_seq_len=7, query_start_loc_cpu=list(range(5)), seq_lens_cpu=[5, 3, 6, 7],
    )
    torch.testing.assert_close(backend.forward(query[:4], key_cache, value_cache, dm, 0.3),
                               _reference_attention(query[:4], key_cache, value_cache, dm, 0.3))


@pytest.mark.parametrize("seed", range(12))
def test_decode_buckets_planned_with_numpy_equal_the_per_sequence_plan(seed):
    """A decode-only step's buckets (the NumPy plan) hold exactly the tensors the general loop makes:
    random lengths over several buckets, pages released by a window (-1), shared pages or not; seeds
    6 and up: lengths in one bucket (a steady batch, planned by ``_whole_decode_bucket``)."""
    from pagedrs.attention import AttentionMetadata
    from pagedrs.attention.torch_backend import _may_share_pages, _plan_buckets, _plan_buckets_loop, _plan_decode_buckets

    rng = np.random.default_rng(seed)
    bs, num_seqs = 4, int(rng.integers(1, 40))
    seq_lens = rng.integers(33, 61, num_seqs).tolist() if seed >= 6 else rng.integers(1, 90, num_seqs).tolist()
    width = -(-max(seq_lens) // bs) + int(rng.integers(0, 3))
    tables = torch.from_numpy(rng.permutation(num_seqs * width)[: num_seqs * width].reshape(num_seqs, width)).int()
    if seed % 3 == 1:
        tables[:, 0] = -1  # released out of a window: never shared
    if seed % 3 == 2 and num_seqs > 1:
        tables[1, 0] = tables[0, 0]  # a shared first page: the general loop (it plans the cascade)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.long), query_start_loc=torch.arange(num_seqs + 1).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, max_query_len=1,
        max_seq_len=max(seq_lens), query_start_loc_cpu=list(range(num_seqs + 1)), seq_lens_cpu=seq_lens,
    )
    want = _plan_buckets_loop(meta, bs)
    assert want[0].cascade is None or _may_share_pages(meta)
    if seed % 3 == 2 and num_seqs > 1:
        assert _may_share_pages(meta)  # the loop plans it (the engine tests check its outputs)
        return
    got = _plan_decode_buckets(meta, bs)
    assert len(got) == len(want) and len(_plan_buckets(meta, bs)) == len(want)
    assert seed < 6 or len(got) == 1
    for g, w in zip(got, want):
        assert g.cascade is None and g.keep is None and w.keep is None and g.rows_are_all == w.rows_are_all
        for name in ("rows", "out_rows", "tables", "mask"):
            a, b = getattr(g, name), getattr(w, name)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
        assert got[0].tables.is_contiguous()  # _attend_bucket views it flat


def _pretend_cupy(monkeypatch) -> None:
    """find_spec("cupy") answers as on a CUDA machine; nothing here touches a GPU."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "cupy" else real(name, *a))


def test_an_unsupported_kernel_geometry_falls_back_to_torch_when_the_runner_is_built(monkeypatch, caplog):
    """head_size 16 / block 4 has no CUDA kernel: `auto` says so once and runs the reference,
    instead of every request failing in its first forward pass (seen on the first real GPU run)."""
    from pagedrs.attention.cuda_backend import CudaAttentionBackend

    _pretend_cupy(monkeypatch)
    monkeypatch.delenv("PAGEDRS_ATTENTION_BACKEND", raising=False)
    with caplog.at_level("WARNING", logger="pagedrs.attention"):
        backend = get_backend("cuda", dtype=torch.float32, head_size=16, block_size=4)
    assert isinstance(backend, TorchAttentionBackend)
    assert "head_size=16" in caplog.text and "block_size=4" in caplog.text
    supported = get_backend("cuda", dtype=torch.bfloat16, head_size=128, block_size=16)
    assert isinstance(supported, CudaAttentionBackend)
    monkeypatch.setenv("PAGEDRS_ATTENTION_BACKEND", "cuda")  # insisting on the kernels: refused by name
    with pytest.raises(ValueError, match=r"PAGEDRS_ATTENTION_BACKEND=cuda cannot run here: .*head_size=16.*head_size in \["):
        get_backend("cuda", dtype=torch.float32, head_size=16, block_size=4)
    with pytest.raises(ValueError, match="needs a CUDA device; the model runs on cpu"):
        get_backend("cpu")


@pytest.mark.parametrize("value", ["Torch ", "", "auto"])
def test_backend_choice_is_read_case_and_space_insensitively(monkeypatch, value):
    monkeypatch.setenv("PAGEDRS_ATTENTION_BACKEND", value)
    assert isinstance(get_backend("cpu"), TorchAttentionBackend)


def test_an_unknown_backend_name_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDRS_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"PAGEDRS_ATTENTION_BACKEND='triton' is not a backend; allowed: auto, torch, cuda"):
        get_backend("cpu")


def test_an_empty_decode_step_plans_no_bucket():
    from pagedrs.attention import AttentionMetadata
    from pagedrs.attention.torch_backend import _plan_buckets

    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), query_start_loc=torch.zeros(1, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32), block_tables=torch.zeros((0, 0), dtype=torch.int32),
        max_query_len=0, max_seq_len=0, query_start_loc_cpu=[0], seq_lens_cpu=[],
    )
    assert _plan_buckets(meta, 4) == []
