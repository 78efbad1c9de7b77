"""pagedrs: an LLM inference engine on a paged KV cache.

The memory core (page pool, block tables, prefix cache, swap tiers, scheduler)
is Rust, in the private native module ``pagedrs._core``; this package is the
public face. Heavy parts (torch, transformers) load lazily so that
``import pagedrs`` stays cheap and works without a GPU or CuPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedrs._core import BlockManager, OutOfBlocksError

__version__ = "0.1.0"

__all__ = [
    "BlockManager",
    "OutOfBlocksError",
    "LLM",
    "Engine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]

# name -> module that defines it; imported on first access (PEP 562).
_LAZY = {
    "LLM": "pagedrs.llm",
    "Engine": "pagedrs.engine",
    "EngineArgs": "pagedrs.engine_args",
    "SamplingParams": "pagedrs.sampling_params",
    "RequestOutputKind": "pagedrs.sampling_params",
    "StructuredOutputsParams": "pagedrs.sampling_params",
    "BeamSearchParams": "pagedrs.beam_search",
    "BeamSearchOutput": "pagedrs.beam_search",
    "BeamSearchSequence": "pagedrs.beam_search",
    "RequestOutput": "pagedrs.outputs",
    "CompletionOutput": "pagedrs.outputs",
}

if TYPE_CHECKING:  # pragma: no cover
    from pagedrs.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from pagedrs.engine import Engine
    from pagedrs.engine_args import EngineArgs
    from pagedrs.llm import LLM
    from pagedrs.outputs import CompletionOutput, RequestOutput
    from pagedrs.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedrs' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
