"""The imported modules' objects out of the cyclic collector's full collections, once per process.

A process that has imported torch, transformers and the engine holds ~227k objects that live as
long as it does (modules, functions, classes, their dicts). CPython's full (generation 2)
collection walks every one of them whenever the long-lived heap has grown by a quarter; during
a serving loop that growth comes from requests, so every few hundred steps one step stalls on
it: ~90 ms at batch 256 in-process on a 2-core Xeon, where the step itself takes ~5 ms
(``benches``-style probe in this module's test). ``gc.freeze()`` moves what exists now to the
permanent generation, which collections skip.

vLLM freezes the whole heap after its engine core starts, and so do this project's server,
core process and Ray replica (each owns its engine for life). An in-process ``Engine`` or
``LLM`` cannot do that: the engine's own objects are in reference cycles (the core, its
executor and its fast rows refer to each other), so a frozen engine that its user drops is
never freed: its weights and KV cache would leak. So this freezes once per process, before the
first in-process engine builds anything: the imports (98% of the objects) are frozen, every
engine's own objects stay collectable, and a later engine freezes nothing more (a first
engine still alive then would otherwise be frozen with its cycles).

What it costs a host application: its own objects alive at that moment are frozen too; one that
later becomes cyclic garbage is not reclaimed until ``gc.unfreeze()``. A process that manages
the collector itself (``gc.disable()`` when its first engine is built) is left alone for good: a
freeze at a later engine would take the first one's cycles with it.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_done = False


def freeze_imports_once() -> bool:
    """Collects, then freezes what exists, the first time it is called in this process (not at all
    if the collector is disabled then); True when it froze now."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
        if not gc.isenabled():
            return False
        gc.collect()
        gc.freeze()
        return True
