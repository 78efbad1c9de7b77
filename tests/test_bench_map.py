"""`pagedrs bench map`: the grid makes the workloads it claims, both layouts get one pool, and
the paged and contiguous engines produce the same greedy tokens on a two-cell run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.map import MapModel, require_matplotlib, run_map
from pagedrs.bench.map_grid import FULL, QUICK, MapCell, MapGrid, cell_requests, equal_memory_pool, shared_prefix_len
from pagedrs.bench.model_spec import KVGeometry, kv_geometry

VOCAB = 512


@pytest.mark.parametrize("spread", [1, 2, 4, 10])
def test_spread_is_the_max_over_min_of_total_lengths(spread: float) -> None:
    grid = MapGrid((1, 8), (spread,), (0.0,), max_total_len=160)
    work = cell_requests(grid, MapCell(8, spread, 0.0), VOCAB)
    totals = [r.total_len for r in work.requests]
    assert max(totals) == 160 and min(totals) == 160 // spread
    assert work.summary()["spread_realised"] == spread
    assert len(work.requests) == grid.num_requests(MapCell(8, spread, 0.0)) == 16
    assert all(r.max_tokens >= 1 and len(r.prompt_token_ids) >= 1 for r in work.requests)
    if spread > 1:  # lengths in between, not only the two ends
        assert len(set(totals)) > 2


@pytest.mark.parametrize("share", [0.0, 0.5, 0.9])
def test_share_is_the_fraction_of_every_prompt_from_one_system_prompt(share: float) -> None:
    grid = MapGrid((16,), (1, 4), (share,), max_total_len=160)
    for spread in grid.spreads:
        work = cell_requests(grid, MapCell(16, spread, share), VOCAB)
        assert abs(work.summary()["share_realised"] - share) < 0.02
        for r, shared in zip(work.requests, work.shared_tokens):
            assert abs(shared - share * len(r.prompt_token_ids)) <= 0.5  # rounding only
        longest = max(work.requests, key=lambda r: len(r.prompt_token_ids))
        system = longest.prompt_token_ids[: max(work.shared_tokens)]
        for r, shared in zip(work.requests, work.shared_tokens):  # a prefix of the one system prompt
            assert r.prompt_token_ids[:shared] == system[:shared]
        # the common part is exactly the shortest system part (the own tokens differ after it)
        assert shared_prefix_len(work.requests) >= min(work.shared_tokens)
        if share == 0.0:
            assert shared_prefix_len(work.requests) == 0


def test_cells_are_seeded_and_independent_of_the_rest_of_the_grid() -> None:
    cell = MapCell(8, 4, 0.5)
    a = cell_requests(MapGrid((8,), (4,), (0.5,), 80), cell, VOCAB).requests
    b = cell_requests(MapGrid((1, 8, 32), (1, 4, 10), (0.0, 0.5), 80), cell, VOCAB).requests
    assert a == b
    other = cell_requests(MapGrid((8,), (4,), (0.5,), 80, seed=1), cell, VOCAB).requests
    assert other != a


def test_grid_rejects_impossible_axes() -> None:
    with pytest.raises(ValueError, match="shortest request"):
        MapGrid((1,), (10,), (0.0,), max_total_len=10)
    with pytest.raises(ValueError, match="shares"):
        MapGrid((1,), (1,), (1.0,), max_total_len=40)
    with pytest.raises(ValueError, match="spreads"):
        MapGrid((1,), (0.5,), (0.0,), max_total_len=40)
    assert QUICK.corners().cells() == [MapCell(c, s, f) for f in (0.0, 0.9) for s in (1, 10) for c in (1, 32)]
    assert {c.concurrency for c in FULL.cells()} >= {1, 64} and max(FULL.spreads) == 10 and max(FULL.shares) == 0.9


def test_equal_memory_pool_is_budget_seqs_reservations_of_max_model_len() -> None:
    geo = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4, vocab_size=VOCAB, context_len=2048)
    grid = MapGrid((1,), (1,), (0.0,), max_total_len=40, budget_seqs=4)
    pool = equal_memory_pool(grid, geo, block_size=16)
    assert pool.num_gpu_blocks == 4 * 3  # ceil(40 / 16) = 3 blocks per contiguous reservation
    assert geo.bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert pool.bytes == 12 * 16 * geo.bytes_per_token


def _cfg(**kw: object) -> BenchConfig:
    return BenchConfig(model="unused", quick=True, num_requests=None, out_dir=None, plot_dir=None, json_path=None,
                       block_size=4, **kw)  # type: ignore[arg-type]


def test_two_cells_paged_and_contiguous_agree_token_for_token(tiny_llama_dir: Path, tmp_path: Path, no_leaked_pages: list) -> None:
    grid = MapGrid((1, 8), (10,), (0.9,), max_total_len=30, requests_per_user=1)
    data = run_map(MapModel("tiny", str(tiny_llama_dir)), grid, _cfg())
    pool = data["kv_pool"]
    geo = kv_geometry(tiny_llama_dir, "float32")
    assert pool["num_gpu_blocks"] == 4 * 8 and pool["bytes"] == 32 * 4 * geo.bytes_per_token  # ceil(30 / 4) = 8
    # one pool for every engine, both layouts (the leak fixture records every engine built)
    layouts = sorted({e.args.kv_layout for e in no_leaked_pages})
    assert layouts == ["contiguous", "paged"]
    assert {e.stats()["num_gpu_blocks"] for e in no_leaked_pages} == {pool["num_gpu_blocks"]}
    assert [(c["concurrency"], c["spread"], c["share"]) for c in data["cells"]] == [(1, 10, 0.9), (8, 10, 0.9)]
    for cell in data["cells"]:
        n = cell["workload"]["num_requests"]
        assert cell["identical_outputs"] == n  # greedy: paging changes where KV lives, not the tokens
        for layout in ("paged", "contiguous"):
            assert cell[layout]["num_output_tokens"] == cell["workload"]["num_output_tokens"]
            assert cell[layout]["peak_concurrency"] <= cell["concurrency"]
        assert cell["contiguous"]["peak_concurrency"] <= pool["contiguous_reservations"]
        assert cell["contiguous"]["prefix_hit_blocks"] == 0
        assert cell["ratio"] == pytest.approx(cell["paged"]["tokens_per_s"] / cell["contiguous"]["tokens_per_s"])
    wide = data["cells"][1]
    # 10x spread: short requests take one page, so paged runs more than the 4 reservations at once
    assert wide["paged"]["peak_concurrency"] > wide["contiguous"]["peak_concurrency"] == 4
    assert wide["paged"]["prefix_hit_blocks"] > 0  # the system prompt's pages were shared

    pytest.importorskip("matplotlib")
    from pagedrs.bench.map_plot import plot_map

    (png,) = plot_map({"maps": [data]}, str(tmp_path))
    assert Path(png).name == "map-tiny.png" and Path(png).stat().st_size > 5_000


def test_missing_matplotlib_fails_before_the_run_and_names_no_plot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit, match="--no-plot"):
        require_matplotlib()
