"""The host-side planning mirrors constants of the kernel source: read them from the source."""

from __future__ import annotations

import re
from pathlib import Path

from pagedrs.kernels import planning

SOURCE = (Path(__file__).resolve().parents[1] / "cuda" / "paged_attention.cu").read_text()


def _constexpr(name: str) -> int:
    match = re.search(rf"constexpr int {name} = (\d+);", SOURCE)
    assert match, f"{name} not found in cuda/paged_attention.cu"
    return int(match.group(1))


def test_planning_constants_equal_the_kernel_source():
    assert planning.MAX_ROWS == _constexpr("kMaxRows")
    assert planning.MAX_PARTS == _constexpr("kMaxParts")
    assert planning.TARGET_BLOCKS_PER_SM == _constexpr("kMinBlocksPerSm")
    assert planning.ROWS_V2 == planning.ROWS_PER_ITEM["v2"] == _constexpr("kRowsV2")
    assert planning.BLOCKS_PER_SM_V2 == _constexpr("kMinBlocksPerSmV2")
    assert planning.ROWS_PER_ITEM["v1"] == planning.MAX_ROWS
    # split-K parts must be whole kernel tiles: TILE is clamped to [16, 128] tokens in the source
    assert "clamp_int(pow2_floor(kTileBytes / (HEAD * static_cast<int>(sizeof(T)))), 16, 128)" in SOURCE
    assert planning.MIN_PART_TOKENS % 128 == 0


def test_the_runner_plans_attention_once_per_step_before_any_layer(tiny_llama_dir):
    from pagedrs import Engine, EngineArgs, SamplingParams
    from pagedrs.attention import TorchAttentionBackend

    class Counting(TorchAttentionBackend):
        plans = forwards = 0
        unplanned = 0

        def plan(self, meta, block_size, num_heads=0, num_kv_heads=0):
            Counting.plans += 1
            assert (num_heads, num_kv_heads) == (4, 2)  # the tiny llama's heads, as this rank holds them
            return super().plan(meta, block_size, num_heads, num_kv_heads)

        def forward(self, query, key_cache, value_cache, meta, scale):
            Counting.forwards += 1
            Counting.unplanned += meta.plan is None
            return super().forward(query, key_cache, value_cache, meta, scale)

    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=32, max_model_len=64),
                    attention_backend=Counting())
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert Counting.plans == steps and Counting.unplanned == 0
    assert Counting.forwards == steps * engine.loaded.config.num_hidden_layers
