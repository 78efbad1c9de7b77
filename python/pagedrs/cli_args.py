"""The engine flags every engine-running command shares (generate, chat, serve), and their mapping.

One definition, so ``pagedrs serve --admission-policy`` and ``pagedrs generate
--admission-policy`` cannot drift apart: each flag maps one-to-one onto an ``EngineArgs``
field and takes its default from that field, so the command line and the Python API agree
on every default too. The few defaults a command chooses differently (``serve``: every core
and prefill-first on the CPU, because a server owns its machine and its requests arrive
while others decode) are applied by that command on top of ``engine_kwargs``.

Fields without a flag are API-only knobs (``watermark``, ``aging_steps``, ``max_n``,
``contiguous_reserve``, ``host_cache_evicted``); ``seed`` and ``skip_tokenizer_init`` are
``serve`` flags, because ``generate --seed`` is the sampling seed and the offline commands
need a tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from pagedrs.engine_args import KV_CACHE_DTYPES, WEIGHT_DTYPES, EngineArgs

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}

# flag dest -> EngineArgs field, for flags whose dest is the field's name (the rest are mapped by hand)
_SAME_NAME = (
    "model", "device", "dtype", "weight_dtype", "block_size", "num_gpu_blocks", "kv_cache_memory",
    "gpu_memory_utilization", "swap_space_gb", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
    "allow_long_max_model_len",
    "preemption_mode", "admission_policy", "kv_layout", "cpu_threads", "tensor_parallel_size", "distributed_executor_backend",
    "kv_host_cache_gb", "kv_disk_path", "kv_disk_gb", "async_scheduling", "eviction_policy", "kv_cache_dtype",
    "enforce_eager", "max_pinned_fraction", "speculative_config",
    "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_buffer_steps", "structured_outputs_backend",
)


def add_engine_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, cpu_threads_help: str) -> None:
    """The shared engine flags; ``cpu_threads_help`` says the command's own default thread count."""
    d = _DEFAULTS
    p.add_argument("--model", default=d["model"], help="preset name, HF folder or .gguf file (default: %(default)s)")
    p.add_argument("--device", default=d["device"])
    p.add_argument("--dtype", default=d["dtype"], choices=["float32", "float16", "bfloat16"])
    p.add_argument("--weight-dtype", default=d["weight_dtype"], choices=WEIGHT_DTYPES,
                   help="linear weights: auto = exact for HF folders, nearest quantized format for a quantized GGUF")
    p.add_argument("--block-size", type=int, default=d["block_size"])
    p.add_argument("--num-gpu-blocks", type=int, default=d["num_gpu_blocks"],
                   help="device KV pages (overrides --kv-cache-memory)")
    p.add_argument("--kv-cache-memory", type=int, default=d["kv_cache_memory"], help="bytes for the device KV pool")
    p.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"])
    p.add_argument("--swap-space-gb", type=float, default=d["swap_space_gb"],
                   help="host tier for swapped pages (default: 1 GiB on CUDA, 0 on the CPU, where host and device are one RAM)")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"])
    p.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"])
    p.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                   help="tokens a sequence may reach (default: the model's context length)")
    p.add_argument("--allow-long-max-model-len", action="store_true",
                   help="allow --max-model-len past the model's context length (untrained positions; vLLM's "
                        "VLLM_ALLOW_LONG_MAX_MODEL_LEN)")
    p.add_argument("--preemption-mode", default=d["preemption_mode"], choices=["auto", "swap", "recompute"])
    p.add_argument(
        "--admission-policy", default=d["admission_policy"], choices=["expected_growth", "prompt_only"],
        help="admit a prompt only beside the running set's expected growth (default), or on its own pages",
    )
    p.add_argument(
        "--prefill-first", action=argparse.BooleanOptionalAction, default=None,
        help="a step that can admit a waiting prompt runs it without the running decodes (never two such steps "
        "in a row): a new request's first token costs its prefill alone. Default: on for `serve --device cpu`, "
        "where a step costs the sum of its parts (measured: steady TTFT p50 -30%%, throughput unchanged), "
        "off elsewhere (a GPU runs decodes beside a prefill almost for free)",
    )
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (no CUDA graphs for decode steps); ignored on the CPU")
    p.add_argument(
        "--async-scheduling", action="store_true",
        help="plan and launch step N+1 before step N is sampled (vLLM's async scheduling): the device does not wait "
        "for the host's sampling and outputs; same outputs. Not with --tensor-parallel-size > 1 or --kv-disk-path",
    )
    p.add_argument("--speculative-config", type=_json_object, default=d["speculative_config"],
                   help='speculative decoding as JSON, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_max": 4}\' (default: off)')
    p.add_argument("--kv-layout", default=d["kv_layout"], choices=["paged", "contiguous"])
    p.add_argument("--structured-outputs-backend", default=d["structured_outputs_backend"],
                   choices=["llguidance", "xgrammar"],
                   help="the grammar engine of structured outputs and forced tool calls (xgrammar: pip install xgrammar)")
    p.add_argument("--eviction-policy", default=d["eviction_policy"], choices=["lru", "lfu"],
                   help="which cached prefix page goes first: least recently used (default) or least "
                   "frequently used with aging (SGLang's --radix-eviction-policy lfu)")
    p.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"], choices=list(KV_CACHE_DTYPES),
                   help="KV pages in the model dtype (auto) or 8-bit fp8 with per-tensor scales (2x bf16's tokens)")
    p.add_argument("--max-pinned-fraction", type=float, default=d["max_pinned_fraction"],
                   help="pinned prefixes (POST /v1/cache/pin, --pin-prefix) may hold at most this fraction of the "
                   "device pool, in (0, 1]; a pin past it is refused with 409 (default: %(default)s)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--cpu-threads", type=int, default=d["cpu_threads"], help=cpu_threads_help)
    _add_parallel_and_tier_args(p)


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object flag (``--speculative-config``); its fields are checked by EngineArgs."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"method\": \"ngram\", ...}}', got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineArgs`` fields from flags ``add_engine_args`` added; an unset ``--prefill-first`` is left out
    (the field's default applies unless the command sets its own)."""
    kwargs: dict[str, Any] = {name: getattr(args, name) for name in _SAME_NAME}
    kwargs["enable_prefix_caching"] = not args.no_prefix_caching
    if args.prefill_first is not None:
        kwargs["prefill_first"] = args.prefill_first
    return kwargs


def _add_parallel_and_tier_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    d = _DEFAULTS
    p.add_argument("--tensor-parallel-size", type=int, default=d["tensor_parallel_size"],
                   help="ranks of tensor parallelism (torch.distributed: gloo on the CPU, NCCL on CUDA)")
    p.add_argument("--distributed-executor-backend", default=d["distributed_executor_backend"], choices=["mp", "ray"],
                   help="how ranks 1..N-1 start: mp = processes on this machine; ray = Ray actors in a placement "
                   "group, on any node of the Ray cluster (default: %(default)s)")
    p.add_argument("--kv-host-cache-gb", type=float, default=d["kv_host_cache_gb"],
                   help="host tier for evicted prefix pages (default: min(4 GiB, 10%% of available RAM) on CUDA, "
                   "0 on the CPU; 0 = off)")
    p.add_argument("--kv-disk-path", default=d["kv_disk_path"], help="directory of the persistent disk page tier (default: off)")
    p.add_argument("--kv-disk-gb", type=float, default=d["kv_disk_gb"], help="size of the disk page tier (default: %(default)s)")
    p.add_argument("--kv-events-endpoint", default=d["kv_events_endpoint"],
                   help="publish vLLM-format KV events (BlockStored/BlockRemoved/AllBlocksCleared) for routers over "
                   "ZMQ PUB here, e.g. tcp://*:5557 (default: off)")
    p.add_argument("--kv-events-replay-endpoint", default=d["kv_events_replay_endpoint"],
                   help="ZMQ ROUTER address that resends missed event batches by sequence number, e.g. tcp://*:5558")
    p.add_argument("--kv-events-buffer-steps", type=int, default=d["kv_events_buffer_steps"],
                   help="event batches kept for replay (default: %(default)s)")
