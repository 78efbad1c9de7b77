"""A one-line description of the machine a benchmark ran on, printed with every table.

Numbers without their machine cannot be compared, so every report carries the CPU
model, the cores this process may use, its last-level cache, the torch thread count and
library versions. The cache matters: on a CPU whose L3 holds a small model's weights (an
Intel Xeon with 480 MiB, 2026-12-04, against SmolLM2's 96 MB) a decode step streams them
from the L3, above the DRAM bandwidth the benches' 1 GiB probe measures.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass

from pagedrs.engine_args import usable_cores


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    logical_cores: int  # cores this process may run on (affinity), not the host's total
    torch_threads: int
    torch_version: str
    python_version: str
    platform: str
    accelerator: str  # "cpu" or the CUDA device name
    last_level_cache: str = "cache unknown"  # e.g. "L3 480 MiB" (from sysfs)

    def describe(self) -> str:
        return (
            f"{self.cpu_model}, {self.logical_cores} cores, {self.last_level_cache}, torch {self.torch_version} "
            f"({self.torch_threads} threads), {self.accelerator}, Python {self.python_version}, "
            f"{self.platform}"
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def last_level_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> tuple[int, int]:
    """(level, bytes) of the largest-level CPU cache sysfs lists for cpu0; (0, 0) where it lists none."""
    best = (0, 0)
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return best
    for entry in entries:
        try:
            with open(f"{root}/{entry}/level", encoding="utf-8") as f:
                level = int(f.read().strip())
            with open(f"{root}/{entry}/size", encoding="utf-8") as f:
                size = f.read().strip()  # "480M", "2048K"
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        digits = size[:-1] if scale != 1 else size
        if digits.isdigit() and (level, int(digits) * scale) > best:
            best = (level, int(digits) * scale)
    return best


def _describe_cache() -> str:
    level, size = last_level_cache()
    return f"L{level} {size >> 20} MiB" if size >= 1 << 20 else (f"L{level} {size >> 10} KiB" if size else "cache unknown")


def describe_machine() -> Machine:
    import torch

    if torch.cuda.is_available():
        accelerator = torch.cuda.get_device_name(0)
    else:
        accelerator = "cpu"
    return Machine(
        cpu_model=_cpu_model(),
        logical_cores=usable_cores(),
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        platform=f"{platform.system()} {platform.release()}",
        accelerator=accelerator,
        last_level_cache=_describe_cache(),
    )
