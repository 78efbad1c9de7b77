"""The emulated kernel suite catches planted kernel bugs (tests/cuda_emu/mutations.py).

For each one-line mutation of the kernel sources (applied in memory), a battery of
the checks in test_kernels_emulated.py runs against the mutated kernels under each
schedule in turn; at least one check must fail, by a wrong or NaN
result or by an emulator error (divergence, deadlock). The unmutated battery
passes first, so a failure is the mutation's doing. Part of ``make test-kernels``.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from cuda_emu.build import SUPPORTED_MACHINE
from cuda_emu.mutations import MUTATIONS, Mutation, mutated_files
from cuda_emu.runtime import EmulationError
from pagedrs.kernels import sources
from test_fp8_kernels_emulated import check_fp8_attention, check_fp8_write_kv
from test_kernels_emulated import check_attention, check_copy_blocks, check_write_kv

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.skipif(os.environ.get("PAGEDRS_KERNELS_LONG") != "1", reason="mutation check: make test-kernels"),
    pytest.mark.skipif(not SUPPORTED_MACHINE, reason="the CUDA emulator runs on x86-64 only"),
]


def battery(files, schedule: str):
    """The checks, cheapest first; each raises on a wrong kernel."""
    yield partial(check_write_kv, "float16", schedule, files=files)
    yield partial(check_copy_blocks, schedule, files=files)
    for dtype in ("float32", "bfloat16"):
        attention = partial(check_attention, dtype, schedule=schedule, files=files)
        # single pass over several tiles, split-K + reduce, prefill chunks with GQA, a small head and block
        yield partial(attention, [1, 17, 300], [1, 1, 1], 2, 4, 128, 16, num_sms=1)
        yield partial(attention, [1, 17, 1100], [1, 1, 1], 2, 4, 128, 16, num_sms=1000, parts="split")
        yield partial(attention, [33, 200, 17, 61], [33, 40, 1, 15], 2, 4, 128, 16, num_sms=132, seed=4)
        yield partial(attention, [3, 40], [3, 1], 1, 1, 64, 8, num_sms=132)
        # sliding windows: decode under a page, prefill rows with 16 window starts, split-K over the window
        yield partial(attention, [1, 17, 300], [1, 1, 1], 2, 4, 128, 16, num_sms=1, window=5)
        yield partial(attention, [33, 200, 17, 61], [33, 40, 1, 15], 2, 1, 64, 16, num_sms=132, window=50)
        yield partial(attention, [1, 17, 2100], [1, 1, 1], 2, 4, 128, 16, num_sms=1000, parts="split", window=1500)
    for dtype in ("float32", "bfloat16"):
        v2 = partial(check_attention, dtype, schedule=schedule, files=files, variant="v2")
        # v2: decode over several chunks per warp; split-K with group 8 (two blocks per KV head);
        # group 3 (an absent row) in a step with prefill chunks (those by v1); windows
        yield partial(v2, [1, 17, 300], [1, 1, 1], 2, 4, 128, 16, num_sms=1)
        yield partial(v2, [1, 17, 1100], [1, 1, 1], 2, 8, 128, 16, num_sms=1000, parts="split")
        yield partial(v2, [33, 200, 17, 61], [33, 1, 1, 15], 2, 3, 64, 16, num_sms=132, seed=4)
        yield partial(v2, [1, 17, 300], [1, 1, 1], 2, 4, 128, 16, num_sms=1, window=5)
        yield partial(v2, [1, 17, 2100], [1, 1, 1], 2, 4, 128, 16, num_sms=1000, parts="split", window=1500)
        # the v2 kernel on prefill rows: per-row causal limits and window starts
        yield partial(check_attention, dtype, [33, 200, 17, 61], [33, 40, 1, 15], 2, 1, 64, 16, num_sms=132,
                      schedule=schedule, files=files, window=50, variant="v2-all")  # fmt: skip
    # an fp8 cache with scales that are not 1: both variants, split-K, and the quantizing write
    yield partial(check_fp8_write_kv, "e4m3", torch.bfloat16, schedule, files=files)
    for variant in ("v1", "v2"):
        yield partial(check_fp8_attention, "e4m3", torch.bfloat16, [1, 17, 1100], [1, 1, 1], 2, 4, 128, 16, 1000,
                      schedule, variant, parts="split", files=files)  # fmt: skip


def first_failure(files) -> str | None:
    for schedule in ("forward", "warp-random", "reverse"):
        for check in battery(files, schedule):
            try:
                check()
            except (AssertionError, EmulationError) as exc:
                return f"{schedule}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None


def test_the_unmutated_kernels_pass_the_battery():
    assert first_failure(sources.source_files()) is None


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_planted_bug_is_caught(mutation: Mutation):
    caught = first_failure(mutated_files(mutation))
    assert caught is not None, f"the suite passes with the bug {mutation.name!r} planted"
    print(f"{mutation.name}: {caught}")
