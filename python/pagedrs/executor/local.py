"""``LocalExecutor``: one process, one device — ``ModelRunner`` behind the ``Executor`` protocol,
with the disk page store (the one executor that can have one)."""

from __future__ import annotations

import functools
import logging

import torch

from pagedrs.attention import AttentionBackend
from pagedrs.attention.kv_quant import SCALE_RULE, is_fp8, resolve_kv_cache_dtype
from pagedrs.decode_graphs import DecodePadding, capture_sizes, graph_headroom_bytes
from pagedrs.engine_args import MAX_CPU_THREADS, EngineArgs, usable_cores
from pagedrs.executor.base import DiskTierHandle
from pagedrs.executor.token_fill import DeviceFill
from pagedrs.kv_tiers import DiskPageStore, StoreGeometry, model_fingerprint
from pagedrs.kv_tiers.disk_tier import DiskTier
from pagedrs.kv_tiers.errors import DiskTierError
from pagedrs.kv_tiers.sizing import resolved_swap_space_gb
from pagedrs.kv_tiers.store_layout import SeedPages
from pagedrs.memory import KvPlan, plan_kv_memory
from pagedrs.model_runner import ModelRunner
from pagedrs.models.gguf_linear import hand_cpu_threads_to_gemv
from pagedrs.models.kv_geometry import KvGeometry
from pagedrs.models.loader import load_model
from pagedrs.spec.config import SpeculativeConfig
from pagedrs.spec.draft_runner import DraftRunner, load_draft
from pagedrs.step_input import StepInput, Transfer

logger = logging.getLogger("pagedrs.engine")


def oversubscription_warning(threads: int, cores: int | None = None) -> str | None:
    """What to tell a user whose ``cpu_threads`` exceeds the cores this process may use, else None.
    Why a warning and not an error: more threads than cores is allowed (a machine's cores may be
    freed later), but every step then waits on threads with no core; measured (Intel Xeon, 2 cores,
    2026-12-06, ``cargo bench --bench decode_stack -- 160 3 amx_int8 N``): a batch-1 SmolLM2 step
    on 8 threads ran 1.27x of one thread's speed, on 32 threads 0.54x, where 2 threads ran 1.56x."""
    cores = usable_cores() if cores is None else cores
    if threads <= cores:
        return None
    return (f"cpu_threads is {threads}, more than the {cores} core(s) this process may use: threads past "
            f"the cores wait for one, and a step gets slower, not faster (allowed: any count up to "
            f"{MAX_CPU_THREADS}; best: at most {cores})")


class LocalExecutor:
    """One process, one device: today's ``ModelRunner`` behind the ``Executor`` protocol."""

    fills_on_device = True  # ``execute`` takes a ``DeviceFill`` (asynchronous scheduling's worker asks)

    def __init__(
        self, args: EngineArgs, attention_backend: AttentionBackend | None = None, *, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cpu":
            torch.set_num_threads(args.resolved_cpu_threads())
            warning = oversubscription_warning(args.resolved_cpu_threads())
            if warning is not None:
                logger.warning(warning)
        from pagedrs.distributed import parallel_state

        if (parallel_state.tp_rank(), parallel_state.tp_size()) != (tp_rank, tp_size):
            raise RuntimeError(
                f"LocalExecutor for rank {tp_rank} of {tp_size}, but this process is rank "
                f"{parallel_state.tp_rank()} of {parallel_state.tp_size()} (set_tensor_parallel first)"
            )
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.loaded = load_model(args.model, dtype=args.dtype, device=self.device, weight_dtype=args.weight_dtype,
                                 skip_tokenizer_init=args.skip_tokenizer_init)
        self.kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.loaded.dtype)  # what pages are stored in
        self._backend = attention_backend
        self.draft = self._load_draft()  # speculative_config's draft model (spec/draft_runner.py), or None
        if self.device.type == "cpu":  # the GGUF kernel's own team takes the cores (see the function)
            models = [self.loaded.model] + ([self.draft.loaded.model] if self.draft is not None else [])
            hand_cpu_threads_to_gemv(models, args.resolved_cpu_threads())
        self.runner: ModelRunner | None = None
        self._completed: list[int] = []
        self._disk: _LocalDiskTier | None = None
        self.padding = self._decode_padding()
        self.decode_graph_sizes: tuple[int, ...] = ()  # the capture sizes that run as CUDA graphs

    def _load_draft(self) -> DraftRunner | None:
        """The draft model of ``speculative_config={"method": "draft_model", ...}`` (None for any
        other config); refused, naming ``speculative_config.model``, when it cannot serve."""
        raw = self.args.speculative_config
        if raw is None:
            return None
        config = SpeculativeConfig.parse(raw)
        if config.method != "draft_model":
            return None
        assert config.model is not None  # parse requires it for draft_model
        draft = load_draft(config.model, self.loaded, dtype=self.args.dtype, weight_dtype=self.args.weight_dtype)
        return DraftRunner(draft, block_size=self.args.block_size, kv_cache_dtype=self.kv_dtype)

    def _decode_padding(self) -> DecodePadding | None:
        """The padded decode path's shapes (EngineArgs.uses_decode_padding), or None."""
        args = self.args
        if not args.uses_decode_padding():
            return None
        max_model_len = args.max_model_len or self.loaded.config.context_length
        return DecodePadding(sizes=capture_sizes(args.max_num_seqs), table_width=-(-max_model_len // args.block_size))

    def plan_kv_memory(self) -> KvPlan:
        """The pools for EngineArgs; with the padded decode path, one device block fewer for the
        scheduler than the bytes hold (the scratch page), and with CUDA graphs the pool sized from
        free memory leaves ``graph_headroom_bytes`` for the graphs' memory pool."""
        args = self.args
        num_parameters = sum(p.numel() for p in self.loaded.model.parameters())
        # the one formula (models.kv_geometry) at the pages' itemsize: 1 byte for an fp8 cache
        bytes_per_token = KvGeometry(self.loaded.config.num_hidden_layers, self.loaded.model.kv_heads_per_rank,
                                     self.loaded.config.head_dim).bytes_per_element_token(self.kv_dtype.itemsize)
        if self.draft is not None:  # each page holds the draft's layers too (spec/draft_runner.py)
            bytes_per_token += self.draft.bytes_per_token()
            num_parameters += sum(p.numel() for p in self.draft.loaded.model.parameters())
        headroom = 0
        if self.padding is not None and args.uses_decode_graphs():
            headroom = graph_headroom_bytes(self.loaded.config, self.padding.sizes[-1],
                                            torch.empty(0, dtype=self.loaded.dtype).element_size(),
                                            self.padding.table_width * args.block_size)  # fmt: skip
        return plan_kv_memory(
            bytes_per_token=bytes_per_token,
            block_size=args.block_size,
            num_parameters=num_parameters,
            device=self.device,
            num_gpu_blocks=args.num_gpu_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            swap_space_gb=resolved_swap_space_gb(args.swap_space_gb, device_type=self.device.type),
            reserved_blocks=1 if self.padding is not None else 0,
            headroom_bytes=headroom,
        )

    # ---- the disk tier ------------------------------------------------------------

    def open_disk_tier(self) -> DiskTierHandle | None:
        """Opens (or creates) the disk page store of EngineArgs.kv_disk_path (None when it is None).
        DiskTierError names the path and the reason when it cannot be used (another engine holds
        it, not a writable directory, too small, no space for it)."""
        args = self.args
        if args.kv_disk_path is None:
            return None
        c = self.loaded.config
        geometry = StoreGeometry(
            fingerprint=model_fingerprint(self.loaded.model, c),
            dtype=args.dtype,
            block_size=args.block_size,
            num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            itemsize=self.kv_dtype.itemsize,
            # pages stored in another dtype than the model's (an fp8 store with its scale rule; bfloat16
            # pages of a float16 model have float16's itemsize): a store of other pages is refused, never misread
            kv_cache=_stored_as(self.kv_dtype, self.loaded.dtype),
        )
        slot_bytes = DiskPageStore(args.kv_disk_path, num_slots=1, geometry=geometry).slot_bytes
        num_slots = int(args.kv_disk_gb * 2**30) // slot_bytes
        if num_slots < 1:
            raise DiskTierError(args.kv_disk_path, f"kv_disk_gb={args.kv_disk_gb} holds no page slot; one slot "
                                                   f"needs {slot_bytes} bytes, so kv_disk_gb must be at least "
                                                   f"{slot_bytes / 2**30:.3g}")
        store = DiskPageStore(args.kv_disk_path, num_slots=num_slots, geometry=geometry)
        self._disk = _LocalDiskTier(self, store, store.open())
        return self._disk

    def disk_tier(self) -> DiskTierHandle | None:
        return self._disk

    @property
    def _disk_store(self) -> DiskPageStore | None:
        """The open store (tests watch its reads and writes)."""
        return self._disk.store if self._disk is not None else None

    def take_failed_disk_slots(self) -> list[int]:
        return self._disk.take_failed_disk_slots() if self._disk is not None else []

    # ---- steps --------------------------------------------------------------------

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the pools (and the scratch page past them with the padded decode path), then
        captures the decode graphs: they bake in the cache's addresses, so only now."""
        self.runner = ModelRunner(
            self.loaded,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            block_size=self.args.block_size,
            backend=self._backend,
            kv_cache_dtype=self.kv_dtype,
            padding=self.padding,
        )
        if self._disk is not None:
            self.runner.disk = self._disk.runner_tier()
        if self.draft is not None:
            self.draft.init_kv_cache(num_gpu_blocks, num_cpu_blocks)
        if self.padding is not None and self.args.uses_decode_graphs():
            self.decode_graph_sizes = self.runner.capture_graphs()
            if self.decode_graph_sizes:
                logger.info("CUDA graphs: decode batch sizes %s captured; wider decode steps run eagerly",
                            list(self.decode_graph_sizes))  # fmt: skip
            else:
                logger.warning("CUDA graphs: none in use on %s (backend %s); decode steps run eagerly",
                               self.device, self.runner.backend.name)  # fmt: skip
                if self.args.pad_decode is None:  # padding was for the graphs: decode steps run as they come
                    self.runner.padding = None

    def run_transfers(self, transfers: list[Transfer]) -> None:
        """Runs tier copies outside a step (the shutdown flush), synchronously."""
        if self.runner is None:
            raise RuntimeError("LocalExecutor.run_transfers before init_kv_cache")
        with torch.inference_mode():
            self.runner.run_transfers(transfers)

    def execute(self, step: StepInput, compute_logits: bool = True, fill: DeviceFill | None = None) -> torch.Tensor:
        """``fill``: placeholder input ids whose tokens are still on the device (asynchronous
        scheduling, executor/token_fill.py); the runner writes them there."""
        if self.runner is None:
            raise RuntimeError("LocalExecutor.execute before init_kv_cache")
        done: list[int] = []
        try:
            if self.draft is not None:  # the draft's pages follow the target's (once: a proposal may have run it)
                if fill is not None:  # the draft's mirror reads the ids on the host
                    step, fill = fill.materialize(step), None
                self.draft.mirror(step)
            return self.runner.execute(step, compute_logits=compute_logits, fill=fill, transfers_done=done)
        finally:
            # Only the copies that ran: the runner's are synchronous with respect to later reads
            # of the host pool (a device-to-host copy blocks), so those are done, also when the
            # forward pass failed after them. A copy that raised, and every one after it (or all
            # of them, when the draft's mirror raised first), is not reported: the core fails
            # those transfers and recomputes the sequences whose pages they were to move, where
            # reporting them made it resume sequences from host pages nobody wrote.
            self._completed.extend(done)

    def take_completed_transfers(self) -> list[int]:
        done, self._completed = self._completed, []
        return done

    @functools.cached_property
    def _weights_bytes(self) -> int:
        """Parameters and buffers (packed int4/int8 weights are buffers), each tensor once, and what a model
        holds outside torch (GGUF matrices, a block embedding: ``outside_torch_bytes``); fixed after load,
        so counted once rather than on every stats() call (the serving loop asks every step)."""
        models = [self.loaded.model] + ([self.draft.loaded.model] if self.draft is not None else [])
        tensors = {id(t): t for model in models for t in [*model.parameters(), *model.buffers()]}
        outside = sum(m.outside_torch_bytes() for m in models if hasattr(m, "outside_torch_bytes"))
        return int(sum(t.numel() * t.element_size() for t in tensors.values())) + int(outside)

    def memory_bytes(self) -> dict[str, int]:
        weights = self._weights_bytes
        kv = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size() if self.runner else 0
        host = self.runner.cpu_cache.numel() * self.runner.cpu_cache.element_size() if self.runner else 0
        if self.draft is not None:  # the draft's layers of the same pages
            draft_kv, draft_host = self.draft.kv_bytes()
            kv, host = kv + draft_kv, host + draft_host
        return {"weights": int(weights), "kv_pool": int(kv), "host_pool": int(host)}

    def shutdown(self) -> None:
        """Makes the disk store's pages durable and closes it, then drops the KV tensors."""
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        self.runner = None
        if self.draft is not None:
            self.draft.runner = None


def _stored_as(kv_dtype: torch.dtype, model_dtype: torch.dtype) -> str:
    """``StoreGeometry.kv_cache``: "auto" for pages in the model's dtype, else the storage dtype (and an
    fp8 cache's scale rule: "float8_e4m3fn/scales:unit", the form stores were first written with)."""
    if kv_dtype == model_dtype:
        return "auto"
    name = str(kv_dtype).removeprefix("torch.")
    return f"{name}/scales:{SCALE_RULE}" if is_fp8(kv_dtype) else name


class _LocalDiskTier:
    """``DiskTierHandle`` of a ``LocalExecutor``: its open store, and the runner that moves pages to it."""

    def __init__(self, executor: LocalExecutor, store: DiskPageStore, seed: SeedPages) -> None:
        self._executor = executor
        self.store = store
        self._seed = seed

    @property
    def num_slots(self) -> int:
        return self.store.num_slots

    @property
    def seed(self) -> SeedPages:
        return self._seed

    def runner_tier(self) -> DiskTier:
        """The runner's side of the tier (gather and scatter of page slices)."""
        return DiskTier(self.store)

    def run_transfers(self, transfers: list[Transfer]) -> None:
        self._executor.run_transfers(transfers)

    def take_failed_disk_slots(self) -> list[int]:
        return self.store.take_failed_slots()

    def erase_pages(self) -> None:
        self.store.erase_pages()

    def close(self) -> None:
        self.store.close()
