"""OpenAI-compatible HTTP serving for pagedrs (FastAPI + uvicorn, the `serve` extra).

``main(argv)`` is what `pagedrs serve` runs. ``build_app`` and ``EngineLoop`` let a
program embed the server around an Engine it built itself; ``BackgroundServer``
runs such an app on a thread (tests, notebooks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedrs.server.cli import main

__all__ = ["BackgroundServer", "EngineLoop", "build_app", "main"]

_LAZY = {
    "BackgroundServer": "pagedrs.server.background",
    "EngineLoop": "pagedrs.server.engine_loop",
    "build_app": "pagedrs.server.app",
}

if TYPE_CHECKING:  # pragma: no cover
    from pagedrs.server.app import build_app
    from pagedrs.server.background import BackgroundServer
    from pagedrs.server.engine_loop import EngineLoop


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedrs.server' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
