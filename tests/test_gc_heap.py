"""The import heap is frozen once per process, before the first in-process engine, and engines stay
collectable (pagedrs/gc_heap.py). Each case runs in its own interpreter: the freeze is per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = textwrap.dedent("""
    import gc, tempfile, weakref
    from pathlib import Path
    from pagedrs.bench.overhead import OverheadSpec, write_model, build_overhead_engine
    folder = write_model(Path(tempfile.mkdtemp()), 1)
    spec = OverheadSpec(layers=1, batch_sizes=(2,), steps=2, warmup_steps=1)

    def engine_and_refs():
        engine = build_overhead_engine(folder, spec)
        core = engine.client.core
        return engine, [weakref.ref(core.executor), weakref.ref(core.executor.runner), weakref.ref(core.fast_rows)]
""")


def run(body: str) -> str:
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_first_engine_freezes_the_imports_and_engines_stay_collectable() -> None:
    out = run("""
        assert gc.get_freeze_count() == 0
        first, first_refs = engine_and_refs()
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # torch's and the engine's modules at least
        # the first engine's own objects were made after the freeze: none of them is frozen
        second, second_refs = engine_and_refs()
        assert gc.get_freeze_count() == frozen, "a second engine froze again (the first one's cycles with it)"
        # the engines are in reference cycles (the reason the whole heap is not frozen): dropped,
        # the collector frees them, the one that was alive while the other was built included
        del first, second
        gc.collect()
        alive = [r() is not None for r in first_refs + second_refs]
        assert not any(alive), alive
        print("ok", frozen)
    """)
    assert out.startswith("ok")


def test_a_process_that_disabled_the_collector_is_left_alone() -> None:
    out = run("""
        gc.disable()
        engine, refs = engine_and_refs()
        assert gc.get_freeze_count() == 0
        gc.enable()
        engine2, _ = engine_and_refs()  # enabled again: still nothing frozen (it would take the first engine's cycles)
        assert gc.get_freeze_count() == 0
        del engine, engine2
        gc.collect()
        assert all(r() is None for r in refs)
        print("ok")
    """)
    assert out.startswith("ok")
