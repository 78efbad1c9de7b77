"""Typed stubs of the native module ``pagedrs._core`` (Rust, PyO3)."""

from collections.abc import Sequence
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

TokenIds = Sequence[int] | npt.NDArray[np.uint32] | npt.NDArray[np.int32] | npt.NDArray[np.int64] | npt.NDArray[np.uint64]
"""A list of ints, or a 1-D NumPy array (uint32/int32 read zero-copy; int64/uint64 converted)."""

PLACEHOLDER_TOKEN: int  # a token not sampled yet (asynchronous scheduling); never hashed into the prefix cache

class OutOfBlocksError(RuntimeError):
    """The KV-cache pool cannot serve the request now; nothing was changed."""

class BlockManager:
    """Paged KV-cache memory: block tables, refcounts, copy-on-write, prefix cache, swap tiers."""

    NULL_BLOCK: int
    """The block-table entry of a page released out of the sliding window (2**32 - 1; -1 in int32 tables)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        cache_salt: int | None = None,
        host_cache_evicted: bool = False,
        num_disk_blocks: int = 0,
        sliding_window: int | None = None,
    ) -> None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_gpu_blocks(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def sliding_window(self) -> int | None:
        """The attention window of every layer; None keeps every page."""
    @property
    def num_free_gpu_blocks(self) -> int:
        """Allocatable now, counting evictable cached blocks."""
    @property
    def num_free_cpu_blocks(self) -> int: ...
    def __contains__(self, seq_id: int) -> bool: ...
    def __len__(self) -> int: ...
    def can_allocate(self, token_ids: TokenIds) -> bool: ...
    def num_blocks_to_allocate(self, token_ids: TokenIds) -> int: ...
    def allocate(self, seq_id: int, token_ids: TokenIds) -> int:
        """Pages for the whole prompt; returns the number of leading cached tokens.

        With prefix caching off a list is kept unconverted (only its length matters then) and read
        when ``tokens`` asks: its ids are checked there, and it must not change while the sequence lives."""
    def num_blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int: ...
    def append_tokens(self, seq_id: int, token_ids: TokenIds) -> list[tuple[int, int]]:
        """Records appended tokens; returns (src, dst) copy-on-write pairs to run first."""
    def commit(self, seq_id: int, num_computed_tokens: int) -> None: ...
    def truncate(self, seq_id: int, num_tokens: int) -> int:
        """Drops the tokens past the first ``num_tokens`` (rejected draft tokens); returns how many pages
        left the table: a page holding only dropped tokens goes back to the pool, a shared one keeps its
        other users, a kept partial page that is shared is copied on write by the next append. All or
        nothing; ValueError for 0, past the length, a swapped sequence, or a cut into a page the prefix
        cache holds (verified, hashed blocks are never rewritten)."""
    def set_token(self, seq_id: int, pos: int, token: int) -> None:
        """Gives the token at ``pos``, appended as PLACEHOLDER_TOKEN (a draft, or a token not sampled yet);
        the blocks it completes up to the committed count are hashed. Blocks holding a placeholder never are."""
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def release_outside_window(self, seq_id: int, first_needed_pos: int) -> int:
        """Releases the pages wholly before token ``first_needed_pos`` (entries become NULL_BLOCK); returns how many."""
    def num_held_blocks(self, seq_id: int) -> int:
        """Device pages the sequence holds: its table less NULL_BLOCK placeholders."""
    def block_table(self, seq_id: int) -> list[int]: ...
    def num_tokens(self, seq_id: int) -> int: ...
    def num_committed_tokens(self, seq_id: int) -> int: ...
    def tokens(self, seq_id: int) -> list[int]: ...
    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]: ...
    def slot_mapping_array(self, seq_id: int, start: int, end: int) -> npt.NDArray[np.int64]: ...
    def num_blocks_to_swap_out(self, seq_ids: Sequence[int]) -> int: ...
    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]: ...
    def can_swap_in(self, seq_ids: Sequence[int]) -> Literal["ok", "later", "never"]: ...
    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]: ...
    def is_swapped(self, seq_id: int) -> bool: ...
    def num_swappable_pages(self, seq_id: int) -> int: ...
    def swap_out_pages(self, seq_id: int, n: int) -> list[tuple[int, int]]: ...
    def host_entries(self, seq_id: int) -> list[bool]: ...
    def take_pending_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(gpu->cpu evict-to-host copies, cpu->gpu host-hit copies) since the last call."""
    def take_transfers(self) -> list[tuple[str, str, list[tuple[int, int]]]]:
        """Every copy planned since the last call, disk tier included, in the order to run them."""
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant."""

class StepPlan:
    """One step's plan; its Python twin is pagedrs.step_input.StepInput (StepInput.from_plan)."""

    step_id: int
    """Report it with Scheduler.complete_step once the step ran or failed."""
    seq_ids: npt.NDArray[np.uint64]
    do_sample: npt.NDArray[np.bool_]
    num_draft_tokens: npt.NDArray[np.int32]
    input_ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    slot_mapping: npt.NDArray[np.int64]
    query_start_loc: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]
    block_tables: npt.NDArray[np.int32]
    transfers: list[tuple[int, str, str, npt.NDArray[np.int64]]]
    """(transfer id, src tier, dst tier, [N, 2] pairs), in execution order."""
    copies: npt.NDArray[np.int64]
    @property
    def num_seqs(self) -> int: ...

class SchedulerConfig:
    """Every setting of a scheduler and its KV memory; the core applies the layout's rules."""

    def __init__(
        self,
        *,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        kv_layout: str = "paged",  # "paged" | "contiguous" (checked by the core)
        contiguous_reserve: str = "max_model_len",  # "max_model_len" | "request"
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
        preemption_mode: str = "auto",  # "swap" | "recompute" | "auto"
        watermark: float = 0.0,
        aging_steps: int = 100,
        swap_cost_per_block: float = 1.0,
        recompute_cost_per_token: float = 1.0,
        host_cache_evicted: bool = False,
        num_disk_blocks: int = 0,
        sliding_window: int | None = None,  # every layer's window: pages outside it are released
        admission_policy: str = "expected_growth",  # "expected_growth" | "prompt_only"
        admission_init_ratio: float = 0.7,
        admission_min_ratio: float = 0.1,
        admission_decay_steps: int = 600,
        prefill_first: bool = False,  # a step that admits a prompt runs no decodes (never twice in a row)
        eviction_policy: str = "lru",  # "lru" | "lfu" (LFU with dynamic aging): which cached page a tier gives up first
    ) -> None: ...
    @property
    def num_gpu_blocks(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def num_cpu_blocks(self) -> int:
        """Host blocks the layout uses (0 for the contiguous baseline)."""
    @property
    def block_size(self) -> int: ...
    @property
    def watermark_blocks(self) -> int: ...
    @property
    def eviction_policy(self) -> str: ...
    @property
    def num_disk_blocks(self) -> int:
        """Disk page slots the layout uses (0 when off, and for the contiguous baseline)."""
    @property
    def host_cache_evicted(self) -> bool: ...

class CoreStats:
    """Every scheduler and KV counter of one moment, frozen (Scheduler.core_stats());
    the names are the keys of Scheduler.stats(), which is built from it."""

    fields: ClassVar[list[str]]
    """The field names, in the order of as_dict()."""
    num_gpu_blocks: int
    num_free_gpu_blocks: int  # allocatable now, evictable cached blocks included
    num_used_gpu_blocks: int
    num_free_cpu_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_steps: int
    num_preemptions: int  # swap + recompute preemptions
    num_swap_preemptions: int
    num_recompute_preemptions: int
    num_deferred_forks: int
    num_failed_steps: int
    disk_pages_invalidated: int
    num_prompt_tokens_computed: int
    num_cached_prompt_tokens: int
    num_decode_tokens: int
    num_pages_swapped_out: int
    num_pages_swapped_in: int
    step_pages_swapped_out: int  # in the last step only
    step_pages_swapped_in: int  # in the last step only
    prefix_queries: int
    prefix_hits: int  # blocks, every tier: prefix_hits_device + prefix_hits_host + prefix_hits_disk
    evictions: int
    cow_copies: int
    swap_out_blocks: int
    swap_in_blocks: int
    host_cache_hits: int
    prefix_hits_device: int
    prefix_hits_host: int
    prefix_hits_disk: int
    prefix_misses_never_seen: int
    prefix_misses_evicted: int
    prefix_misses_evicted_disk: int
    prefix_misses_invalidated: int
    window_released_blocks: int
    host_cache_saves: int
    disk_writes: int
    kv_events_published: int
    num_disk_blocks: int
    num_cached_gpu_blocks: int
    num_cached_cpu_blocks: int
    num_cached_disk_blocks: int
    num_pinned_host_blocks: int
    num_pins: int
    num_pinned_blocks: int
    reserved_slots: int  # token slots held by live sequences (pages or reserved regions)
    live_slots: int  # of those, slots holding a live token
    def as_dict(self) -> dict[str, int]:
        """Every field as a dict: what Scheduler.stats() returns."""
        ...

class Scheduler:
    """The continuous-batching scheduler over a paged (or contiguous) KV space."""

    def __init__(self, config: SchedulerConfig) -> None: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_swapped(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_gpu_blocks(self) -> int: ...
    def add_sequence(
        self,
        seq_id: int,
        token_ids: npt.NDArray[np.uint32],
        *,
        priority: int = 0,
        arrival: int = 0,
        max_tokens: int = 0,
        num_samples: int = 1,
        cache_salt: bytes | None = None,
    ) -> None:
        """Queues a sequence; ValueError (nothing changed) when its worst case can never fit the pool.
        A ``cache_salt`` sequence shares prefix pages only with equally salted ones."""
    def schedule(self) -> StepPlan:
        """Plans the next step; what it fills is a prefix hit for later steps once reported
        (complete_step; the next schedule reports it done). RuntimeError: planning failed
        part-way and the scheduler is unusable."""
    def complete_step(self, step_id: int, ok: bool) -> list[int]:
        """Reports the oldest open step; a failed one caches nothing and resets the sequences
        it ran or whose pages it lost (returned) to be recomputed."""
    def open_steps(self) -> list[int]:
        """Steps handed out and not yet reported, oldest first."""
    def invalidate_disk_slots(self, slots: Sequence[int]) -> int:
        """Drops disk slots whose page was lost; returns how many were dropped."""
    def num_cached_tokens_of(self, seq_id: int) -> int | None:
        """Prompt tokens the sequence's first admission found cached (None before it)."""
    def num_cached_tokens_by_tier_of(self, seq_id: int) -> tuple[int, int, int] | None:
        """That count split by tier (device, host, disk); None before the admission or once its pages are dropped."""
    def reset_prefix_cache(self) -> tuple[int, int, int]:
        """Forgets every cached page on every tier; the pages dropped (device, host, disk). ValueError while pages are held."""
    def pin_prefix(self, token_ids: npt.NDArray[np.uint32], *, cache_salt: bytes | None = None) -> tuple[int, int, int]:
        """Pins the committed, device-cached full blocks of a prefilled prompt: (pin id, tokens, pages)."""
    def unpin(self, pin_id: int) -> None:
        """Releases a pin's pages; ValueError for an unknown id."""
    def pins(self) -> list[tuple[int, int, int]]:
        """Every live pin as (pin id, tokens pinned, pages pinned)."""
    def num_new_pinned_blocks(self, token_ids: npt.NDArray[np.uint32], *, cache_salt: bytes | None = None) -> int:
        """Pages a pin of these tokens would add to the distinct pinned pages."""
    def num_pinned_blocks(self) -> int:
        """Distinct device pages held by pins."""
    def enable_kv_events(self) -> None:
        """KV events on (off by default); the first take announces what is cached now."""
    def take_kv_events(
        self,
    ) -> list[
        tuple[Literal["BlockStored"], list[int], int | None, list[int], str]
        | tuple[Literal["BlockRemoved"], list[int], str]
        | tuple[Literal["AllBlocksCleared"]]
    ]:
        """The tiers' cache changes since the last take, in order; medium "GPU", "CPU" or "DISK"."""
    def cached_hashes(self, medium: str) -> list[int]:
        """Sorted hashes of the pages the tier `medium` caches now."""
    def append_tokens(self, seq_ids: npt.NDArray[np.uint64], token_ids: npt.NDArray[np.uint32]) -> None:
        """One token per sequence, all or nothing."""
    def append_placeholders(self, seq_ids: npt.NDArray[np.uint64]) -> None:
        """Asynchronous scheduling: each sequence's next token is PLACEHOLDER_TOKEN until resolved."""
    def resolve_placeholders(self, seq_ids: npt.NDArray[np.uint64], token_ids: npt.NDArray[np.uint32]) -> int:
        """The sampled tokens of the oldest placeholders; sequences gone meanwhile are skipped."""
    def drop_placeholders(self, seq_ids: npt.NDArray[np.uint64]) -> int:
        """Takes back placeholders whose tokens never come (their step failed)."""
    def set_proposal(self, seq_id: int, token_ids: npt.NDArray[np.uint32]) -> None:
        """Speculative decoding: draft tokens for the sequence's next decode (empty clears it); the next
        schedule uses as many as its budget, max_tokens and free pages allow, without preempting."""
    def set_draft_tokens(self, seq_id: int, token_ids: npt.NDArray[np.uint32]) -> None:
        """Replaces the drafts the last schedule gave the sequence (exactly as many as it holds): a
        proposer that guesses after the plan (the draft model runs on the step's own slots)."""
    def accept_drafts(self, seq_id: int, num_accepted: int) -> int:
        """After the step that computed the sequence's drafts: keeps the first ``num_accepted``, cuts the
        rest from its tokens and pages; returns how many were cut. Sequences gone meanwhile are skipped."""
    def rewind(self, seq_id: int, num_tokens: int) -> bool:
        """A verify step cut short after it was reported done: the engine's record of the sequence holds
        its first ``num_tokens`` tokens; the scheduler agrees and computes the last one again (accepting
        the drafts below it, or by a recompute). False: already consistent, or the sequence is gone."""
    def set_max_steps_in_flight(self, n: int) -> None:
        """1: a step runs before the next is planned (default); 2: asynchronous scheduling."""
    def complete_transfers(self, ids: Sequence[int]) -> None:
        """The runner finished these transfers; their host pins are released (all or nothing)."""
    def seed_disk(
        self,
        slots: npt.NDArray[np.uint32],
        hashes: npt.NDArray[np.uint64],
        parents: npt.NDArray[np.uint64],
        tokens: npt.NDArray[np.uint32],
        invalidated: npt.NDArray[np.uint64],
    ) -> int:
        """Seeds the disk tier at startup with the store's pages (oldest first); returns how many were taken."""
    def disk_pages(
        self, slots: npt.NDArray[np.uint32]
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint32]]:
        """(hashes, parents, tokens [N, block_size]) of the pages disk slots cache."""
    def flush_to_disk(self) -> list[tuple[int, str, str, npt.NDArray[np.int64]]]:
        """Clean shutdown: transfers copying every cached page the disk lacks to it."""
    def num_tokens(self, seq_id: int) -> int: ...
    def fork(self, parent_id: int, child_id: int) -> None:
        """Child shares every page of the parent (running, waiting or swapped; it starts in the parent's state). Fork before appending the step's sampled tokens."""
    def finish(self, seq_id: int) -> None: ...
    def contains(self, seq_id: int) -> bool: ...
    def num_held_blocks(self, seq_id: int) -> int:
        """Pages the sequence's table holds (host ones while swapped, 0 while waiting), placeholders excluded."""
    def worst_case_blocks(self, prompt_len: int, max_tokens: int, num_samples: int = 1) -> int: ...
    def has_unfinished(self) -> bool: ...
    @property
    def admission_ratio(self) -> float:
        """Share of its remaining max_tokens each running sequence is expected to still generate."""
    def core_stats(self) -> CoreStats:
        """Scheduler and KV counters plus utilization, as one typed value."""
        ...
    def stats(self) -> dict[str, int]:
        """core_stats().as_dict(): the same counters, one key per field."""
        ...
    def page_tiers(self, seq_id: int) -> tuple[int, int]:
        """(device pages, host pages) of the sequence's block table; a paused one may hold both."""
        ...
    def set_whole_sequence_swap(self, on: bool) -> None:
        """Baseline: swap preemption moves every page of the victim at once, not pages on demand."""
        ...
    def check_invariants(self) -> None: ...

def cuda_sources() -> list[tuple[str, str]]:
    """File name -> text of the CUDA kernel sources compiled into this extension."""

def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: bytes | None = None) -> list[int]:
    """The hashes of the full blocks of `token_ids`, as a scheduler names them (cached_hashes, KV events)."""

class GgufMatrix:
    """A GGUF-quantized weight ``[rows, cols]`` (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_NL /
    IQ4_XS raw block bytes) repacked once for the Rust GEMV kernels, or (``fused``) the rows of several such weights, each in
    its own format; ``matmul`` quantizes ``x`` per block of 32 to int8 and releases the GIL.
    Bad bytes, shapes or non-finite scales raise ValueError naming the tensor."""

    def __init__(self, data: npt.NDArray[np.uint8], rows: int, cols: int, format: str, name: str = "weight") -> None: ...
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def format(self) -> str:
        """``"q4_k"``; a fused product's parts' formats joined by ``+`` (``"q4_k+q4_k+q6_k"``)."""
    @property
    def name(self) -> str: ...
    @property
    def weight_bytes(self) -> int:
        """Bytes one product streams (the GGUF tensor's size)."""
    def matmul(self, x: object, threads: int = 1, kernel: str | None = None) -> npt.NDArray[np.float32]:
        """``x @ W.T`` [M, rows] for a float32 [M, cols] array or CPU tensor; ``kernel`` None = the fastest."""
    @staticmethod
    def fused(parts: list[GgufMatrix], name: str = "weight") -> GgufMatrix:
        """One product whose rows are ``parts``' rows in order, each part in its own format (the parts'
        blocks shared); ValueError naming ``name`` when the parts' columns differ or there are none."""
    @property
    def reads_rows(self) -> bool:
        """Whether ``dequantize_rows`` reads this matrix: one part, in Q8_0 or Q6_K."""
    def dequantize_rows(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        """Rows ``ids`` as float32 ``[len(ids), cols]``, gguf-py's dequantized values (a tied head's token
        lookup read from the head's tiles); ValueError naming the tensor for an id outside ``0..rows`` or
        a matrix ``reads_rows`` is False for."""

def logits_row_stats(
    logits: npt.NDArray[np.float32], threads: int = 1
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Each row's argmax (the first maximal index, NaN maximal) and log-sum-exp (``torch.logsumexp``'s
    special values) of float32 logits ``[rows, vocab]``; ValueError names ``logits`` when it is not
    C-contiguous or its rows are empty."""

def logits_greedy(logits: npt.NDArray[np.float32]) -> tuple[list[int], list[float]]:
    """Each row's greedy token (``logits_row_stats``' argmax) and its log-probability ``x[t] - logsumexp(x)``
    (float32), as lists."""

class DecodeStack:
    """Every decoder layer of a GGUF model (``GgufMatrix`` products, float32 norms) run in one call on
    the CPU: norms, rotary, K/V writes, paged attention over the pages in place. Each row is computed
    on its own (batch-invariant). Bad shapes or step metadata raise ValueError naming the field."""

    def __init__(
        self,
        *,
        input_norms: list[npt.NDArray[np.float32]],
        post_norms: list[npt.NDArray[np.float32]],
        qkv: list[GgufMatrix],
        qkv_bias: list[npt.NDArray[np.float32] | None],
        o: list[GgufMatrix],
        gate_up: list[GgufMatrix],
        down: list[GgufMatrix],
        sliding_windows: list[int | None],
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
        scale: float,
        final_norm: npt.NDArray[np.float32] | None = None,
    ) -> None:
        """``final_norm``: the model's final norm weights; ``forward`` then returns the normed rows."""
    @property
    def num_layers(self) -> int: ...
    @property
    def has_final_norm(self) -> bool: ...
    def timings(self) -> tuple[float, float, float, int]:
        """Seconds in (GEMV products, attention, elementwise ops) and steps run since ``reset_timings``."""
    def reset_timings(self) -> None: ...
    def forward(
        self,
        hidden: npt.NDArray[np.float32],
        cos_sin: npt.NDArray[np.float32],
        kv_cache: npt.NDArray[np.float32] | npt.NDArray[np.uint8],
        slot_mapping: npt.NDArray[np.int64],
        query_start_loc: npt.NDArray[np.int32],
        seq_lens: npt.NDArray[np.int32],
        block_tables: npt.NDArray[np.int32],
        threads: int = 1,
        kernel: str | None = None,
        kv_dtype: str = "float32",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> npt.NDArray[np.float32]:
        """``residual + h`` after the last layer [T, hidden]; writes the step's K/V into ``kv_cache``
        ([layers, 2, blocks, block_size, kv_heads, head_dim]), after checking everything: float32
        values (``kv_dtype="float32"``), or fp8 codes as uint8 (``"fp8_e4m3"``, ``"fp8_e5m2"``;
        stored as ``x / scale``, the torch backend's rule)."""

def advise_huge_pages(ptr: int, nbytes: int) -> int:
    """Asks Linux to back the whole 2 MiB pages inside ``nbytes`` at address ``ptr`` with huge pages
    (a hint: changes no byte); returns the bytes advised, 0 where none (THP off, another OS)."""

def gemv_kernels() -> list[str]:
    """The GEMV kernels this CPU runs (run-time detection), slowest first: "scalar", "avx2", "avx512_vnni"."""
