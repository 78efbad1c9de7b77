"""The machine line every benchmark prints: its last-level cache read from sysfs."""

from __future__ import annotations

from pathlib import Path

from pagedrs.bench.machine import describe_machine, last_level_cache


def _cache(root: Path, name: str, level: str, size: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "level").write_text(level + "\n")
    (root / name / "size").write_text(size + "\n")


def test_the_largest_level_is_the_last_level_cache(tmp_path: Path) -> None:
    _cache(tmp_path, "index0", "1", "48K")
    _cache(tmp_path, "index2", "2", "2048K")
    _cache(tmp_path, "index3", "3", "480M")
    _cache(tmp_path, "index4", "x", "1G")  # unreadable level: skipped
    (tmp_path / "uevent").write_text("")  # not a cache entry
    assert last_level_cache(str(tmp_path)) == (3, 480 << 20)


def test_no_cache_listed_is_unknown(tmp_path: Path) -> None:
    assert last_level_cache(str(tmp_path / "missing")) == (0, 0)
    _cache(tmp_path, "index0", "1", "lots")  # a size that is not a number
    assert last_level_cache(str(tmp_path)) == (0, 0)
    _cache(tmp_path, "index1", "2", "1M")
    (tmp_path / "index1" / "size").write_bytes(b"\xff\xfe1M")  # not UTF-8: skipped, not raised
    assert last_level_cache(str(tmp_path)) == (0, 0)


def test_the_machine_line_names_the_cache() -> None:
    line = describe_machine().describe()
    level, size = last_level_cache()
    assert (f"L{level} " in line) if size else ("cache unknown" in line)
