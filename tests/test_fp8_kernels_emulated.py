"""The fp8 KV cache in the kernels of cuda/, executed on the CPU by the emulator (tests/cuda_emu).

sm_80 has no fp8 conversion instruction, so the kernels convert in integer code everywhere but
sm_89+ (cuda/dtype.cuh); this is the code the emulator runs. It is checked bit for bit against
torch's own float8 types (every one of the 256 codes when reading; a sweep of floats, ties and
the saturation edges when writing), and the attention kernels over an fp8 cache against the
float64 reference over the dequantized cache, with scales that are not 1 (a scale applied twice,
or not at all, or to the wrong tensor, fails). Caches are poisoned as in test_kernels_emulated:
the fp8 NaN code fills every slot the kernels must not read.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cuda_emu.build import SUPPORTED_MACHINE
from cuda_emu.runtime import EmulatedRuntime, load
from pagedrs.attention import TorchAttentionBackend
from pagedrs.attention.cuda_backend import CudaAttentionBackend
from pagedrs.kernels import loader, ops, sources
from pagedrs.kernels.dispatch import lookup
from pagedrs.kernels.planning import V1
from test_kernels_emulated import _case, _rel_err

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not SUPPORTED_MACHINE, reason="the CUDA emulator runs on x86-64 only")
CPU = torch.device("cpu")
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CPP = {"e4m3": "pagedrs::fp8_e4m3_t", "e5m2": "pagedrs::fp8_e5m2_t"}

CONVERT = r"""
#line 1 "convert_fp8.cu"
template <typename C>
__global__ void fp8_to_float(float* out, const C* in, long long n) {
  for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = pagedrs::to_float(in[i]);
}
template <typename C>
__global__ void float_to_fp8(C* out, const float* in, long long n) {
  for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = pagedrs::from_float<C>(in[i]);
}
"""


@pytest.fixture(scope="module")
def convert():
    names = tuple(f"{k}<{c}>" for c in CPP.values() for k in ("fp8_to_float", "float_to_fp8"))
    return load(names, unit=sources.headers()["dtype.cuh"] + CONVERT)


def _run(kernel, *args) -> None:
    EmulatedRuntime().launch(kernel, (1,), (256,), args, CPU)


def _reference_store(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """torch's conversion, saturated to the largest finite value as the kernels store (NaN stays NaN)."""
    top = torch.finfo(fp8).max
    return x.clamp(-top, top).to(fp8)


def _float_sweep(fp8: torch.dtype) -> torch.Tensor:
    """Every fp8 value, the exact midpoints between neighbours (ties) and one f32 ulp either side,
    random floats over the whole exponent range, and the edges: past the largest finite value,
    inf, NaN, half the smallest subnormal, signed zeros."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
    values = codes[codes.isfinite()].sort().values.unique()
    mids = (values[1:].double() + values[:-1].double()).div(2).float()
    ulp = lambda x, d: torch.nextafter(x, torch.full_like(x, d))  # noqa: E731
    top, tiny = torch.finfo(fp8).max, float(values[values > 0].min())
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), top, top * 1.03, top * 1.1, -top * 5,
                             3e38, tiny / 2, -tiny / 2, tiny * 0.51, tiny * 1.5, 1e-45])  # fmt: skip
    rng = np.random.default_rng(1)
    random = torch.from_numpy(rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32).copy())
    scaled = torch.from_numpy(rng.standard_normal(50_000).astype(np.float32)) * 20
    return torch.cat([values, mids, ulp(mids, float("inf")), ulp(mids, -float("inf")), specials, random, scaled])


@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_to_float_is_exact_for_every_code(convert, fmt: str) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256)
    _run(convert[f"fp8_to_float<{CPP[fmt]}>"], loader.ptr(out), loader.ptr(codes), loader.i64(256))
    want = codes.view(FP8[fmt]).float()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))  # -0.0 too


@pytest.mark.parametrize("fmt", list(FP8))
def test_float_to_fp8_rounds_to_nearest_even_and_saturates_like_torch(convert, fmt: str) -> None:
    x = _float_sweep(FP8[fmt])
    out = torch.empty(x.shape, dtype=torch.uint8)
    _run(convert[f"float_to_fp8<{CPP[fmt]}>"], loader.ptr(out), loader.ptr(x), loader.i64(x.numel()))
    want = _reference_store(x, FP8[fmt]).view(torch.uint8)
    nan = x.isnan()
    assert (out[nan] & 0x7F == 0x7F).all(), "NaN must stay NaN"
    mismatch = (out[~nan] != want[~nan]).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.numel()} mismatches, first: {x[~nan][mismatch[0]]}"
    assert not out.view(FP8[fmt]).float()[~nan].isinf().any(), "a finite store never becomes inf"


# ---------------------------------------------------------------- the cache write


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_kv_quantizes_exactly_the_slots(fmt: str, dtype: torch.dtype) -> None:
    check_fp8_write_kv(fmt, dtype, "reverse")


def check_fp8_write_kv(fmt: str, dtype: torch.dtype, schedule: str, files=None) -> None:
    """reshape_and_cache into an fp8 cache (outliers saturate, scales not 1) == torch's bytes, and
    the torch backend writes the same bytes; ``files`` replaces cuda/ (the mutation check)."""
    fp8 = FP8[fmt]
    gen = torch.Generator().manual_seed(11)
    num_blocks, block, kv_heads, head, tokens = 9, 16, 2, 64, 29
    slots = torch.randperm(num_blocks * block, generator=gen)[:tokens]
    slots[4] = -1  # padding: skipped
    fused = (torch.randn((tokens, 3 * kv_heads * head), generator=gen) * 30).to(dtype)  # outliers past 448 / 0.5
    key = fused[:, : kv_heads * head].view(tokens, kv_heads, head)
    value = fused[:, kv_heads * head : 2 * kv_heads * head].view(tokens, kv_heads, head)
    kc = torch.full((num_blocks, block, kv_heads, head), 0x7F, dtype=torch.uint8).view(fp8)  # NaN
    vc = kc.clone()
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([0.03125])
    runtime = EmulatedRuntime(schedule=schedule, files=files)
    ops.reshape_and_cache(key, value, kc, vc, slots, runtime, k_scale=k_scale, v_scale=v_scale)
    assert [n for n, _, _ in runtime.launches] == [f"pagedrs::reshape_and_cache_kernel<{_cpp(dtype)}, {CPP[fmt]}>"]
    keep = slots >= 0
    flat_k, flat_v = kc.view(torch.uint8).view(-1, kv_heads, head), vc.view(torch.uint8).view(-1, kv_heads, head)
    assert torch.equal(flat_k[slots[keep]], _reference_store(key[keep].float() / 0.5, fp8).view(torch.uint8))
    assert torch.equal(flat_v[slots[keep]], _reference_store(value[keep].float() / 0.03125, fp8).view(torch.uint8))
    untouched = torch.ones(num_blocks * block, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert (flat_k[untouched] == 0x7F).all() and (flat_v[untouched] == 0x7F).all()
    # and the torch backend writes the same bytes (the two backends share pages through the tiers)
    kt, vt = torch.zeros_like(kc), torch.zeros_like(vc)
    meta = _case(dtype, [1], [1], kv_heads, 1, head, block, 0)[-1]
    meta.slot_mapping = slots.clamp_min(0)
    TorchAttentionBackend(kv_scales=(k_scale, v_scale)).write_kv(key[keep], value[keep], kt, vt,
                                                                 dataclasses.replace(meta, slot_mapping=slots[keep]))
    assert torch.equal(kt.view(torch.uint8).view(-1, kv_heads, head)[slots[keep]], flat_k[slots[keep]])


def _cpp(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "pagedrs::bf16_t", torch.float16: "pagedrs::half_t"}[dtype]


def test_kernels_refuse_missing_or_misplaced_scales() -> None:
    kc = torch.zeros((2, 16, 1, 64), dtype=torch.float8_e4m3fn)
    key = torch.zeros((1, 1, 64), dtype=torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="k_scale of a float8_e4m3fn cache must be a float32 tensor of one element"):
        ops.reshape_and_cache(key, key, kc, kc.clone(), slots, EmulatedRuntime())
    bf = torch.zeros((2, 16, 1, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale/v_scale are for an fp8 cache; this cache is bfloat16"):
        ops.reshape_and_cache(key, key, bf, bf.clone(), slots, EmulatedRuntime(), k_scale=torch.ones(1),
                              v_scale=torch.ones(1))  # fmt: skip
    with pytest.raises(ValueError, match=r"dtype=float32, cache dtype=float8_e5m2.*with a cache in"):
        lookup(torch.float32, 64, 16, cache_dtype=torch.float8_e5m2)


# ---------------------------------------------------------------- attention over an fp8 cache


def check_fp8_attention(fmt, dtype, seq_lens, q_lens, kv_heads, group, head, block, num_sms, schedule, variant,
                        seed=0, window=None, parts=None, files=None):  # fmt: skip
    """The backend over an fp8 cache == the float64 reference over the dequantized cache, within the
    query dtype's rounding; poisoned slots hold the fp8 NaN code; ``files`` replaces cuda/."""
    fp8 = FP8[fmt]
    q, kc, vc, clean_k, clean_v, clean_tables, meta = _case(torch.float64, seq_lens, q_lens, kv_heads, group, head,
                                                            block, seed, window)  # fmt: skip
    q = q.to(dtype)
    ks, vs = (0.25, 2.0) if fmt == "e4m3" else (4.0, 0.125)
    k_scale, v_scale = torch.tensor([ks]), torch.tensor([vs])
    kq, vq = _reference_store(kc / ks, fp8), _reference_store(vc / vs, fp8)  # NaN where poisoned
    clean_kq, clean_vq = _reference_store(clean_k / ks, fp8), _reference_store(clean_v / vs, fp8)
    ref_meta = dataclasses.replace(meta, block_tables=clean_tables)
    scale = head**-0.5
    want = TorchAttentionBackend().forward(q.double(), clean_kq.double() * ks, clean_vq.double() * vs, ref_meta, scale,
                                           sliding_window=window)  # fmt: skip
    runtime = EmulatedRuntime(schedule=schedule, seed=seed, files=files)
    backend = CudaAttentionBackend(num_sms=num_sms, runtime=runtime, variant=variant, split_rule=V1,
                                   kv_scales=(k_scale, v_scale))  # V1: num_sms 1 = one pass, 1000 = split
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    got = backend.forward(q, kq, vq, meta, scale, sliding_window=window, out=out)
    split = meta.plan.split_for(window)
    if parts is not None:
        assert (split.num_parts > 1) == (parts == "split"), split
    assert not got.isnan().any(), f"output not fully written, or a poisoned page was read (split={split})"
    err = _rel_err(got, want)
    assert err <= 1e-2, f"rel err {err:.3g} ({fmt}, {dtype}, split={split}, {schedule}, {variant})"
    names = {n for n, _, _ in runtime.launches}
    assert all(f"{_cpp(dtype)}, {CPP[fmt]}, {head}, {block}>" in n for n in names if "paged_attention" in n), names
    # the scales matter: the same kernels without them are far off
    unit = CudaAttentionBackend(num_sms=num_sms, runtime=runtime, variant=variant, split_rule=V1)  # vLLM's default: scales 1.0
    plain = unit.forward(q, kq, vq, dataclasses.replace(meta, plan=None), scale, sliding_window=window)
    assert _rel_err(plain, want) > 0.1


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("num_sms", [1, 1000], ids=["single-pass", "split-k"])
def test_fp8_decode_matches_reference(fmt: str, num_sms: int, variant: str) -> None:
    check_fp8_attention(fmt, torch.bfloat16, [1, 17, 1100], [1, 1, 1], 2, 4, 128, 16, num_sms, "warp-random", variant,
                        parts="split" if num_sms == 1000 else "single")  # fmt: skip


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_prefill_chunks_and_decode_in_one_step(fmt: str, variant: str) -> None:
    check_fp8_attention(fmt, torch.float16, [33, 200, 17, 61], [33, 40, 1, 15], 2, 4, 64, 16, 132, "forward", variant,
                        seed=3, parts="single")  # fmt: skip


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize(("head", "block"), [(80, 8), (256, 32)])
def test_fp8_other_geometries_and_a_window(head: int, block: int, variant: str) -> None:
    check_fp8_attention("e4m3", torch.bfloat16, [1, 40, 300], [1, 40, 1], 1, 2, head, block, 132, "reverse", variant,
                        seed=head, window=3 * block + 1)  # fmt: skip


def test_fp8_copy_and_swap_move_the_bytes() -> None:
    """copy_blocks and the tier swaps are byte moves: an fp8 page arrives bit for bit."""
    gen = torch.Generator().manual_seed(2)
    cache = (torch.randn((2, 2, 8, 16, 1, 64), generator=gen) * 10).to(torch.float8_e5m2)
    want = cache.view(torch.uint8).clone()
    pairs = torch.tensor([[0, 5], [3, 1]])
    want[:, :, 5], want[:, :, 1] = want[:, :, 0].clone(), want[:, :, 3].clone()
    backend = CudaAttentionBackend(runtime=EmulatedRuntime())
    backend.copy_blocks(cache, pairs)
    assert torch.equal(cache.view(torch.uint8), want)
    host = torch.zeros((2, 2, 4, 16, 1, 64), dtype=torch.float8_e5m2)
    backend.swap_blocks(cache, host, torch.tensor([[5, 2], [6, 3]]))
    assert torch.equal(host.view(torch.uint8)[:, :, 2:4], cache.view(torch.uint8)[:, :, 5:7])
