"""ModelRunner: executes one scheduled step (block copies, then the forward pass) and returns logits.

It owns the KV tensors and never decides anything about memory: which block
holds what, what to copy and what to swap all come in the ``StepInput``.

KV layout: the model's (``KvModel.kv_cache_shape``; see ``pagedrs.attention.base``), one
tensor per memory tier, ``[num_layers, 2, num_blocks, block_size, kv_heads_per_rank, head_dim]``,
so that a copy or a swap of a block across every layer and both K and V is a single
indexed copy along dim 2. The disk tier, when there is one, is a ``DiskTier``
(pagedrs.kv_tiers) that gathers and scatters the same slices to a page store.

With ``padding`` (pagedrs.decode_graphs) the device tier has one block more than
the scheduler's ``num_gpu_blocks``: the scratch page (id ``num_gpu_blocks``) that padding rows
of a padded decode step write and read; decode-only steps then run padded to a capture size,
through a CUDA graph of that size when ``capture_graphs`` captured one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedrs import huge_pages
from pagedrs.attention import AttentionBackend, AttentionMetadata, get_backend
from pagedrs.decode_graphs import DecodeGraphs, DecodePadding, PaddedStep, StaticDecodeInputs, padded_size
from pagedrs.kv_tiers.disk_tier import DiskTier
from pagedrs.models.interface import KvModel
from pagedrs.models.loader import LoadedModel
from pagedrs.step_input import StepInput, Transfer

if TYPE_CHECKING:  # (executor/ imports this module: no cycle at run time)
    from pagedrs.executor.token_fill import DeviceFill


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        backend: AttentionBackend | None = None,
        kv_cache_dtype: torch.dtype | None = None,  # what pages are stored in; None: the model dtype
        padding: DecodePadding | None = None,  # pad decode-only steps (and reserve the scratch page)
    ) -> None:
        if num_gpu_blocks < 1 or num_cpu_blocks < 0 or block_size < 1:
            raise ValueError(
                f"ModelRunner needs num_gpu_blocks >= 1, num_cpu_blocks >= 0, block_size >= 1; got "
                f"num_gpu_blocks={num_gpu_blocks}, num_cpu_blocks={num_cpu_blocks}, block_size={block_size}"
            )
        self.loaded = loaded
        self.model: KvModel = loaded.model
        # fixed once loaded; read every step (each is a walk through nn.Module attribute lookups)
        self._heads = (self.model.heads_per_rank, self.model.kv_heads_per_rank)
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = block_size
        self.kv_dtype = kv_cache_dtype if kv_cache_dtype is not None else self.dtype
        self.backend = backend if backend is not None else get_backend(
            self.device, dtype=self.dtype, head_size=self.config.head_dim, block_size=block_size,
            kv_cache_dtype=self.kv_dtype,
        )
        self.backend.check_model(self.config)
        self.backend.check_kv_cache_dtype(self.kv_dtype, self.dtype)
        self.padding = padding
        scratch = 1 if padding is not None else 0  # the scratch page, past the scheduler's blocks
        kv_shape = self.model.kv_cache_shape(num_gpu_blocks + scratch, block_size)
        # on the CPU the step streams these pages from memory: in 2 MiB pages (pagedrs/huge_pages.py)
        if self.device.type == "cpu":
            try:
                self.kv_cache = huge_pages.zeros(kv_shape, self.kv_dtype)
            except MemoryError as exc:  # the pool is a mapping made at once: a size the host can never hold
                raise ValueError(f"num_gpu_blocks / kv_cache_memory: the KV pool of {num_gpu_blocks} blocks of "
                                 f"{block_size} tokens cannot be allocated in host memory ({exc}); ask for a "
                                 "smaller pool") from None
        else:
            self.kv_cache = torch.zeros(kv_shape, dtype=self.kv_dtype, device=self.device)
        self.cpu_cache = torch.zeros(
            self.model.kv_cache_shape(num_cpu_blocks, block_size),
            dtype=self.kv_dtype,
            device="cpu",
            pin_memory=self.device.type == "cuda" and torch.cuda.is_available(),
        )
        # each layer's (key, value) views, made once: the forward pass would otherwise make 60 views a step
        self.kv_views = self.model.kv_layer_views(self.kv_cache)
        self.disk: DiskTier | None = None  # set by the executor when a disk tier is on
        self.num_gpu_blocks = num_gpu_blocks  # the scheduler's; the scratch page, when there is one, is this id
        self.static: StaticDecodeInputs | None = None
        if padding is not None:
            self.static = StaticDecodeInputs(padding, scratch_block=num_gpu_blocks, block_size=block_size,
                                             device=self.device)  # fmt: skip
        self.graphs: DecodeGraphs | None = None  # set by capture_graphs

    @torch.inference_mode()
    def execute(self, step: StepInput, compute_logits: bool = True, fill: DeviceFill | None = None,
                transfers_done: list[int] | None = None) -> torch.Tensor:
        """float32 logits [S + E, vocab]: row i for the last new token of scheduled sequence i, then
        one row per token row in ``step.logit_rows`` (E of them; a decode-only step has none).

        ``compute_logits=False`` (tensor-parallel workers: rank 0 samples) skips the output
        head and returns an empty tensor. ``fill``: input ids still on the device (asynchronous
        scheduling), written into the step's device ids before the forward reads them.
        ``transfers_done``: gets each of the step's transfers' ids as its copy finishes (``run_transfers``)."""
        # block movement first, in the plan's order: swap-outs free blocks others may reuse now
        self.run_transfers(step.transfers, transfers_done)
        if len(step.copies):
            self.backend.copy_blocks(self.kv_cache, torch.from_numpy(step.copies).long().to(self.device))
        vocab = self.config.vocab_size
        if step.num_tokens == 0:
            return torch.empty((0, vocab), dtype=torch.float32, device=self.device)
        size = self.padded_size(step) if compute_logits else None
        if size is not None:
            assert self.static is not None  # padded_size is None without it
            padded = self.static.fill(step, size)
            if fill is not None:  # the static buffer's first rows are the step's, in order
                fill.apply(padded.input_ids)
            graphs = self.graphs
            if graphs is not None and size in graphs.sizes:
                return graphs.replay(padded)[: padded.num_real].clone()  # the graph's buffer is reused
            return self.padded_forward(padded)[: padded.num_real]
        # the fused CPU decode takes the step's arrays as they are (no metadata, no torch op before the head)
        # (it reads the ids on the host: only on the CPU, where the device's ids are the host's)
        direct = self.model.step_hidden(fill.materialize(step) if fill is not None and self.device.type == "cpu"
                                        else step, self.kv_views, self.backend)
        meta: AttentionMetadata | None = None  # None: the fused CPU decode ran the step from its arrays
        if direct is not None:
            hidden = direct
        else:
            meta = self.build_metadata(step)
            # The attention plan of the step, once, before any layer reads it (not inside forward).
            if self.model.uses_attention_backend(self.kv_views, self.backend):
                self.backend.plan(meta, self.block_size, *self._heads)
            input_ids = _tensor(step.input_ids, torch.long, self.device)
            if fill is not None:  # (on the CPU this writes the worker's copy of the ids, never the plan's)
                fill.apply(input_ids)
            positions = _tensor(step.positions, torch.long, self.device)
            hidden = self.model(input_ids, positions, self.kv_views, meta, self.backend)
        if not compute_logits:
            return hidden.new_empty((0, vocab))
        if step.num_tokens == step.num_seqs:  # decode only: every token is its sequence's last
            return self.model.compute_logits(hidden)
        # each sequence's last row, on the device hidden is on
        last = (torch.from_numpy(step.query_start_loc[1:].astype(np.int64) - 1) if meta is None
                else meta.query_start_loc[1:].long() - 1)
        if len(step.logit_rows):  # prompt_logprobs: those prompt rows too, after the last rows
            last = torch.cat([last, torch.from_numpy(step.logit_rows).long().to(self.device)])
        return self.model.compute_logits(hidden[last])

    def padded_size(self, step: StepInput) -> int | None:
        """The capture size a step runs padded to: decode-only steps of at most the largest size whose
        tables fit the fixed width; None (run as is) for everything else."""
        padding = self.padding
        if padding is None or step.num_tokens != step.num_seqs or step.block_tables.shape[1] > padding.table_width:
            return None
        sizes = self.graphs.sizes if self.graphs is not None else padding.sizes
        return padded_size(sizes, step.num_seqs)

    def padded_forward(self, step: PaddedStep) -> torch.Tensor:
        """float32 logits [P, vocab] of a padded decode step, eagerly (also what a graph captures)."""
        assert self.padding is not None
        model = self.model
        max_keys = self.padding.table_width * self.block_size
        self.backend.plan_padded_decode(step.meta, self.block_size, model.heads_per_rank, model.kv_heads_per_rank,
                                        max_keys)  # fmt: skip
        hidden = model(step.input_ids, step.positions, self.kv_views, step.meta, self.backend)
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def capture_graphs(self) -> tuple[int, ...]:
        """Captures the padded decode forward of every capture size (CUDA, a backend that supports
        it), then checks each graph against the eager forward; returns the sizes that run as graphs."""
        if self.static is None or self.device.type != "cuda" or not self.backend.supports_decode_graphs:
            return ()
        graphs = DecodeGraphs(self.static, self.padded_forward)
        graphs.capture(self.static.padding.sizes)
        if graphs.sizes and graphs.validate(self.kv_cache, self.num_gpu_blocks, self.config.vocab_size) is None:
            self.graphs = graphs
        return self.graphs.sizes if self.graphs is not None else ()

    def run_transfers(self, transfers: tuple[Transfer, ...] | list[Transfer], done: list[int] | None = None) -> None:
        """Runs tier copies in list order; the tier names map to storage here. ``done`` gets each
        transfer's id once its copy has finished (a device-to-host copy blocks until its bytes are on
        the host): when a copy raises, the ones after it never ran, and only those before it may be
        reported complete (a transfer reported complete that never ran would leave the core serving
        host or device pages nobody wrote)."""
        caches = {"gpu": self.kv_cache, "cpu": self.cpu_cache}
        for transfer in transfers:
            if transfer.dst == "disk" or transfer.src == "disk":
                if self.disk is None:
                    raise RuntimeError(f"transfer {transfer.id} uses the disk tier, which this runner does not have")
                if transfer.dst == "disk":
                    if transfer.meta is None:
                        raise RuntimeError(f"transfer {transfer.id} to the disk tier carries no page meta (hash, parent, "
                                           "tokens); build it with step_input.transfers_from")
                    self.disk.write(caches[transfer.src], transfer.pairs, transfer.meta)
                else:
                    self.disk.read(transfer.pairs, caches[transfer.dst])
            else:
                pairs = torch.from_numpy(transfer.pairs).long()
                self.backend.swap_blocks(caches[transfer.src], caches[transfer.dst], pairs)
            if done is not None:
                done.append(transfer.id)

    def build_metadata(self, step: StepInput) -> AttentionMetadata:
        q = step.query_start_loc.tolist()
        seq_lens = step.seq_lens.tolist()
        if step.num_tokens == len(seq_lens):  # decode only (no query is empty: S rows in T == S tokens, each >= 0)
            max_query_len = 1 if seq_lens else 0
            if q != list(range(len(seq_lens) + 1)):
                raise ValueError(f"every scheduled sequence needs at least one new token; query starts {q}")
        else:
            query_lens = np.diff(step.query_start_loc.astype("int64"))
            if (query_lens < 1).any():
                raise ValueError(f"every scheduled sequence needs at least one new token; query lengths {query_lens.tolist()}")
            max_query_len = int(query_lens.max())
        return AttentionMetadata(
            slot_mapping=_tensor(step.slot_mapping, torch.long, self.device),
            query_start_loc=_tensor(step.query_start_loc, torch.int32, self.device),
            seq_lens=_tensor(step.seq_lens, torch.int32, self.device),
            block_tables=_tensor(step.block_tables, torch.int32, self.device),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=q,
            seq_lens_cpu=seq_lens,
        )


def _tensor(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``array`` as a ``dtype`` tensor on ``device``: on the CPU the array itself when its dtype is
    already right (no copy, no conversion call: a step makes four of these)."""
    t = torch.from_numpy(array)
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if device.type == "cpu" else t.to(device)
