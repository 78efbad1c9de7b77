"""CUDA graphs of the padded decode forward, one per capture size, and the check that they are exact.

A decode step is about 50 small kernels per layer; launched one by one from Python it is
bound by the host. Captured once per capture size (``padding.capture_sizes``) after
the KV pool is allocated (a graph bakes in the cache's addresses), it is one replay.

What a graph bakes in must not change between steps, and with the padded path it does not:
the inputs live in ``StaticDecodeInputs``' buffers, the block tables are ``table_width`` wide,
and the attention backend plans the launch by the capture size alone
(``AttentionBackend.plan_padded_decode``: fixed grid, fixed split, static split-K buffers).

Order at start-up: the pool is sized with ``graph_headroom_bytes`` left over, the runner
allocates it (and the scratch page), then ``DecodeGraphs.capture`` captures the sizes from
the largest down, into one shared memory pool. A size whose capture runs out of memory is
dropped and logged (smaller ones are still tried). Then ``validate`` replays each graph on a
test batch over real pages and compares its logits with the eager padded forward of the same
batch bit for bit; any difference turns graphs off, with a warning naming the size. Never wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedrs.decode_graphs.padding import PaddedStep, StaticDecodeInputs
from pagedrs.kernels.planning import MAX_PARTS, MIN_PART_TOKENS
from pagedrs.models.config import ModelConfig
from pagedrs.step_input import StepInput

logger = logging.getLogger("pagedrs.engine")

_FIXED_HEADROOM = 256 * 2**20  # cuBLAS workspaces and the graphs' own bookkeeping


def graph_headroom_bytes(config: ModelConfig, max_size: int, itemsize: int, max_keys: int) -> int:
    """Device memory to leave outside the KV pool for the graphs' shared pool: twice the largest
    capture's activations (the residual stream, fused QKV and gate/up outputs, logits in the model's
    dtype and in float32) and split-K partials, plus a fixed allowance. An estimate on the safe side:
    a capture that still runs out of memory is dropped, never fatal."""
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_row = (6 * config.hidden_size + 4 * config.intermediate_size + 2 * (heads + 2 * kv) * d) * itemsize
    per_row += config.vocab_size * (4 + itemsize)
    parts = min(MAX_PARTS, max(1, -(-max_keys // MIN_PART_TOKENS)))
    per_row += 2 * heads * parts * (d + 2) * 4
    return 2 * max_size * per_row + _FIXED_HEADROOM


class DecodeGraphs:
    """The captured graphs of one runner, by capture size, and their static logits."""

    def __init__(self, static: StaticDecodeInputs, forward: Callable[[PaddedStep], torch.Tensor]) -> None:
        self.static = static
        self._forward = forward  # the eager padded forward: logits [P, vocab] (ModelRunner.padded_forward)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # size -> (torch.cuda.CUDAGraph, its logits)
        self.dropped: list[int] = []  # sizes whose capture ran out of memory
        self.failed: int | None = None  # the size whose capture failed otherwise (then no graph is kept)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def capture(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Captures every size, largest first, into one memory pool; returns the sizes captured.
        A size that runs out of memory is dropped (and logged); the smaller ones are still tried."""
        pool = self._new_pool()
        for size in sorted(sizes, reverse=True):
            try:
                self._graphs[size] = self._capture_one(size, pool)
            except Exception as exc:  # noqa: BLE001 - a failed capture costs speed, never the engine
                if not _out_of_memory(exc):
                    logger.warning("CUDA graphs: capturing decode batch size %d failed (%s: %s); CUDA graphs are off",
                                   size, type(exc).__name__, exc)  # fmt: skip
                    self._graphs.clear()
                    self.failed = size
                    break
                self.dropped.append(size)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        if self.dropped:
            logger.warning("CUDA graphs: out of memory capturing decode batch sizes %s; they run eagerly (captured: %s)",
                           sorted(self.dropped), list(self.sizes))  # fmt: skip
        _synchronize()
        return self.sizes

    def _new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def _capture_one(self, size: int, pool: Any) -> tuple[Any, torch.Tensor]:
        """(graph, its logits [size, vocab]) of the padded forward of ``size`` padding rows."""
        step = self.static.padding_step(size)
        for _ in range(2):  # compiles the kernels and sets up cuBLAS before capture
            self._forward(step)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._forward(step)
        return graph, out

    def replay(self, step: PaddedStep) -> torch.Tensor:
        """Logits [P, vocab] of a step ``StaticDecodeInputs.fill`` wrote: the graph's own output
        tensor, overwritten by the next replay of this size."""
        graph, out = self._graphs[step.size]
        graph.replay()
        return out

    def validate(self, kv_cache: torch.Tensor, num_blocks: int, vocab_size: int, seed: int = 0) -> int | None:
        """Replays each graph on a test batch and compares with the eager padded forward, bit for bit.

        The batch reads real pages (filled with random values for the test and zeroed after: the
        pool is empty at start-up, and a page is always written before it is read) at contexts
        up to the table width, so split-K is exercised; every row writes its K/V to the scratch
        page. Returns the first size that differs (and drops every graph), or None."""
        bs, width = self.static.block_size, self.static.padding.table_width
        pages = min(width, num_blocks)
        gen = torch.Generator().manual_seed(seed)
        view = kv_cache[:, :, :pages]
        view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
        try:
            for size in self.sizes:
                step = validation_step(size, pages, bs, vocab_size, self.static.scratch_block, seed + size)
                padded = self.static.fill(step, size)
                want = self._forward(padded).clone()
                got = self.replay(self.static.fill(step, size))
                if not torch.equal(got, want):
                    logger.warning("CUDA graphs: the graph of decode batch size %d differs from the eager forward "
                                   "(max |diff| %.3g); CUDA graphs are off", size, float((got - want).abs().max()))  # fmt: skip
                    self._graphs.clear()
                    return size
        finally:
            view.zero_()
            self.static.fill_padding()
            _synchronize()
        return None


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation failure, also when it surfaces as the RuntimeError of an invalidated capture."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def validation_step(size: int, pages: int, block_size: int, vocab_size: int, scratch_block: int, seed: int) -> StepInput:
    """A decode step of ``size`` rows over pages 0 .. pages-1 (shared, read only) at contexts from 1
    to ``pages * block_size``; every row's new K/V goes to the scratch page."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, pages * block_size + 1, size=size).astype(np.int32)
    lens[0] = pages * block_size  # the longest context: every split-K partition has keys
    tables = (np.arange(pages, dtype=np.int32)[None, :] + np.arange(size, dtype=np.int32)[:, None]) % pages
    return StepInput(
        input_ids=rng.integers(0, vocab_size, size=size).astype(np.int64),
        positions=(lens - 1).astype(np.int64),
        slot_mapping=np.full(size, scratch_block * block_size, dtype=np.int64),
        query_start_loc=np.arange(size + 1, dtype=np.int32),
        seq_lens=lens,
        block_tables=tables,
    )
