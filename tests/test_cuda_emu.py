"""The CUDA emulator itself (tests/cuda_emu): its rules, its schedules, its conversions, its launcher.

The kernel tests (test_kernels_emulated.py) are only as good as the emulator: these
tests show that it catches what it claims to catch (divergent barriers and shuffles,
partial masks, deadlocks, a missing barrier under some schedule, unwritten shared
memory), computes what CUDA computes (shuffle semantics, f16/bf16 conversions bit
for bit), and refuses launches whose arguments do not match the C++ signature.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from cuda_emu.build import SUPPORTED_MACHINE, compile_check, sanitize
from cuda_emu.runtime import SCHEDULES, EmulatedRuntime, EmulationError, load
from pagedrs.kernels import loader, lookup, sources

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not SUPPORTED_MACHINE, reason="the CUDA emulator runs on x86-64 only")

TOY = r"""
#line 1 "toy.cu"
__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 64) __syncthreads();
  out[threadIdx.x] = 1.f;
}
__global__ void two_barriers(float* out) {
  if (threadIdx.x < 64) {
    __syncthreads();
  } else {
    __syncthreads();
  }
}
__global__ void divergent_shuffle(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
__global__ void partial_mask(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, 1.f, 1);
}
__global__ void shuffles(int* out, int delta, int width) {
  const int t = threadIdx.x, n = blockDim.x;
  out[t] = __shfl_xor_sync(0xffffffffu, t, delta, width);
  out[n + t] = __shfl_down_sync(0xffffffffu, t, delta, width);
  out[2 * n + t] = __shfl_up_sync(0xffffffffu, t, delta, width);
  out[3 * n + t] = __shfl_sync(0xffffffffu, t, delta, width);
}
// Reads its left neighbour's shared value with (fixed) or without (racy) a barrier.
__global__ void neighbour(float* out, int fixed) {
  __shared__ float s[128];
  s[threadIdx.x] = threadIdx.x;
  if (fixed) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = threadIdx.x > 0 ? s[threadIdx.x - 1] : 0.f;
}
// Block 1 reads what block 0 wrote into shared memory: must be poison, not leftovers.
__global__ void read_before_write(float* out) {
  __shared__ float s[128];
  if (blockIdx.x == 0) s[threadIdx.x] = 7.f;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
}
__global__ void signature(float* a, int i, long long l, float f) {}
"""
CONVERT = r"""
#line 1 "convert.cu"
__global__ void half_to_float(float* out, const pagedrs::half_t* in, long long n) {
  for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = pagedrs::to_float(in[i]);
}
__global__ void float_to_half(pagedrs::half_t* out, const float* in, long long n) {
  for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = pagedrs::from_float<pagedrs::half_t>(in[i]);
}
__global__ void bf16_to_float(float* out, const pagedrs::bf16_t* in, long long n) {
  for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = pagedrs::to_float(in[i]);
}
__global__ void float_to_bf16(pagedrs::bf16_t* out, const float* in, long long n) {
  for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = pagedrs::from_float<pagedrs::bf16_t>(in[i]);
}
"""
TOY_KERNELS = ("divergent_barrier", "two_barriers", "divergent_shuffle", "partial_mask", "shuffles", "neighbour",
               "read_before_write", "signature")  # fmt: skip
CONVERT_KERNELS = ("half_to_float", "float_to_half", "bf16_to_float", "float_to_bf16")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def toy():
    return load(TOY_KERNELS, unit=TOY)


@pytest.fixture(scope="module")
def convert():
    return load(CONVERT_KERNELS, unit=sources.headers()["dtype.cuh"] + CONVERT)


def _run(kernel, grid, block, *args, schedule="forward"):
    """Launches with raw pointers: the caller keeps every tensor alive (ASan checks that it does)."""
    EmulatedRuntime(schedule=schedule).launch(kernel, grid, block, args, CPU)


# ---------------------------------------------------------------- strict rules


def test_a_barrier_some_threads_skip_is_reported_with_where_everyone_is(toy):
    out = torch.zeros(128)
    with pytest.raises(EmulationError) as err:
        _run(toy["divergent_barrier"], (1,), (128,), loader.ptr(out))
    msg = str(err.value)
    assert "divergent __syncthreads (some threads exited" in msg
    assert "threads 0-63: __syncthreads at toy.cu:2; threads 64-127: exited" in msg
    assert msg.startswith("divergent_barrier, block (0, 0, 0)")


def test_two_different_barriers_do_not_release_each_other(toy):
    out = torch.zeros(128)
    with pytest.raises(EmulationError, match=r"different barriers.*toy.cu:7.*toy.cu:9"):
        _run(toy["two_barriers"], (1,), (128,), loader.ptr(out))


def test_a_shuffle_half_a_warp_skips_is_a_deadlock(toy):
    out = torch.zeros(64)
    with pytest.raises(EmulationError, match=r"deadlock: divergent warp shuffle.*threads 0-15: __shfl_xor_sync at toy.cu:14; threads 16-31: exited"):
        _run(toy["divergent_shuffle"], (1,), (64,), loader.ptr(out))


def test_a_partial_mask_is_refused(toy):
    out = torch.zeros(32)
    with pytest.raises(EmulationError, match=r"partial shuffle mask 0x0000ffff .* toy.cu:18"):
        _run(toy["partial_mask"], (1,), (32,), loader.ptr(out))


@pytest.mark.parametrize(("delta", "width"), [(1, 32), (5, 32), (3, 8), (17, 16)])
def test_shuffles_compute_what_cuda_documents(toy, delta: int, width: int):
    n = 64
    out = torch.zeros(4 * n, dtype=torch.int32)
    _run(toy["shuffles"], (1,), (n,), loader.ptr(out), loader.i32(delta), loader.i32(width))
    lanes = np.arange(n)
    lane, base = lanes % 32, lanes - lanes % 32
    group = lane & ~(width - 1)
    xor = lane ^ delta
    want_xor = np.where(xor >= group + width, lane, xor) + base  # a later group: the caller's own value
    down = lane + delta
    want_down = np.where(down >= group + width, lane, down) + base
    up = lane - delta
    want_up = np.where(up < group, lane, up) + base
    want_idx = group + delta % width + base
    got = out.view(4, n).numpy()
    assert got[0].tolist() == want_xor.tolist()
    assert got[1].tolist() == want_down.tolist()
    assert got[2].tolist() == want_up.tolist()
    assert got[3].tolist() == want_idx.tolist()


# ---------------------------------------------------------------- schedules and shared memory


def test_a_missing_barrier_shows_under_the_reverse_schedule_only(toy):
    """Forward order happens to write each value before its reader runs; reverse does not."""
    results = {}
    for schedule in SCHEDULES:
        for fixed in (0, 1):
            out = torch.full((128,), -1.0)
            _run(toy["neighbour"], (1,), (128,), loader.ptr(out), loader.i32(fixed), schedule=schedule)
            results[schedule, fixed] = out
    want = torch.cat([torch.zeros(1), torch.arange(127.0)])
    for schedule in SCHEDULES:
        assert torch.equal(results[schedule, 1], want), schedule
    assert torch.equal(results["forward", 0], want)
    assert results["reverse", 0][1:].isnan().all()


def test_warp_random_schedule_depends_on_the_seed(toy):
    """Warps run whole, in a seeded order: lane 0 of a warp sees its left neighbour only if that warp ran first."""
    seen = set()
    for seed in range(6):
        out = torch.full((128,), -1.0)
        EmulatedRuntime(schedule="warp-random", seed=seed).launch(
            toy["neighbour"], (1,), (128,), (loader.ptr(out), loader.i32(0)), CPU
        )
        seen.add(tuple(bool(out[w * 32].isnan()) for w in range(1, 4)))
    assert len(seen) > 1


def test_shared_memory_is_poisoned_before_every_block(toy):
    out = torch.zeros(2 * 128)
    _run(toy["read_before_write"], (2,), (128,), loader.ptr(out))
    assert (out[:128] == 7).all()
    assert out[128:].isnan().all()


# ---------------------------------------------------------------- launcher


def test_arguments_are_checked_against_the_cpp_signature(toy):
    fn = toy["signature"]
    assert fn.params == (("p", 8), ("i", 4), ("i", 8), ("f", 4))
    a = torch.zeros(4)
    ok = (loader.ptr(a), loader.i32(1), loader.i64(2), loader.f32(3.0))
    _run(fn, (1,), (32,), *ok)
    with pytest.raises(TypeError, match=r"argument 1 is int64 2; the C\+\+ parameter is a 4-byte signed int, which takes np.int32"):
        _run(fn, (1,), (32,), ok[0], loader.i64(2), *ok[2:])
    with pytest.raises(TypeError, match=r"argument 3 is float 3.0; .* 4-byte float, which takes np.float32"):
        _run(fn, (1,), (32,), *ok[:3], 3.0)
    with pytest.raises(TypeError, match="takes 4 arguments, got 3"):
        _run(fn, (1,), (32,), *ok[:3])
    with pytest.raises(ValueError, match="argument 0 is a null pointer"):
        _run(fn, (1,), (32,), np.uint64(0), *ok[1:])
    with pytest.raises(ValueError, match="exceeds CUDA's limits"):
        _run(fn, (1,), (2048,), *ok)


def test_the_runtime_names_what_it_expected():
    with pytest.raises(ValueError, match=r"schedule='backwards'; expected one of \['forward', 'reverse', 'warp-random'\]"):
        EmulatedRuntime(schedule="backwards")
    entry = lookup("float32", 64, 16)
    with pytest.raises(ValueError, match="is not one of"):
        EmulatedRuntime().kernel(entry, lookup("float16", 64, 16).attention, CPU)


# ---------------------------------------------------------------- conversions (dtype.cuh's portable path)


def _f32(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.float32).copy())


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal, except that any NaN matches any NaN (payloads differ between implementations)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    g, w = got[~nan], want[~nan]
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[got.dtype]
    mismatch = (g.view(bits) != w.view(bits)).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.numel()} mismatches, first: {w[mismatch[0]]} -> {g[mismatch[0]]}"


def _float_sweep() -> torch.Tensor:
    """Every f16 value, the exact midpoints between neighbours and one f32 ulp either side, random
    floats over the whole exponent range, and the special values."""
    rng = np.random.default_rng(0)
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    halves = halves[halves.isfinite()].sort().values.unique()
    mids = (halves[1:].double() + halves[:-1].double()).div(2).float()
    ulp = lambda x, d: torch.nextafter(x, torch.full_like(x, d))  # noqa: E731
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.99, 65520.0,
                             3.4e38, 1e-45, -1e-45, 2.0**-25, 2.0**-24, 3 * 2.0**-26])  # fmt: skip
    random_bits = _f32(rng.integers(0, 2**32, 200_000, dtype=np.uint64))
    ties = _f32((rng.integers(0, 2**16, 20_000, dtype=np.uint64) << 16) | 0x8000)  # bf16 ties
    return torch.cat([halves, mids, ulp(mids, float("inf")), ulp(mids, -float("inf")), specials, random_bits, ties])


def test_half_to_float_is_exact_for_every_bit_pattern(convert):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    out = torch.empty(2**16)
    _run(convert["half_to_float"], (1,), (256,), loader.ptr(out), loader.ptr(bits), loader.i64(2**16))
    _same(out, bits.view(torch.float16).float())


def test_bf16_to_float_is_exact_for_every_bit_pattern(convert):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    out = torch.empty(2**16)
    _run(convert["bf16_to_float"], (1,), (256,), loader.ptr(out), loader.ptr(bits), loader.i64(2**16))
    _same(out, bits.view(torch.bfloat16).float())


@pytest.mark.parametrize(("kernel", "dtype"), [("float_to_half", torch.float16), ("float_to_bf16", torch.bfloat16)])
def test_float_to_16_bits_rounds_to_nearest_even_like_torch(convert, kernel: str, dtype: torch.dtype):
    x = _float_sweep()
    out = torch.empty(x.shape, dtype=dtype)
    _run(convert[kernel], (1,), (256,), loader.ptr(out), loader.ptr(x), loader.i64(x.numel()))
    _same(out, x.to(dtype))


# ---------------------------------------------------------------- the translation unit's #line directives


def _broken_unit() -> tuple[str, int]:
    """cuda/ with an undeclared name right after paged_attention.cu's #include; returns (unit, its line)."""
    files = sources.source_files()
    lines = files["paged_attention.cu"].split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith('#include "dtype.cuh"'))
    lines.insert(at + 1, "int pagedrs_line_probe = undeclared_probe_name;")
    files["paged_attention.cu"] = "\n".join(lines)
    return sources.translation_unit(files), at + 2


def test_every_line_of_the_translation_unit_maps_back_to_its_source_line():
    """Follows the #line directives as a preprocessor does: each line is the line it claims to be."""
    files = sources.source_files()
    file, line, checked = "", 0, 0
    for text in sources.translation_unit().split("\n"):
        if m := re.fullmatch(r'#line (\d+) "([^"]+)"', text):
            file, line = m.group(2), int(m.group(1))
            continue
        original = files[file].split("\n")
        assert text == (original[line - 1] if line <= len(original) else ""), f"{file}:{line}"
        line += 1
        checked += 1
    assert checked >= sum(len(t.split("\n")) for t in files.values())


def test_gcc_reports_the_kernel_file_and_line_after_an_inlined_header():
    unit, line = _broken_unit()
    result = compile_check('#include "cuda_emu.h"\n' + unit)
    assert result.returncode != 0
    assert re.search(rf"paged_attention\.cu:{line}:\d+: error: .undeclared_probe_name. was not declared", result.stderr), result.stderr


def test_nvrtc_reports_the_kernel_file_and_line_after_an_inlined_header():
    from pagedrs.kernels import nvrtc

    unit, line = _broken_unit()
    result = nvrtc.compile_source(unit, "pagedrs_kernels.cu", {}, [], [*sources.BASE_OPTIONS, "--gpu-architecture=compute_80"])
    assert not result.ok
    assert re.search(rf'paged_attention\.cu\({line}\): error: identifier "undeclared_probe_name" is undefined', result.log), result.log


def test_nvrtc_compiles_the_portable_conversions_too():
    """The C++ path the emulator runs is valid CUDA as well (-DPAGEDRS_PORTABLE_CONVERSIONS)."""
    from pagedrs.kernels import nvrtc

    entry = lookup("float16", 64, 16)
    options = [*sources.BASE_OPTIONS, "--gpu-architecture=compute_80", "-DPAGEDRS_PORTABLE_CONVERSIONS"]
    result = nvrtc.compile_source(sources.translation_unit(), "pagedrs_kernels.cu", {}, [entry.attention, entry.reduce], options)
    assert result.ok, result.log
    assert "cvt.rn.f16.f32" in result.ptx or "cvt" in result.ptx


# ---------------------------------------------------------------- AddressSanitizer (make test-kernels-asan)

OOB = r"""
#line 1 "oob.cu"
__global__ void read_past_the_end(float* out, const float* in) {
  out[threadIdx.x] = in[threadIdx.x + 1];
}
"""


@pytest.mark.skipif(not sanitize(), reason="needs the ASan build: make test-kernels-asan")
def test_asan_build_reports_a_read_past_a_tensor(tmp_path):
    """In a child process (ASan aborts it): one element past a torch tensor is a heap-buffer-overflow."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "oob.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from cuda_emu.runtime import EmulatedRuntime, load\n"
        "from pagedrs.kernels import loader\n"
        f"fn = load(('read_past_the_end',), unit={OOB!r})['read_past_the_end']\n"
        "out, src = torch.zeros(64), torch.zeros(64)\n"
        "EmulatedRuntime().launch(fn, (1,), (64,), (loader.ptr(out), loader.ptr(src)), torch.device('cpu'))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "heap-buffer-overflow" in result.stderr and "oob.cu:2" in result.stderr, result.stderr[-3000:]
