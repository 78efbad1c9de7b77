"""Options shared by every benchmark, parsed once by ``pagedrs.bench.main``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchConfig:
    model: str  # "smollm2-135m", a Hugging Face model folder, or a .gguf file
    quick: bool  # small workloads that finish in minutes on 2 CPU cores
    num_requests: int | None  # overrides the preset's request count
    out_dir: str | None  # JSON + markdown per benchmark
    plot_dir: str | None  # PNG charts
    json_path: str | None  # the benchmark's JSON result, also here
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    weight_dtype: str | None = None  # decode bench: one format instead of its grid
    serve_workloads: tuple[str, ...] = ("random", "prefix")  # serve bench: which workloads
    serve_offline: bool = True  # serve bench: also run the offline engine on each workload
    serve_args: tuple[str, ...] = ()  # serve bench: extra `pagedrs serve` flags
    layers: int | None = None  # overhead bench: the deep model's layers (default SmolLM2's 30)
    draft_model: str | None = None  # spec bench: also speculate with this draft model (method draft_model)
    llama_bench: str | None = None  # decode bench: llama.cpp's llama-bench binary, run on the same GGUF (llama_cpp.py)
    plot: bool = True  # map bench: draw its heatmaps (False: JSON and markdown only, no matplotlib)
