"""Command-line flags every engine-running command shares (generate, chat, demo, serve).

One definition, so ``pagedrs serve --kv-disk-path`` and ``pagedrs generate --kv-disk-path``
cannot drift apart; each maps one-to-one onto an ``EngineArgs`` field.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parallel_and_tier_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks of tensor parallelism (torch.distributed: gloo on the CPU, NCCL on CUDA)")
    p.add_argument("--kv-host-cache-gb", type=float, default=None,
                   help="host tier for evicted prefix pages (default: min(4 GiB, 10%% of available RAM); 0 = off)")
    p.add_argument("--kv-disk-path", default=None, help="directory of the persistent disk page tier (default: off)")
    p.add_argument("--kv-disk-gb", type=float, default=8.0, help="size of the disk page tier (default: %(default)s)")


def parallel_and_tier_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "kv_host_cache_gb": args.kv_host_cache_gb,
        "kv_disk_path": args.kv_disk_path,
        "kv_disk_gb": args.kv_disk_gb,
    }
