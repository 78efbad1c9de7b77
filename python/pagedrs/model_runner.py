"""ModelRunner: executes one scheduled step (block copies, then the forward pass) and returns logits.

It owns the KV tensors and never decides anything about memory: which block
holds what, what to copy and what to swap all come in the ``StepInput``.

KV layout: the model's (``KvModel.kv_cache_shape``; see ``pagedrs.attention.base``), one
tensor per memory tier, ``[num_layers, 2, num_blocks, block_size, kv_heads_per_rank, head_dim]``,
so that a copy or a swap of a block across every layer and both K and V is a single
indexed copy along dim 2. The disk tier, when there is one, is a ``DiskTier``
(pagedrs.kv_tiers) that gathers and scatters the same slices to a page store.
"""

from __future__ import annotations

import torch

from pagedrs.attention import AttentionBackend, AttentionMetadata, get_backend
from pagedrs.kv_tiers.disk_tier import DiskTier
from pagedrs.models.interface import KvModel
from pagedrs.models.loader import LoadedModel
from pagedrs.step_input import StepInput, Transfer


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
    ) -> None:
        if num_gpu_blocks < 1 or num_cpu_blocks < 0 or block_size < 1:
            raise ValueError(
                f"ModelRunner needs num_gpu_blocks >= 1, num_cpu_blocks >= 0, block_size >= 1; got "
                f"num_gpu_blocks={num_gpu_blocks}, num_cpu_blocks={num_cpu_blocks}, block_size={block_size}"
            )
        self.loaded = loaded
        self.model: KvModel = loaded.model
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
        self.backend.check_kv_cache_dtype(self.kv_dtype)
        self.kv_cache = torch.zeros(self.model.kv_cache_shape(num_gpu_blocks, block_size), dtype=self.kv_dtype,
                                    device=self.device)
        self.cpu_cache = torch.zeros(
            self.model.kv_cache_shape(num_cpu_blocks, block_size),
            dtype=self.kv_dtype,
            device="cpu",
            pin_memory=self.device.type == "cuda" and torch.cuda.is_available(),
        )
        # each layer's (key, value) views, made once: the forward pass would otherwise make 60 views a step
        self.kv_views = self.model.kv_layer_views(self.kv_cache)
        self.disk: DiskTier | None = None  # set by the executor when a disk tier is on

    @torch.inference_mode()
    def execute(self, step: StepInput, compute_logits: bool = True) -> torch.Tensor:
        """float32 logits [S, vocab]: row i for the last new token of scheduled sequence i.

        ``compute_logits=False`` (tensor-parallel workers: rank 0 samples) skips the output
        head and returns an empty tensor."""
        # block movement first, in the plan's order: swap-outs free blocks others may reuse now
        self.run_transfers(step.transfers)
        if len(step.copies):
            self.backend.copy_blocks(self.kv_cache, torch.from_numpy(step.copies).long().to(self.device))
        vocab = self.config.vocab_size
        if step.num_tokens == 0:
            return torch.empty((0, vocab), dtype=torch.float32, device=self.device)
        meta = self.build_metadata(step)
        # The attention plan of the step, once, before any layer reads it (not inside forward).
        self.backend.plan(meta, self.block_size, self.model.heads_per_rank, self.model.kv_heads_per_rank)
        input_ids = torch.from_numpy(step.input_ids).long().to(self.device)
        positions = torch.from_numpy(step.positions).long().to(self.device)
        hidden = self.model(input_ids, positions, self.kv_views, meta, self.backend)
        if not compute_logits:
            return hidden.new_empty((0, vocab))
        if step.num_tokens == step.num_seqs:  # decode only: every token is its sequence's last
            return self.model.compute_logits(hidden)
        last = meta.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last])

    def run_transfers(self, transfers: tuple[Transfer, ...] | list[Transfer]) -> None:
        """Runs tier copies in list order; the tier names map to storage here."""
        caches = {"gpu": self.kv_cache, "cpu": self.cpu_cache}
        for transfer in transfers:
            if transfer.dst == "disk" or transfer.src == "disk":
                if self.disk is None:
                    raise RuntimeError(f"transfer {transfer.id} uses the disk tier, which this runner does not have")
                if transfer.dst == "disk":
                    self.disk.write(caches[transfer.src], transfer.pairs)
                else:
                    self.disk.read(transfer.pairs, caches[transfer.dst])
                continue
            pairs = torch.from_numpy(transfer.pairs).long()
            self.backend.swap_blocks(caches[transfer.src], caches[transfer.dst], pairs)

    def build_metadata(self, step: StepInput) -> AttentionMetadata:
        q = step.query_start_loc.astype("int64")
        dev = self.device
        query_lens = q[1:] - q[:-1]
        if (query_lens < 1).any():
            raise ValueError(f"every scheduled sequence needs at least one new token; query lengths {query_lens.tolist()}")
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(step.slot_mapping).long().to(dev),
            query_start_loc=torch.from_numpy(step.query_start_loc).int().to(dev),
            seq_lens=torch.from_numpy(step.seq_lens).int().to(dev),
            block_tables=torch.from_numpy(step.block_tables).int().to(dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(step.seq_lens.max()),
            query_start_loc_cpu=q.tolist(),
            seq_lens_cpu=step.seq_lens.tolist(),
        )
