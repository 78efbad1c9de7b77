"""A one-line description of the machine a benchmark ran on, printed with every table.

Numbers without their machine cannot be compared, so every report carries the CPU
model, the cores this process may use, the torch thread count and library versions.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    logical_cores: int  # cores this process may run on (affinity), not the host's total
    torch_threads: int
    torch_version: str
    python_version: str
    platform: str
    accelerator: str  # "cpu" or the CUDA device name

    def describe(self) -> str:
        return (
            f"{self.cpu_model}, {self.logical_cores} cores, torch {self.torch_version} "
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


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def describe_machine() -> Machine:
    import torch

    if torch.cuda.is_available():
        accelerator = torch.cuda.get_device_name(0)
    else:
        accelerator = "cpu"
    return Machine(
        cpu_model=_cpu_model(),
        logical_cores=_usable_cores(),
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        platform=f"{platform.system()} {platform.release()}",
        accelerator=accelerator,
    )
