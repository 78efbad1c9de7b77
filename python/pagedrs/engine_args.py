"""Engine settings, validated before anything is loaded."""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Optional

CPU_THREADS_ENV = "PAGEDRS_CPU_THREADS"
# The most CPU threads an engine takes: the GGUF kernel's team limit (rust/src/gemv/pool.rs
# MAX_THREADS), far past any CPU here; refused at startup, not at the first step.
MAX_CPU_THREADS = 1024


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one, else the CPU count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1

_LAYOUTS = ("paged", "contiguous")
_PREEMPTION = ("swap", "recompute", "auto")
_RESERVE = ("max_model_len", "request")
_DTYPES = ("float32", "float16", "bfloat16")
# the linear weights' formats (models/quant.py builds them); one list for the engine, the CLI and the benches
WEIGHT_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "int8", "int4", "gguf", "q4_0", "q4_1", "q8_0")
# auto: pages in the model dtype; fp8_*: 8-bit pages with per-tensor scales (attention/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")  # "fp8" is vLLM's name for fp8_e4m3 (taken as that)


@dataclass
class EngineArgs:
    model: Optional[str] = "smollm2-135m"  # a preset name, an HF folder, or a .gguf file
    device: str = "cpu"
    dtype: str = "float32"
    # linear weights: auto = exact for HF folders, the file's own blocks (gguf) for a quantized GGUF (CPU);
    # q4_0 / q4_1 / q8_0 quantize any checkpoint into those blocks for the Rust GEMV (models/block_quant.py)
    weight_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: Optional[int] = None  # bytes for the device KV pool
    gpu_memory_utilization: float = 0.9  # CUDA, when neither num_gpu_blocks nor kv_cache_memory is set
    # Host tier for swapped pages (GiB). None = auto: 1 GiB on CUDA, 0 on a CPU device, where
    # "host" is the pool's own RAM (kv_tiers/sizing.py); an explicit value is honoured anywhere.
    swap_space_gb: Optional[float] = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "auto"
    kv_layout: str = "paged"  # "contiguous" = the traditional reservation baseline
    contiguous_reserve: str = "max_model_len"  # or "request": prompt + max_tokens
    num_gpu_blocks: Optional[int] = None  # overrides kv_cache_memory
    max_model_len: Optional[int] = None  # default: the model's context length
    # A max_model_len past the model's context length (positions it never trained on) is refused
    # unless True, or the environment sets PAGEDRS_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's
    # VLLM_ALLOW_LONG_MAX_MODEL_LEN): outputs there may be wrong, so it takes a decision.
    allow_long_max_model_len: bool = False
    seed: int = 0
    watermark: float = 0.01  # fraction of device blocks kept free at admission
    aging_steps: int = 100  # waiting steps per priority level gained (anti-starvation)
    # "expected_growth": a prompt is admitted only beside the room running sequences are
    # expected to grow into (fewer preemptions); "prompt_only": its prompt's pages alone.
    admission_policy: str = "expected_growth"
    # A step that can admit a waiting prompt runs it without the running decodes (never two
    # such steps in a row): a new request's first token costs its prefill alone, not its
    # prefill plus a decode of the whole batch; the decodes wait one step (vLLM v0's order).
    prefill_first: bool = False
    # Plan and launch step N+1 before step N is sampled (vLLM's async_scheduling; core/async_step.py):
    # the device never waits for the host's sampling and output handling. Same outputs.
    async_scheduling: bool = False
    # Which cached page every tier gives up first: "lru" (least recently released) or "lfu"
    # (least frequently hit, with dynamic aging so a once-hot prefix does not stay for ever).
    eviction_policy: str = "lru"
    # Pinned prefixes (LLM.pin_prefix) may hold at most this fraction of the device pool, in (0, 1]:
    # a pin past it is refused (PinCapError), so pins can never starve the requests that use them.
    max_pinned_fraction: float = 0.25
    host_cache_evicted: bool = False  # legacy switch: host-cache evicted pages in the swap pool's free blocks
    # Host tier for evicted prefix pages, added to the swap pool (GiB; 0 = off).
    # None = auto: min(4 GiB, 10% of MemAvailable) on CUDA, 0 on a CPU device (as swap_space_gb).
    kv_host_cache_gb: Optional[float] = None
    # Persistent disk tier: a directory for the page store (None = off), and its size
    # (the file is preallocated). Pages survive a restart of an engine with the same model.
    kv_disk_path: Optional[str] = None
    kv_disk_gb: float = 8.0
    # CPU only: torch intra-op threads. None: $PAGEDRS_CPU_THREADS, else 1 — on a small
    # shared machine OpenMP's spinning workers stall 10-30x whenever another process holds
    # a core (measured: the demo took 5 s with 1 thread and 115-180 s with 2 beside one busy
    # process). `pagedrs serve` defaults to every core it may use: a server owns its machine.
    # With weight_dtype "gguf" (or q4_0 / q4_1 / q8_0) the kernel's own team takes these threads and torch keeps one
    # (models/gguf_linear.py, hand_cpu_threads_to_gemv). 1 to MAX_CPU_THREADS; more than the cores this
    # process may use is allowed and said at startup (every step then waits on threads with no core).
    cpu_threads: Optional[int] = None
    # Most samples (SamplingParams.n) one request may ask for: each sample holds its own
    # pages and sampling rows, so n is a multiplier a hostile client must not control.
    max_n: int = 128
    # Ranks of tensor parallelism (torch.distributed: gloo on the CPU, NCCL on CUDA); rank 0
    # is this process and owns the one scheduler.
    tensor_parallel_size: int = 1
    # How ranks 1..N-1 start (vLLM's name): "mp" spawns processes on this machine; "ray" starts them
    # as Ray actors in one placement group (one bundle per device), on any node of the cluster this
    # process is connected to: tensor parallelism across machines (pagedrs.distributed.ray_workers).
    distributed_executor_backend: str = "mp"
    # As in vLLM: build no tokenizer (a folder with config + safetensors only). Prompts must
    # be token ids; outputs carry token ids and empty text.
    skip_tokenizer_init: bool = False
    # KV pages in the model dtype ("auto"), in bfloat16 ("bfloat16": twice float32's tokens in the same
    # bytes, values rounded to 8 bits of precision; a CPU's float32 model), or in 8 bits ("fp8_e4m3",
    # "fp8_e5m2": twice the tokens of bf16 pages, four times float32's), scaled per tensor (attention/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # CUDA: decode steps run as CUDA graphs (one per padded batch size, vLLM's capture list) unless
    # True. Ignored on the CPU, where nothing is captured.
    enforce_eager: bool = False
    # The padded decode path (pagedrs.decode_graphs): decode-only steps padded to a capture size in
    # static buffers, padding rows on a reserved scratch page. None = on exactly when CUDA graphs
    # are (CUDA, enforce_eager False, one rank); True also on the CPU (the path the graphs run,
    # without them: for tests) or with enforce_eager (the graphs' eager twin); False turns graphs off too.
    pad_decode: Optional[bool] = None
    # KV events for routers (core/kv_events.py): vLLM's BlockStored / BlockRemoved / AllBlocksCleared
    # over ZMQ PUB at this endpoint ("tcp://*:5557" binds, "tcp://host:port" connects; None = off, and
    # the core logs nothing), a ROUTER endpoint resending missed batches by sequence number, and how
    # many batches it keeps for that.
    kv_events_endpoint: Optional[str] = None
    kv_events_replay_endpoint: Optional[str] = None
    kv_events_buffer_steps: int = 10_000
    # Speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": m, "prompt_lookup_max": M} (pagedrs/spec/config.py; None = off)
    speculative_config: Optional[dict[str, Any]] = None
    # The grammar engine of structured outputs: "llguidance" (default) or "xgrammar" (optional:
    # pip install xgrammar). vLLM's --structured-outputs-config.backend.
    structured_outputs_backend: str = "llguidance"

    def __post_init__(self) -> None:
        def choice(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} is {value!r}; allowed: {', '.join(repr(a) for a in allowed)}")

        def at_least(name: str, low: float, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < math.inf:
                raise ValueError(f"{name} is {value!r}; it must be a finite number >= {low}")

        def whole_at_least(name: str, low: int, optional: bool = False) -> None:
            """A count: an integer (not a bool, not 16.5, which the core would refuse or truncate), >= low."""
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"{name} is {value!r}; it must be an integer >= {low}")

        choice("kv_layout", _LAYOUTS)
        choice("preemption_mode", _PREEMPTION)
        choice("contiguous_reserve", _RESERVE)
        choice("dtype", _DTYPES)
        choice("weight_dtype", WEIGHT_DTYPES)
        choice("admission_policy", ("expected_growth", "prompt_only"))
        choice("eviction_policy", ("lru", "lfu"))
        choice("structured_outputs_backend", ("llguidance", "xgrammar"))
        if self.structured_outputs_backend == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
            raise ValueError("structured_outputs_backend is 'xgrammar', but the xgrammar package is not installed "
                             "(pip install xgrammar); allowed without it: 'llguidance'")
        choice("kv_cache_dtype", KV_CACHE_DTYPES)
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"  # vLLM's alias: every later reader sees one name per format
        choice("distributed_executor_backend", ("mp", "ray"))
        if isinstance(self.max_pinned_fraction, bool) or not isinstance(self.max_pinned_fraction, (int, float)) or not (
            0 < self.max_pinned_fraction <= 1
        ):
            raise ValueError(f"max_pinned_fraction is {self.max_pinned_fraction!r}; allowed a number in (0, 1]")
        if self.kv_cache_dtype != "auto" and self.kv_layout != "paged":
            raise ValueError(f"kv_cache_dtype is {self.kv_cache_dtype!r}, which needs kv_layout='paged'; "
                             f"kv_layout={self.kv_layout!r} is the traditional baseline and stores the model dtype "
                             "(use kv_cache_dtype='auto' with it)")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_n", "tensor_parallel_size"):
            whole_at_least(name, 1)
        for name in ("num_gpu_blocks", "max_model_len", "kv_cache_memory"):
            whole_at_least(name, 1, optional=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed is {self.seed!r}; it must be an integer from -2**63 to 2**64 - 1 (torch's seed range)")
        if self.cpu_threads is not None:
            _check_cpu_threads("cpu_threads", self.cpu_threads)
        at_least("swap_space_gb", 0, optional=True)
        at_least("kv_host_cache_gb", 0, optional=True)
        _check_host_tier_fits(self.swap_space_gb, self.kv_host_cache_gb)
        _check_host_cache_has_pages(self)
        if isinstance(self.kv_disk_gb, bool) or not isinstance(self.kv_disk_gb, (int, float)) or not 0 < self.kv_disk_gb < math.inf:
            raise ValueError(f"kv_disk_gb is {self.kv_disk_gb!r}; it must be a finite number > 0")
        if self.kv_disk_path is not None and (not isinstance(self.kv_disk_path, (str, os.PathLike)) or not str(self.kv_disk_path)):
            raise ValueError(f"kv_disk_path is {self.kv_disk_path!r}; it must be a directory path or None")
        for name in ("model", "kv_disk_path"):  # the paths: os calls refuse a NUL with a bare "embedded null byte"
            value = getattr(self, name)
            raw = os.fspath(value) if isinstance(value, (str, os.PathLike)) else ""
            if ("\0" if isinstance(raw, str) else b"\0") in raw:
                raise ValueError(f"{name} is {value!r}; a path cannot hold a NUL byte (\\x00)")
        whole_at_least("aging_steps", 0)
        _check_kv_events(self)
        for name in ("prefill_first", "enforce_eager", "async_scheduling", "allow_long_max_model_len"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is {getattr(self, name)!r}; it must be True or False")
        if self.pad_decode is not None and not isinstance(self.pad_decode, bool):
            raise ValueError(f"pad_decode is {self.pad_decode!r}; it must be True, False or None")
        _check_speculative(self)
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark is {self.watermark!r}; it must be in [0, 1)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization is {self.gpu_memory_utilization!r}; it must be in (0, 1]")

    def uses_decode_graphs(self) -> bool:
        """CUDA graphs for decode: on CUDA, with one rank, unless enforce_eager or pad_decode=False."""
        return (str(self.device).startswith("cuda") and not self.enforce_eager and self.pad_decode is not False
                and self.tensor_parallel_size == 1)  # fmt: skip

    def uses_decode_padding(self) -> bool:
        """The padded decode path: wherever graphs are, and wherever pad_decode=True asks for it (one rank:
        tensor-parallel ranks run decode steps as they come)."""
        return self.tensor_parallel_size == 1 and (self.pad_decode is True or self.uses_decode_graphs())

    def resolved_cpu_threads(self) -> int:
        """cpu_threads, else $PAGEDRS_CPU_THREADS, else 1 (see the field's comment)."""
        if self.cpu_threads is not None:
            return int(self.cpu_threads)
        env = os.environ.get(CPU_THREADS_ENV)
        if env is None or env == "":
            return 1
        try:
            value = int(env)
        except ValueError:
            value = 0
        _check_cpu_threads(f"${CPU_THREADS_ENV}", value, shown=env)
        return value


def _check_host_tier_fits(swap_space_gb: float | None, kv_host_cache_gb: float | None) -> None:
    """The host tier (swap space plus the host prefix cache) cannot be larger than the host: refused
    naming both fields. Why here: the tier's page count came out of them, and the core refused that
    count (``num_cpu_blocks ... got 262144000000``) naming a field the user never set."""
    asked = (swap_space_gb or 0) + (kv_host_cache_gb or 0)
    try:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):  # not a POSIX host: nothing to compare with
        return
    if host > 0 and asked > host:
        raise ValueError(f"swap_space_gb ({swap_space_gb}) + kv_host_cache_gb ({kv_host_cache_gb}) is {asked:g} GiB of "
                         f"host memory for the KV host tier; this host has {host:.1f} GiB: allowed at most that")


def _check_host_cache_has_pages(args: EngineArgs) -> None:
    """The host cache holds evicted prefix-cache pages: without prefix caching, or with the contiguous
    baseline, there are none, and a host cache asked for would be accepted and never used (refused).
    The disk tier's twin of this check is executor/tiers.py's ``disk_tier_refusal`` (a DiskTierError)."""
    if args.kv_layout == "paged" and args.enable_prefix_caching:
        return
    why = "enable_prefix_caching=False" if args.kv_layout == "paged" else f"kv_layout={args.kv_layout!r}"
    for name, off in (("kv_host_cache_gb", "0 or None"), ("host_cache_evicted", "False")):
        if getattr(args, name):
            raise ValueError(f"{name} is {getattr(args, name)!r} with {why}: the host cache holds evicted prefix-cache "
                             f"pages, so it needs enable_prefix_caching=True and kv_layout='paged'; allowed with "
                             f"{why}: {name}={off}")


def _check_cpu_threads(name: str, value: Any, shown: Any = None) -> None:
    """An integer from 1 to MAX_CPU_THREADS (not a bool, not 1.5: a thread count is whole)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= int(value) <= MAX_CPU_THREADS:
        raise ValueError(f"{name} is {value if shown is None else shown!r}; allowed: an integer from 1 to "
                         f"{MAX_CPU_THREADS}")


def _check_speculative(args: EngineArgs) -> None:
    """The speculative config's fields (spec/config.py), and the combinations not supported yet."""
    if args.speculative_config is None:
        return
    from pagedrs.spec.config import SpeculativeConfig

    config = SpeculativeConfig.parse(args.speculative_config)
    # tensor parallelism needs nothing of its own: rank 0 proposes and verifies, and the verify
    # rows travel to the other ranks as an ordinary multi-row step (step_codec carries logit_rows);
    # but a draft model lives in the local executor's runner (spec/draft_runner.py), not on the ranks
    draft_tp = args.tensor_parallel_size if config.method == "draft_model" and args.tensor_parallel_size > 1 else None
    refused = [("async_scheduling", args.async_scheduling, "async_scheduling=False"),
               ("tensor_parallel_size", draft_tp, "tensor_parallel_size=1 with method 'draft_model'")]
    for name, value, allowed in refused:
        if value:
            raise ValueError(f"speculative_config with {name}={value!r}: not supported yet; allowed: {allowed}, "
                             "or speculative_config=None")


_ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


def _check_kv_events(args: EngineArgs) -> None:
    """The KV-event endpoints are ZMQ addresses; a replay endpoint needs the event endpoint."""
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        value = getattr(args, name)
        if value is not None and (not isinstance(value, str) or not value.startswith(_ZMQ_TRANSPORTS)):
            raise ValueError(f"{name} is {value!r}; it must be a ZMQ address starting with "
                             f"{', '.join(_ZMQ_TRANSPORTS)} (e.g. 'tcp://*:5557'), or None")
    if args.kv_events_replay_endpoint is not None and args.kv_events_endpoint is None:
        raise ValueError(f"kv_events_replay_endpoint is {args.kv_events_replay_endpoint!r} but kv_events_endpoint is None; "
                         "replay resends published batches: set kv_events_endpoint too")
    steps = args.kv_events_buffer_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"kv_events_buffer_steps is {steps!r}; it must be an integer >= 1")
