"""The padded decode path: a decode-only step of S sequences runs as a batch of P >= S rows.

A CUDA graph replays fixed launches over fixed addresses, so a decode step that is to run
as a graph must look the same at every step of its size: P rows (a capture size from
``capture_sizes``), block tables ``table_width`` pages wide (the pool's most pages per
sequence), and inputs that live in the same preallocated buffers every step
(``StaticDecodeInputs``). The S real rows are copied in; the P - S padding rows are
decode tokens of one key at position 0 whose K/V slot and only page are the *scratch
page*, one device block the runner allocates past the scheduler's pool (its id is
``num_gpu_blocks``, which the Rust core never hands out), so a padding row never writes
or reads a real page. Their logits rows are dropped.

    rows      0 .. S-1: the step's decode tokens      S .. P-1: padding
    slot      step.slot_mapping                       scratch * block_size
    seq_len   step.seq_lens                           1
    table     step.block_tables, then scratch         scratch (every column)

Prefill and mixed steps, and decode steps wider than the largest capture size, run unpadded.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from pagedrs.attention.base import AttentionMetadata
from pagedrs.step_input import StepInput

# vLLM's default: no capture size above 512 rows; wider decode steps run eagerly.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """vLLM's capture list: 1, 2, 4, 8, then multiples of 8, up to the first size that holds
    ``max_num_seqs`` rows (so every decode step of the engine has a size), and at most ``limit``."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive int")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit={limit!r} must be a positive int")
    sizes: list[int] = []
    for size in (1, 2, 4, *range(8, limit + 8, 8)):
        if size > limit:
            break
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return tuple(sizes)


def padded_size(sizes: tuple[int, ...], num_seqs: int) -> int | None:
    """The smallest capture size holding ``num_seqs`` rows (``sizes`` ascending), or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class DecodePadding:
    """What the runner needs to pad decode steps."""

    sizes: tuple[int, ...]  # capture sizes, ascending
    table_width: int  # block-table columns of every padded step: ceil(max_model_len / block_size)

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"DecodePadding.sizes={self.sizes!r} must be positive, ascending and distinct")
        if self.table_width < 1:
            raise ValueError(f"DecodePadding.table_width={self.table_width!r} must be >= 1")


@dataclass(frozen=True)
class PaddedStep:
    """One padded decode step's inputs: views of the static device buffers (the same addresses at
    every step of this size)."""

    size: int  # P, the capture size
    num_real: int  # S, the rows whose logits are kept
    input_ids: torch.Tensor  # int64 [P]
    positions: torch.Tensor  # int64 [P]
    meta: AttentionMetadata  # tensors [P], [P + 1], [P, table_width]; host lists of this step


class StaticDecodeInputs:
    """The padded decode step's input buffers, allocated once for the largest capture size.

    Each step writes its rows into host buffers (pinned on CUDA) and copies the first P rows
    of each to the device in one copy per buffer, asynchronously; the next step waits for that
    copy before it writes the host buffers again. On the CPU the host buffers are the inputs.
    """

    def __init__(self, padding: DecodePadding, *, scratch_block: int, block_size: int, device: torch.device) -> None:
        self.padding = padding
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.device = device
        rows, width = padding.sizes[-1], padding.table_width
        pin = device.type == "cuda" and torch.cuda.is_available()

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, (host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device))

        self._host_ids, self.input_ids = pair((rows,), torch.int64)
        self._host_pos, self.positions = pair((rows,), torch.int64)
        self._host_slots, self.slot_mapping = pair((rows,), torch.int64)
        self._host_lens, self.seq_lens = pair((rows,), torch.int32)
        self._host_starts, self.query_start_loc = pair((rows + 1,), torch.int32)
        self._host_tables, self.block_tables = pair((rows, width), torch.int32)
        self._copied: torch.cuda.Event | None = None  # the last host-to-device copy (CUDA)
        self.fill_padding()

    def fill_padding(self) -> None:
        """Every row a padding row (and the device buffers too): a state any capture may start from."""
        self._host_ids.zero_()
        self._host_pos.zero_()
        self._host_slots.fill_(self.scratch_block * self.block_size)
        self._host_lens.fill_(1)
        self._host_starts.copy_(torch.arange(self._host_starts.shape[0], dtype=torch.int32))
        self._host_tables.fill_(self.scratch_block)
        self._to_device(self.padding.sizes[-1])

    def fill(self, step: StepInput, size: int) -> PaddedStep:
        """Writes a decode-only step's S rows and P - S padding rows, and returns the views of size P."""
        s, width = step.num_seqs, step.block_tables.shape[1]
        if step.num_tokens != s or not 0 < s <= size or size not in self.padding.sizes:
            raise ValueError(f"a padded decode step needs 1 token per sequence and a capture size >= {s}; got "
                             f"{step.num_tokens} tokens, {s} sequences, size {size} (sizes {self.padding.sizes})")
        if width > self.padding.table_width:
            raise ValueError(f"block tables of {width} columns exceed the padded width {self.padding.table_width}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffers
        scratch = self.scratch_block
        ids, pos, slots = self._host_ids.numpy(), self._host_pos.numpy(), self._host_slots.numpy()
        lens, tables = self._host_lens.numpy(), self._host_tables.numpy()
        ids[:s], pos[:s], slots[:s], lens[:s] = step.input_ids, step.positions, step.slot_mapping, step.seq_lens
        ids[s:size], pos[s:size], slots[s:size], lens[s:size] = 0, 0, scratch * self.block_size, 1
        # query_start_loc is 0..P for every padded step (one token a row): written once, in fill_padding
        tables[:s, :width] = step.block_tables
        tables[:s, width:] = scratch
        tables[s:size] = scratch
        self._to_device(size)
        return self.views(size, s)

    def padding_step(self, size: int) -> PaddedStep:
        """A step of ``size`` padding rows only (what a graph is captured on: it touches the scratch page only)."""
        if size not in self.padding.sizes:
            raise ValueError(f"size {size} is not a capture size {self.padding.sizes}")
        if self._copied is not None:
            self._copied.synchronize()
        self.fill_padding()
        return self.views(size, 0)

    def views(self, size: int, num_real: int) -> PaddedStep:
        """The first ``size`` rows of every buffer, as the forward pass reads them (host lists as written)."""
        lens = self._host_lens.numpy()[:size]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=int(lens.max()),
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=lens.tolist(),
        )
        return PaddedStep(size, num_real, self.input_ids[:size], self.positions[:size], meta)

    def _to_device(self, size: int) -> None:
        if self.device.type == "cpu":
            return
        for host, dev in ((self._host_ids, self.input_ids), (self._host_pos, self.positions),
                          (self._host_slots, self.slot_mapping), (self._host_lens, self.seq_lens),
                          (self._host_starts, self.query_start_loc), (self._host_tables, self.block_tables)):  # fmt: skip
            rows = size + 1 if host is self._host_starts else size
            dev[:rows].copy_(host[:rows], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
