"""The kernels of cuda/, executed on the CPU by the emulator, against a float64 reference.

Everything above the kernels is the production code: ``CudaAttentionBackend`` plans
the step (work items, split-K) and ``ops`` checks shapes, builds the argument
tuples and grids; only the runtime underneath is the emulator (tests/cuda_emu).
The reference is ``TorchAttentionBackend`` in float64 on the same inputs.

Every case is adversarial about memory: physical blocks are shuffled, table
entries after a sequence's used ones point at NaN-filled pages or past the end of
the cache, the slots after each sequence's last token and every unused page are
NaN, and every output starts as NaN, so a read of anything the kernel must not see,
or an element it forgets to write, fails the comparison. Queries are strided views
of a fused qkv tensor, as the models pass them.

``make test`` runs a fast selection under two schedules; ``make test-kernels``
(PAGEDRS_KERNELS_LONG=1) adds the odd contexts 1, 15, 17, 1000, 4097, every
geometry of the dispatch table and the third schedule.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from cuda_emu.build import SUPPORTED_MACHINE
from cuda_emu.runtime import EmulatedRuntime
from pagedrs.attention import AttentionMetadata, TorchAttentionBackend
from pagedrs.attention.cuda_backend import CudaAttentionBackend
from pagedrs.kernels import BLOCK_SIZES, HEAD_SIZES, SplitPlan
from pagedrs.kernels.dispatch import VARIANTS
from pagedrs.kernels.planning import ROWS_PER_ITEM, V1, visible_keys, work_items

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not SUPPORTED_MACHINE, reason="the CUDA emulator runs on x86-64 only")

LONG = os.environ.get("PAGEDRS_KERNELS_LONG") == "1"
long_only = pytest.mark.skipif(not LONG, reason="long kernel suite: make test-kernels")
DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 1e-2), "float16": (torch.float16, 1e-2)}
# CI runs two schedules; the long suite all three (a missing barrier may show under one only).
SCHEDULES = ["forward", "warp-random", "reverse"] if LONG else ["forward", "warp-random"]
CONTEXTS = [1, 15, 17, 1000, 4097] if LONG else [1, 17, 1100]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def _case(dtype, seq_lens, q_lens, kv_heads, group, head, block, seed, window=None, placeholder=None):
    """Poisoned caches with shuffled pages, metadata, and queries as a strided view of fused qkv.

    Returns (query, key_cache, value_cache, clean key_cache, clean value_cache, clean
    block tables, meta): the clean caches hold zeros where the others hold NaN, for the
    reference. With a sliding ``window``, every slot before the window of a sequence's
    first new token is NaN too, and the table entries of pages wholly before it are
    replaced, as the core does when it releases them: by NaN pages, or by ``placeholder``
    (an invalid id) when given. The clean tables keep the real pages.
    """
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block) for n in seq_lens]
    num_blocks = sum(per_seq) + 3  # three pages nobody uses
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    unused = perm[sum(per_seq) :]
    width = max(per_seq) + 2
    tables = torch.empty((len(seq_lens), width), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        # after the used entries: poisoned pages and ids past the end of the cache
        tables[i, n:] = torch.tensor([num_blocks + 7 if j % 2 else unused[(i + j) % len(unused)] for j in range(width - n)])
        used += n
    shape = (num_blocks, block, kv_heads, head)
    kc = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    vc = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    poison = torch.ones(num_blocks * block, dtype=torch.bool)
    for i, n in enumerate(seq_lens):
        slots = tables[i, : per_seq[i]].long()[:, None] * block + torch.arange(block)
        poison[slots.flatten()[:n]] = False  # written positions of sequence i
    clean_tables = torch.where(tables < num_blocks, tables, unused[0])  # the reference may gather any entry
    for i, (n, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        first = max(0, n - q_len - window + 1) if window is not None else 0
        slots = tables[i, : per_seq[i]].long()[:, None] * block + torch.arange(block)
        poison[slots.flatten()[:first]] = True  # before the window: never to be read
        gone = first // block  # pages wholly before the window
        tables[i, :gone] = torch.tensor([unused[j % len(unused)] if placeholder is None else placeholder for j in range(gone)],
                                        dtype=torch.int32)  # fmt: skip
    clean_k, clean_v = kc.clone(), vc.clone()
    kc.view(-1, kv_heads, head)[poison] = float("nan")
    vc.view(-1, kv_heads, head)[poison] = float("nan")
    clean_k.view(-1, kv_heads, head)[poison] = 0
    clean_v.view(-1, kv_heads, head)[poison] = 0
    starts = [0, *np.cumsum(q_lens).tolist()]
    heads = kv_heads * group
    fused = torch.randn((starts[-1], (heads + 2 * kv_heads) * head), generator=gen, dtype=torch.float64).to(dtype)
    q = fused[:, : heads * head].view(starts[-1], heads, head)  # token stride (heads + 2 kv_heads) * head
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    return q, kc, vc, clean_k, clean_v, clean_tables, meta


def check_attention(dtype_name, seq_lens, q_lens, kv_heads, group, head, block, num_sms, schedule, seed=0, parts=None,
                    files=None, window=None, placeholder=None, variant="v1", v2_prefetch=0):  # fmt: skip
    """Backend output == float64 reference within the dtype's tolerance; ``files`` replaces cuda/;
    ``window``: a sliding window, with the pages before it released (see ``_case``); ``variant``:
    the backend's kernel variant (v2: decode tokens by the v2 kernel, prefill chunks by v1), or
    "v2-all": the v2 kernel for every row, prefill chunks too (the backend never does that, but
    the kernel's masks are per row and must hold for any rows)."""
    dtype, tol = DTYPES[dtype_name]
    q, kc, vc, clean_k, clean_v, clean_tables, meta = _case(dtype, seq_lens, q_lens, kv_heads, group, head, block, seed,
                                                            window, placeholder)  # fmt: skip
    assert not q.is_contiguous() and q.stride(0) == (kv_heads * group + 2 * kv_heads) * head
    scale = head**-0.5
    ref_meta = dataclasses.replace(meta, block_tables=clean_tables)
    want = TorchAttentionBackend().forward(q.double(), clean_k.double(), clean_v.double(), ref_meta, scale, sliding_window=window)
    runtime = EmulatedRuntime(schedule=schedule, seed=seed, files=files)
    # V1's split numbers for both variants: num_sms=1 means one pass, 1000 a split (over 1024 keys)
    backend = CudaAttentionBackend(num_sms=num_sms, runtime=runtime, variant=variant.removesuffix("-all"), split_rule=V1,
                                   v2_prefetch=v2_prefetch)  # fmt: skip
    if variant == "v2-all":
        plan = backend.plan(meta, block, kv_heads * group, kv_heads)
        items = work_items(q_lens, group, rows=ROWS_PER_ITEM["v2"])
        meta.plan = dataclasses.replace(plan, launches=(("v2", torch.from_numpy(items)),))
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    got = backend.forward(q, kc, vc, meta, scale, sliding_window=window, out=out)
    split = meta.plan.split_for(window)
    if parts is not None:
        assert (split.num_parts > 1) == (parts == "split"), split
    assert not got.isnan().any(), f"output not fully written, or a poisoned page was read (split={split})"
    err = _rel_err(got, want)
    assert err <= tol, f"rel err {err:.3g} > {tol} ({dtype_name}, split={split}, {schedule})"
    launched = [name.split("<")[0] for name, _, _ in runtime.launches]
    if variant == "v1":
        kernels = ["pagedrs::paged_attention_kernel"]
    elif variant == "v2-all":
        kernels = ["pagedrs::paged_attention_v2_kernel"]
    else:
        kernels = ["pagedrs::paged_attention_v2_kernel"] * (1 in q_lens) + ["pagedrs::paged_attention_kernel"] * (max(q_lens) > 1)
    assert launched == kernels + (["pagedrs::attention_reduce_kernel"] if split.num_parts > 1 else [])


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("num_sms", [1, 1000], ids=["single-pass", "split-k"])
def test_decode_matches_reference(dtype_name: str, group: int, num_sms: int, schedule: str, variant: str) -> None:
    # num_sms=1: the grid always fills the "GPU" -> one pass; 1000: contexts over 1024 split.
    # v2 blocks hold 4 rows: group 3 leaves one empty, group 8 needs two blocks per KV head.
    if group == 3 and variant == "v1":
        pytest.skip("v1 blocks hold 16 rows: group 3 adds nothing to groups 1 and 4")
    check_attention(dtype_name, CONTEXTS, [1] * len(CONTEXTS), 2, group, 128, 16, num_sms, schedule,
                     parts="split" if num_sms == 1000 else "single", variant=variant)  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_chunks_and_decode_in_one_step(dtype_name: str, group: int, schedule: str, variant: str) -> None:
    # a whole prompt, a chunk after a cached prefix, a decode token, a chunk at an odd offset;
    # v2: the decode token by the v2 kernel, the chunks by v1, into the same output
    seq_lens, q_lens = ([33, 1000, 17, 4097], [33, 70, 1, 15]) if LONG else ([33, 200, 17, 61], [33, 40, 1, 15])
    check_attention(dtype_name, seq_lens, q_lens, 2, group, 128, 16, 132, schedule, seed=group, parts="single",
                    variant=variant)  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("head", "block"), [(64, 8), (80, 32), (96, 16), (256, 32)])
def test_decode_and_prefill_other_geometries(head: int, block: int, variant: str) -> None:
    check_attention("bfloat16", [1, 17, 1100], [1, 1, 1], 2, 4, head, block, num_sms=1000, schedule="forward",
                     seed=head + block, parts="split", variant=variant)  # fmt: skip
    check_attention("float16", [40, 9, 33], [40, 3, 1], 1, 4, head, block, num_sms=132, schedule="warp-random",
                     seed=head, variant=variant)  # fmt: skip
    # float32 rows are 16 bytes of 4 elements: head 80 and 96 take 20 and 24 of a v2 warp's 32 lanes
    check_attention("float32", [1, 300], [1, 1], 2, 2, head, block, num_sms=1, schedule="reverse", seed=head,
                     variant=variant)  # fmt: skip


@long_only
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head", HEAD_SIZES)
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_decode_every_geometry(head: int, block: int, variant: str) -> None:
    check_attention("bfloat16", [1, 17, 1000, 2100], [1, 1, 1, 1], 2, 4, head, block, num_sms=1000,
                     schedule="reverse", seed=head + block, variant=variant)  # fmt: skip


@long_only
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("group", [2, 16, 32])
def test_wide_groups_span_several_work_items(group: int, variant: str) -> None:
    check_attention("float32", [5, 300], [5, 1], 1, group, 64, 16, num_sms=132, schedule="warp-random", seed=group,
                     variant=variant)  # fmt: skip
    check_attention("float32", [5, 1300], [1, 1], 1, group, 64, 16, num_sms=1000, schedule="forward", seed=group,
                     parts="split", variant=variant)  # fmt: skip


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("group", [1, 3])
def test_v2_kernel_is_exact_on_prefill_rows_too(group: int, schedule: str) -> None:
    """Prefill chunks run on v2's 4-row blocks (rows of up to 4 positions, their own causal
    limits and window starts), with and without a window."""
    for window in (None, 5, 50):
        check_attention("float32", [33, 200, 17, 61], [33, 40, 1, 15], 2, group, 64, 16, num_sms=132, schedule=schedule,
                        seed=group, parts="single", window=window, variant="v2-all")  # fmt: skip


@pytest.mark.parametrize("prefetch", [1, 3])
def test_v2_prefetch_reads_only_the_partition(prefetch: int) -> None:
    """v2's L2 prefetch (a no-op off the GPU) still computes its addresses from the block table:
    only entries of keys inside the partition may be read (past it the tables hold NaN pages and
    ids past the cache; ASan runs check the reads), and the result must not change."""
    check_attention("bfloat16", [1, 17, 1100], [1, 1, 1], 2, 4, 128, 16, num_sms=1000, schedule="warp-random",
                    parts="split", variant="v2", v2_prefetch=prefetch)  # fmt: skip
    check_attention("float16", [1, 300, 2100], [1, 1, 1], 2, 4, 128, 16, num_sms=1, schedule="forward",
                    window=1500, variant="v2", v2_prefetch=prefetch)  # fmt: skip


def test_v2_prefetch_distance_is_checked() -> None:
    with pytest.raises(ValueError, match="PAGEDRS_V2_PREFETCH='x' must be a non-negative number of chunks"):
        os.environ["PAGEDRS_V2_PREFETCH"] = "x"
        try:
            CudaAttentionBackend(runtime=EmulatedRuntime())
        finally:
            del os.environ["PAGEDRS_V2_PREFETCH"]
    with pytest.raises(ValueError, match=r"prefetch_chunks=-1 must be an int in \[0, 64\]"):
        check_attention("bfloat16", [1, 17], [1, 1], 2, 4, 128, 16, num_sms=1, schedule="forward", variant="v2",
                        v2_prefetch=-1)  # fmt: skip


# ---------------------------------------------------------------- sliding window
# Windows 1, under a page (5), one page (16), several pages (50), and at least every
# context (5000): the last must equal full causal attention. Every slot before a
# sequence's window is NaN and its wholly-before pages are released (see _case).
WINDOWS = [1, 5, 16, 50, 5000]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("window", WINDOWS)
def test_window_decode_matches_reference(window: int, schedule: str, variant: str) -> None:
    check_attention("bfloat16", [1, 17, 1100], [1, 1, 1], 2, 4, 128, 16, num_sms=1, schedule=schedule, seed=window,
                     window=window, variant=variant)  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("group", [1, 4])
def test_window_prefill_chunks_and_decode_in_one_step(window: int, group: int, schedule: str, variant: str) -> None:
    # a whole prompt, a chunk after a cached prefix, a decode token, a chunk at an odd offset;
    # group 1: a thread block's 16 rows are 16 positions, whose windows start at 16 places
    check_attention("float32", [33, 200, 17, 61], [33, 40, 1, 15], 2, group, 64, 16, num_sms=132, schedule=schedule,
                     seed=window + group, parts="single", window=window, variant=variant)  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_window_split_k_partitions_the_window_not_the_context(dtype_name: str, variant: str) -> None:
    """A 1500-key window over 2100- and 3000-token contexts: split-K cuts the window (six
    partitions of 256), and the blocks start mid-page (positions 600 and 1500)."""
    check_attention(dtype_name, [1, 17, 2100, 3000], [1, 1, 1, 1], 2, 4, 128, 16, num_sms=1000, schedule="warp-random",
                     parts="split", window=1500, variant=variant)  # fmt: skip


def test_window_planning_bounds_the_keys_by_the_window() -> None:
    assert visible_keys([1, 17, 3000], [1, 1, 1], None) == 3000
    assert visible_keys([1, 17, 3000], [1, 1, 1], 1500) == 1500
    assert visible_keys([10, 300], [10, 40], 50) == 89  # a chunk's last row sees 39 keys past its first's window
    assert visible_keys([10, 20], [10, 1], 5000) == 20
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive"):
        visible_keys([5], [1], 0)
    runtime = EmulatedRuntime()
    _, kc, vc, _, _, _, meta = _case(torch.float32, [1, 17, 3000], [1, 1, 1], 2, 4, 64, 16, 0)
    backend = CudaAttentionBackend(num_sms=1000, runtime=runtime, variant="v1")
    plan = backend.plan(meta, 16, 8, 2)
    assert plan.split_for(None) == SplitPlan(num_parts=12, part_tokens=256)
    assert plan.split_for(1500) == SplitPlan(num_parts=6, part_tokens=256)
    assert plan.split_for(300) == SplitPlan(num_parts=1, part_tokens=300)
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive"):
        backend.forward(torch.zeros(3, 8, 64), kc, vc, meta, 1.0, sliding_window=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("placeholder", [2**31 - 1, -1], ids=["int32-max", "minus-one"])
def test_window_never_reads_released_table_entries(placeholder: int, variant: str) -> None:
    """The core may put any id in the entries of released pages: a read of 2**31 - 1 would
    land about 2**45 bytes past the cache (a crash), -1 before it (ASan reports it)."""
    check_attention("bfloat16", [200, 1100, 61], [40, 1, 15], 2, 4, 128, 16, num_sms=132, schedule="warp-random",
                     window=50, placeholder=placeholder, variant=variant)  # fmt: skip
    check_attention("bfloat16", [1, 2100], [1, 1], 2, 4, 128, 16, num_sms=1000, schedule="forward", parts="split",
                     window=1100, placeholder=placeholder, variant=variant)  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("head", "block"), [(64, 8), (96, 32)])
def test_window_other_geometries(head: int, block: int, variant: str) -> None:
    for window in (block - 1, block, 3 * block + 1):
        check_attention("bfloat16", [1, 17, 300], [1, 1, 1], 2, 4, head, block, num_sms=1, schedule="forward",
                         seed=window, window=window, variant=variant)  # fmt: skip
        check_attention("float16", [40, 90, 70], [40, 3, 1], 1, 4, head, block, num_sms=132, schedule="warp-random",
                         seed=head + window, window=window, variant=variant)  # fmt: skip


@long_only
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head", HEAD_SIZES)
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_window_every_geometry(head: int, block: int, variant: str) -> None:
    check_attention("bfloat16", [1, 17, 1000, 2100], [1, 1, 1, 1], 2, 4, head, block, num_sms=1000, schedule="reverse",
                     seed=head + block, parts="split", window=1100, variant=variant)  # fmt: skip
    check_attention("float16", [40, 300, 90], [40, 7, 1], 1, 4, head, block, num_sms=132, schedule="warp-random",
                     seed=head, window=2 * block + 3, variant=variant)  # fmt: skip


# ---------------------------------------------------------------- cache writes and copies


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_write_kv_touches_exactly_the_slots(dtype_name: str) -> None:
    check_write_kv(dtype_name, "reverse")


def check_write_kv(dtype_name: str, schedule: str, files=None) -> None:
    dtype, _ = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(7)
    num_blocks, block, kv_heads, head, tokens = 9, 16, 4, 128, 37
    slots = torch.randperm(num_blocks * block - 1, generator=gen)[:tokens] + 1  # distinct, and 0 is set below
    slots[5] = -1  # padding: skipped
    slots[6] = 0  # the first slot is a slot like any other
    fused = torch.randn((tokens, 3 * kv_heads * head), generator=gen).to(dtype)  # strided views
    key = fused[:, : kv_heads * head].view(tokens, kv_heads, head)
    value = fused[:, kv_heads * head : 2 * kv_heads * head].view(tokens, kv_heads, head)
    kc = torch.full((num_blocks, block, kv_heads, head), float("nan"), dtype=dtype)
    vc = kc.clone()
    meta = _case(dtype, [1], [1], kv_heads, 1, head, block, 0)[-1]
    meta.slot_mapping = slots
    runtime = EmulatedRuntime(schedule=schedule, files=files)
    CudaAttentionBackend(runtime=runtime).write_kv(key, value, kc, vc, meta)
    assert [name for name, _, _ in runtime.launches] == [f"pagedrs::reshape_and_cache_kernel<{_CPP[dtype_name]}, {_CPP[dtype_name]}>"]
    flat_k, flat_v = kc.view(-1, kv_heads, head), vc.view(-1, kv_heads, head)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], key[keep])
    assert torch.equal(flat_v[slots[keep]], value[keep])
    untouched = torch.ones(num_blocks * block, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


_CPP = {"float32": "float", "bfloat16": "pagedrs::bf16_t", "float16": "pagedrs::half_t"}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_copy_blocks_all_layers_one_launch(schedule: str) -> None:
    check_copy_blocks(schedule)


def check_copy_blocks(schedule: str, files=None) -> None:
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn((3, 2, 12, 16, 2, 64), generator=gen).to(torch.bfloat16)
    pairs = torch.tensor([[0, 5], [7, 1], [7, 11], [2, 3]], dtype=torch.int64)
    want = cache.clone()
    TorchAttentionBackend().copy_blocks(want, pairs)
    runtime = EmulatedRuntime(schedule=schedule, files=files)
    CudaAttentionBackend(runtime=runtime).copy_blocks(cache, pairs)
    assert runtime.launches == [("pagedrs::copy_blocks_kernel", (4, 6, 1), (256, 1, 1))]
    assert torch.equal(cache, want)


def test_swap_round_trip_through_the_host_tier() -> None:
    """ops.swap_blocks' run merging and pitches, with the emulator's memcpy2D."""
    gen = torch.Generator().manual_seed(5)
    shape = (4, 2, 10, 16, 2, 128)  # [layers, K/V, blocks, block_size, kv_heads, head]
    device_cache = torch.randn(shape, generator=gen).to(torch.float16)
    host = torch.full((4, 2, 6, 16, 2, 128), float("nan"), dtype=torch.float16)
    back = torch.full(shape, float("nan"), dtype=torch.float16)
    out_pairs = torch.tensor([[2, 0], [3, 1], [4, 2], [9, 5], [0, 4]])  # runs (2..4 -> 0..2), singles
    backend = CudaAttentionBackend(runtime=EmulatedRuntime())
    backend.swap_blocks(device_cache, host, out_pairs)
    backend.swap_blocks(host, back, out_pairs[:, [1, 0]])
    idx = out_pairs[:, 0]
    assert torch.equal(back[:, :, idx], device_cache[:, :, idx])
    assert torch.equal(host[:, :, out_pairs[:, 1]], device_cache[:, :, idx])
    rest = torch.ones(10, dtype=torch.bool)
    rest[idx] = False
    assert back[:, :, rest].isnan().all()
    assert host[:, :, 3].isnan().all()


@long_only
def test_the_gpu_benchmark_script_runs_on_the_emulator() -> None:
    """benches/gpu_kernels.py --emulate: the GPU run is often one short lease; a script that
    breaks there wastes it. Both variants must agree with SDPA (the script's own check)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, str(root / "benches" / "gpu_kernels.py"), "--emulate"], capture_output=True,
                            text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root / "python")})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "v2 output equal to v1 and SDPA within bf16 rounding (max |diff| <= 0.02): PASS" in result.stdout
