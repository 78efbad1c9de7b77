"""``python -m pagedrs.kernels --check``: compile every dispatch-table instance with NVRTC, no GPU needed.

One translation unit per architecture holds every template instance (faster than
one compile per entry); the architectures compile in parallel threads (ctypes
releases the GIL). ptxas runs too (``--ptxas-options=-v``) so the table shows
registers, shared memory and spills per kernel. Any compiler output other than
ptxas' info lines counts as a warning and fails the check.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pagedrs.kernels import dispatch, nvrtc, sources

ARCHS: tuple[str, ...] = ("sm_80", "sm_90")
_ENTRY = re.compile(r"Compiling entry function '(\S+)' for")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_INFO = re.compile(r"^ptxas(\s+info\s*:|\s+\.)")


@dataclass(frozen=True)
class KernelReport:
    kernel: str  # name expression
    arch: str
    registers: int | None
    smem_bytes: int
    spill_bytes: int
    status: str  # "ok" or what went wrong


def compile_arch(arch: str, name_expressions: list[str]) -> tuple[list[KernelReport], list[str]]:
    """Compiles all instances for ``arch`` to a cubin; returns per-kernel reports and warning lines."""
    options = [*sources.BASE_OPTIONS, f"--gpu-architecture={arch}", "--ptxas-options=-v"]
    result = nvrtc.compile_source(sources.translation_unit(), "pagedrs_kernels.cu", sources.headers(), name_expressions, options)
    if not result.ok:
        return [KernelReport(e, arch, None, 0, 0, "compile error") for e in name_expressions], result.log.splitlines()
    stats: dict[str, tuple[int, int, int]] = {}
    warnings: list[str] = []
    current = ""
    for line in result.log.splitlines():
        if not line.strip():
            continue
        if not _INFO.match(line):
            warnings.append(line)
        if m := _ENTRY.search(line):
            current = m.group(1)
            stats[current] = (0, 0, 0)
        elif m := _SPILL.search(line):
            regs, smem, _ = stats.get(current, (0, 0, 0))
            stats[current] = (regs, smem, int(m.group(1)) + int(m.group(2)))
        elif m := _USED.search(line):
            _, _, spill = stats.get(current, (0, 0, 0))
            smem_match = _SMEM.search(line)
            stats[current] = (int(m.group(1)), int(smem_match.group(1)) if smem_match else 0, spill)
    reports = []
    for expr in name_expressions:
        mangled = result.lowered_names.get(expr, "")
        found = stats.get(mangled)
        if found is None:
            reports.append(KernelReport(expr, arch, None, 0, 0, "missing from ptxas output"))
        else:
            regs, smem, spill = found
            reports.append(KernelReport(expr, arch, regs, smem, spill, "ok" if not warnings else "warning"))
    return reports, warnings


def run_check(archs: tuple[str, ...] = ARCHS) -> int:
    """Prints the table; returns the process exit status (0 only when everything compiled cleanly)."""
    exprs = dispatch.all_name_expressions()
    major, minor = nvrtc.version()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(archs)) as pool:
        results = list(pool.map(lambda a: compile_arch(a, exprs), archs))
    elapsed = time.perf_counter() - start
    print(f"NVRTC {major}.{minor}; {len(exprs)} kernel instances x {len(archs)} archs; sources {sources.cuda_dir()}")
    width = max(len(e) for e in exprs)
    print(f"{'kernel':<{width}}  {'arch':<5}  {'regs':>4}  {'smem':>6}  {'spill':>5}  status")
    failures = 0
    for reports, warnings in results:
        for r in reports:
            regs = "-" if r.registers is None else str(r.registers)
            print(f"{r.kernel:<{width}}  {r.arch:<5}  {regs:>4}  {r.smem_bytes:>6}  {r.spill_bytes:>5}  {r.status}")
            failures += r.status != "ok"
        for line in warnings:
            print(f"  compiler: {line}")
    print(f"{len(exprs) * len(archs) - failures}/{len(exprs) * len(archs)} ok in {elapsed:.1f} s")
    return 1 if failures else 0
