"""The grid `pagedrs bench decode` sweeps; `pagedrs bench limits` times the same batch sizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    batch_sizes: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    new_tokens: int
    formats: tuple[str, ...]  # weight_dtype values


FULL_GRID = Grid((1, 16, 32, 64), (32, 128), 64, ("float32", "bfloat16", "int8", "int4", "q8_0", "gguf"))
QUICK_GRID = Grid((1, 16), (32,), 16, ("float32", "int8"))


def batch_sizes(quick: bool) -> tuple[int, ...]:
    return (QUICK_GRID if quick else FULL_GRID).batch_sizes
