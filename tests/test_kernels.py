"""CUDA kernels: dispatch table, split-K rule and NVRTC compile on the CPU; numerics on a GPU.

GPU tests compare every kernel with the PyTorch reference backend run in float64
on the same inputs, on fresh seeded random data with shuffled physical block ids,
and poison (NaN-fill) every output first so that an unwritten element fails.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from pagedrs.kernels import BLOCK_SIZES, HEAD_SIZES, SUPPORTED, SplitPlan, lookup, plan_split, work_items
from pagedrs.kernels.dispatch import all_name_expressions
from pagedrs.kernels.ops import contiguous_runs

# ---------------------------------------------------------------- CPU: table, planning, compile


def test_dispatch_table_is_the_documented_product() -> None:
    assert HEAD_SIZES == (64, 80, 96, 128, 256)
    assert BLOCK_SIZES == (8, 16, 32)
    # every dtype with a cache of its own dtype, and the 16-bit dtypes with either fp8 cache
    assert len(SUPPORTED) == 3 * 5 * 3 + 2 * 2 * 5 * 3
    entry = lookup(torch.bfloat16, 128, 16)
    assert entry.attention == "pagedrs::paged_attention_kernel<pagedrs::bf16_t, pagedrs::bf16_t, 128, 16>"
    assert entry.reduce == "pagedrs::attention_reduce_kernel<pagedrs::bf16_t>"
    assert lookup("float32", 64, 8).reshape_and_cache == "pagedrs::reshape_and_cache_kernel<float, float>"
    assert entry.attention_kernel("v1") == entry.attention
    assert entry.attention_kernel("v2") == "pagedrs::paged_attention_v2_kernel<pagedrs::bf16_t, pagedrs::bf16_t, 128, 16>"
    fp8 = lookup(torch.float16, 64, 8, cache_dtype=torch.float8_e5m2)
    assert fp8.attention == "pagedrs::paged_attention_kernel<pagedrs::half_t, pagedrs::fp8_e5m2_t, 64, 8>"
    assert fp8.reshape_and_cache == "pagedrs::reshape_and_cache_kernel<pagedrs::half_t, pagedrs::fp8_e5m2_t>"
    assert fp8.reduce == "pagedrs::attention_reduce_kernel<pagedrs::half_t>"  # the output is the queries' dtype
    assert lookup("bfloat16", 64, 8, cache_dtype="bfloat16") == lookup("bfloat16", 64, 8)
    with pytest.raises(ValueError, match=r"variant='v3'; expected one of \['v1', 'v2'\]"):
        entry.attention_kernel("v3")
    # 105 attention instances of each variant + 3 reduce + 7 cache instances + copy_blocks
    assert len(all_name_expressions()) == 221


@pytest.mark.parametrize(("dtype", "head", "block"), [("float16", 72, 16), ("float64", 128, 16), ("bfloat16", 128, 64)])
def test_unsupported_combination_lists_supported_values(dtype: str, head: int, block: int) -> None:
    with pytest.raises(ValueError) as err:
        lookup(dtype, head, block)
    msg = str(err.value)
    assert f"dtype={dtype}, head_size={head}, block_size={block}" in msg
    assert "['float16', 'bfloat16', 'float32']" in msg and "['float8_e4m3fn', 'float8_e5m2']" in msg
    assert "[64, 80, 96, 128, 256]" in msg and "[8, 16, 32]" in msg


def test_split_rule_on_given_numbers() -> None:
    # batch 1 x 16384 at 8 KV heads on 132 SMs: 8 blocks -> 64 partitions of 256 keys
    assert plan_split(8, 16384, 132) == SplitPlan(num_parts=64, part_tokens=256)
    # batch 64 x 4096: 512 blocks >= 2 waves of 132 -> one pass
    assert plan_split(512, 4096, 132) == SplitPlan(num_parts=1, part_tokens=4096)
    # batch 16 x 4096: 128 blocks -> ceil(528 / 128) = 5 partitions, rounded to 1024-key parts -> 4
    assert plan_split(128, 4096, 132) == SplitPlan(num_parts=4, part_tokens=1024)
    # short contexts never split
    assert plan_split(1, 1024, 132) == SplitPlan(num_parts=1, part_tokens=1024)
    # partitions never shorter than 256 keys
    assert plan_split(1, 1300, 132) == SplitPlan(num_parts=6, part_tokens=256)
    with pytest.raises(ValueError, match="num_sms=0"):
        plan_split(1, 10, 0)


def test_v2_split_rule_fills_four_waves_of_resident_blocks() -> None:
    """v2: 3 blocks per SM; below 4 waves (12 blocks per SM) the grid is split until it holds about 4."""
    from pagedrs.kernels.planning import V2

    # batch 64 x 4096 (Llama-3-8B, 8 KV heads, group 4: one 4-row item per sequence): 512 blocks,
    # 1.3 waves of 396 -> ceil(1584 / 512) = 4 partitions of 1024 keys, 2048 blocks
    assert plan_split(512, 4096, 132, V2) == SplitPlan(num_parts=4, part_tokens=1024)
    # batch 16 x 4096: 128 blocks -> 13 partitions wanted, 316 keys rounded up to 512 -> 8
    assert plan_split(128, 4096, 132, V2) == SplitPlan(num_parts=8, part_tokens=512)
    # batch 1 x 16384: 8 blocks -> as many 256-key partitions as the context has
    assert plan_split(8, 16384, 132, V2) == SplitPlan(num_parts=64, part_tokens=256)
    # four waves already (batch 256 x 4096: 2048 blocks) -> one pass; short contexts never split
    assert plan_split(2048, 4096, 132, V2) == SplitPlan(num_parts=1, part_tokens=4096)
    assert plan_split(8, 1024, 132, V2) == SplitPlan(num_parts=1, part_tokens=1024)


def test_work_items_chunk_rows_by_sixteen() -> None:
    # q_lens 1, 1, 5 with group 4 -> rows 4, 4, 20 -> chunks 1, 1, 2
    assert work_items([1, 1, 5], 4).tolist() == [[0, 0], [1, 0], [2, 0], [2, 16]]
    # MQA with 32 query heads on one KV head: two chunks for one decode token
    assert work_items([1], 32).tolist() == [[0, 0], [0, 16]]
    assert work_items([3], 1).dtype == np.int32
    with pytest.raises(ValueError, match="positive"):
        work_items([1, 0], 4)


def test_work_items_of_v2_chunk_rows_by_four_and_name_their_sequences() -> None:
    # group 8 decode: two 4-row blocks per token; group 3: one block with a row to spare
    assert work_items([1, 1], 8, rows=4).tolist() == [[0, 0], [0, 4], [1, 0], [1, 4]]
    assert work_items([1], 3, rows=4).tolist() == [[0, 0]]
    # a subset of the step's sequences (the decode tokens of a mixed step), by their ids
    assert work_items([1, 1], 4, rows=4, seqs=np.array([2, 5])).tolist() == [[2, 0], [5, 0]]
    with pytest.raises(ValueError, match="seqs has 1 ids for 2 query_lens"):
        work_items([1, 1], 4, rows=4, seqs=np.array([2]))


def test_contiguous_runs_merge_consecutive_pairs() -> None:
    pairs = np.array([[5, 9], [3, 7], [4, 8], [10, 2], [11, 1], [12, 2 + 1]])
    assert contiguous_runs(pairs) == [(3, 7, 3), (10, 2, 1), (11, 1, 1), (12, 3, 1)]


def test_nvrtc_compiles_one_entry_per_dtype_for_sm80_and_sm90() -> None:
    """A syntax error in cuda/ fails here; `make check-kernels` compiles every entry."""
    from pagedrs.kernels.check import compile_arch

    v1 = [lookup(d, 128, 16).attention for d in ("float16", "bfloat16", "float32")]
    v2 = [lookup(d, h, 16).attention_v2 for d in ("float16", "bfloat16") for h in (64, 128)]
    fp8 = [lookup("bfloat16", 128, 16, cache_dtype=c).attention_kernel(v) for c in ("float8_e4m3fn", "float8_e5m2")
           for v in ("v1", "v2")]  # software conversion on sm_80, hardware on sm_90
    v2 += fp8[1::2]
    exprs = v1 + v2 + fp8[0::2] + ["pagedrs::attention_reduce_kernel<float>",
                                   "pagedrs::reshape_and_cache_kernel<pagedrs::half_t, pagedrs::half_t>",
                                   "pagedrs::reshape_and_cache_kernel<pagedrs::bf16_t, pagedrs::fp8_e4m3_t>",
                                   "pagedrs::copy_blocks_kernel"]  # fmt: skip
    for arch in ("sm_80", "sm_90"):
        reports, warnings = compile_arch(arch, exprs)
        assert warnings == []
        assert [r.kernel for r in reports] == exprs
        assert all(r.status == "ok" and r.registers for r in reports), reports
        # v1: 4 blocks of 128 threads per SM (128 registers); v2: 3 (168), and no spills in the decode geometries
        assert all(r.registers <= 128 for r in reports if r.kernel not in v2), reports
        assert all(r.registers <= 168 and r.spill_bytes == 0 for r in reports if r.kernel in v2), reports


# ---------------------------------------------------------------- GPU: kernels vs the reference

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None, reason="needs a CUDA device and CuPy"
)
DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 1e-2), "float16": (torch.float16, 1e-2)}
CONTEXTS = [1, 15, 17, 1000, 4097]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def _case(dtype: torch.dtype, seq_lens: list[int], q_lens: list[int], kv_heads: int, group: int, head: int, block: int, seed: int):
    """Random caches, shuffled physical blocks, metadata, queries (on cuda)."""
    from pagedrs.attention import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros((len(seq_lens), max(per_seq)), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    kc = torch.randn((num_blocks, block, kv_heads, head), generator=gen).to(dtype).cuda()
    vc = torch.randn((num_blocks, block, kv_heads, head), generator=gen).to(dtype).cuda()
    starts = [0, *np.cumsum(q_lens).tolist()]
    q = torch.randn((starts[-1], kv_heads * group, head), generator=gen).to(dtype).cuda()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    return q, kc, vc, meta


def _release_before_window(kc, vc, meta, window: int, block: int):
    """Caches with one more page, all NaN, that every table entry of a page wholly before its
    sequence's window now points at (the core releases such pages): a kernel that reads one
    writes NaN. Returns (key_cache, value_cache, meta)."""
    import dataclasses

    nan_page = torch.full((1, *kc.shape[1:]), float("nan"), dtype=kc.dtype, device=kc.device)
    tables = meta.block_tables.clone()
    starts = meta.query_start_loc_cpu
    for i, n in enumerate(meta.seq_lens_cpu):
        first = max(0, n - (starts[i + 1] - starts[i]) - window + 1)
        tables[i, : first // block] = kc.shape[0]
    return torch.cat([kc, nan_page]), torch.cat([vc, nan_page]), dataclasses.replace(meta, block_tables=tables, plan=None)


def _check_attention(dtype_name: str, seq_lens, q_lens, kv_heads, group, head, block, num_sms, seed=0, window=None,
                     variant="v1") -> None:  # fmt: skip
    from pagedrs.attention import TorchAttentionBackend
    from pagedrs.attention.cuda_backend import CudaAttentionBackend

    dtype, tol = DTYPES[dtype_name]
    q, kc, vc, meta = _case(dtype, seq_lens, q_lens, kv_heads, group, head, block, seed)
    scale = head**-0.5
    want = TorchAttentionBackend().forward(q.double(), kc.double(), vc.double(), meta, scale, sliding_window=window)
    if window is not None:
        kc, vc, meta = _release_before_window(kc, vc, meta, window, block)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    from pagedrs.kernels.planning import V1

    # V1's split numbers for both variants: num_sms=1 means one pass, 1000 a split (over 1024 keys)
    backend = CudaAttentionBackend(num_sms=num_sms, variant=variant, split_rule=V1)
    got = backend.forward(q, kc, vc, meta, scale, sliding_window=window, out=out)
    torch.cuda.synchronize()
    assert not got.isnan().any(), "output not fully written, or a released page was read"
    err = _rel_err(got, want)
    assert err <= tol, f"rel err {err:.3g} > {tol} ({dtype_name}, {variant}, split={meta.plan.split_for(window)})"
    assert [v for v, _ in meta.plan.launches] == (["v1"] if variant == "v1" else ["v2"] * (1 in q_lens) + ["v1"] * (max(q_lens) > 1))


VARIANTS = ("v1", "v2")  # pagedrs.kernels.dispatch.VARIANTS


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("num_sms", [1, 1000], ids=["single-pass", "split-k"])
def test_decode_matches_reference(dtype_name: str, group: int, num_sms: int, variant: str) -> None:
    # num_sms=1: the grid always fills the "GPU" -> one pass; 1000: always split (4097 > 1024)
    _check_attention(dtype_name, CONTEXTS, [1] * len(CONTEXTS), 2, group, 128, 16, num_sms, variant=variant)


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head", HEAD_SIZES)
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_decode_every_geometry(head: int, block: int, variant: str) -> None:
    _check_attention("bfloat16", [1, 17, 1000, 2100], [1, 1, 1, 1], 2, 4, head, block, num_sms=1000, seed=head + block,
                     variant=variant)  # fmt: skip
    if variant == "v2" and block == 16:  # float32: 4-element vectors, other lane layouts (heads 80, 96: 20 and 24
        # of 32 lanes); one block size, as each geometry is one more NVRTC compile
        _check_attention("float32", [1, 300, 2100], [1, 1, 1], 2, 4, head, block, num_sms=1, seed=head, variant=variant)


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_chunks_and_decode_in_one_step(dtype_name: str, group: int, variant: str) -> None:
    # a whole prompt, a chunk after a cached prefix, a decode token, a chunk at an odd offset
    # (v2: the decode token by the v2 kernel, the chunks by v1, into one output)
    _check_attention(dtype_name, [33, 1000, 17, 4097], [33, 70, 1, 15], 2, group, 128, 16, num_sms=132, seed=group,
                     variant=variant)  # fmt: skip


@gpu
@needs_gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("window", [1, 5, 16, 50, 1500, 5000])
@pytest.mark.parametrize("num_sms", [1, 1000], ids=["single-pass", "split-k"])
def test_sliding_window_matches_reference(window: int, num_sms: int, variant: str) -> None:
    # decode (split-K over the window when it exceeds 1024 keys), then prefill chunks with the decode token
    _check_attention("bfloat16", CONTEXTS, [1] * len(CONTEXTS), 2, 4, 128, 16, num_sms, seed=window, window=window,
                     variant=variant)  # fmt: skip
    _check_attention("float32", [33, 1000, 17, 4097], [33, 70, 1, 15], 2, 1, 128, 16, num_sms, seed=window, window=window,
                     variant=variant)  # fmt: skip


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_write_kv_touches_exactly_the_slots(dtype_name: str) -> None:
    from pagedrs.attention.cuda_backend import CudaAttentionBackend

    dtype, _ = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(7)
    num_blocks, block, kv_heads, head, tokens = 9, 16, 4, 128, 37
    slots = torch.randperm(num_blocks * block, generator=gen)[:tokens]
    slots[5] = -1  # padding: skipped
    fused = torch.randn((tokens, 3 * kv_heads * head), generator=gen).to(dtype).cuda()  # strided views
    key = fused[:, : kv_heads * head].view(tokens, kv_heads, head)
    value = fused[:, kv_heads * head : 2 * kv_heads * head].view(tokens, kv_heads, head)
    kc = torch.full((num_blocks, block, kv_heads, head), float("nan"), dtype=dtype, device="cuda")
    vc = kc.clone()
    _, _, _, meta = _case(dtype, [1], [1], kv_heads, 1, head, block, 0)
    meta.slot_mapping = slots.cuda()
    CudaAttentionBackend().write_kv(key, value, kc, vc, meta)
    torch.cuda.synchronize()
    flat_k, flat_v = kc.view(-1, kv_heads, head).cpu(), vc.view(-1, kv_heads, head).cpu()
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], key.cpu()[keep])
    assert torch.equal(flat_v[slots[keep]], value.cpu()[keep])
    untouched = torch.ones(num_blocks * block, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@gpu
@needs_gpu
def test_copy_blocks_all_layers_one_launch() -> None:
    from pagedrs.attention import TorchAttentionBackend
    from pagedrs.attention.cuda_backend import CudaAttentionBackend

    gen = torch.Generator().manual_seed(3)
    cache = torch.randn((3, 2, 12, 16, 2, 64), generator=gen).to(torch.bfloat16).cuda()
    pairs = torch.tensor([[0, 5], [7, 1], [7, 11], [2, 3]], dtype=torch.int64)
    want = cache.clone()
    TorchAttentionBackend().copy_blocks(want, pairs)
    CudaAttentionBackend().copy_blocks(cache, pairs.cuda())
    torch.cuda.synchronize()
    assert torch.equal(cache, want)


@gpu
@needs_gpu
def test_swap_round_trip_through_pinned_host() -> None:
    from pagedrs.attention.cuda_backend import CudaAttentionBackend

    gen = torch.Generator().manual_seed(5)
    shape = (4, 2, 10, 16, 2, 128)  # [layers, K/V, blocks, block_size, kv_heads, head]
    device_cache = torch.randn(shape, generator=gen).to(torch.float16).cuda()
    host = torch.full((4, 2, 6, 16, 2, 128), float("nan"), dtype=torch.float16).pin_memory()
    back = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    out_pairs = torch.tensor([[2, 0], [3, 1], [4, 2], [9, 5], [0, 4]])  # runs (2..4 -> 0..2), singles
    backend = CudaAttentionBackend()
    backend.swap_blocks(device_cache, host, out_pairs)
    backend.swap_blocks(host, back, out_pairs[:, [1, 0]])
    torch.cuda.synchronize()
    idx = out_pairs[:, 0].cuda()
    assert torch.equal(back[:, :, idx], device_cache[:, :, idx])
    assert torch.equal(host[:, :, out_pairs[:, 1]], device_cache[:, :, idx].cpu())
    rest = torch.ones(10, dtype=torch.bool)
    rest[out_pairs[:, 0]] = False
    assert back[:, :, rest.cuda()].isnan().all()


def test_the_extension_embeds_the_same_cuda_sources_for_installed_wheels():
    """A wheel has no cuda/ folder: the extension carries the sources, byte for byte."""
    from pathlib import Path

    from pagedrs._core import cuda_sources
    from pagedrs.kernels import sources

    root = Path(__file__).resolve().parents[1] / "cuda"
    embedded = dict(cuda_sources())
    assert sorted(embedded) == sorted(p.name for p in root.iterdir() if p.suffix in (".cu", ".cuh"))
    for name, text in embedded.items():
        assert text == (root / name).read_text(), name
    unit = sources.translation_unit()
    assert "#include" not in unit and unit.count("#define PAGEDRS_DTYPE_CUH") == 2
