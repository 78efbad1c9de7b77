class Sig(BaseException):
    pass

import pytest

from pagedrs import SamplingParams
from pagedrs.core import fast_rows
from test_engine import make_engine, make_prompts


@pytest.mark.leaves_requests
@pytest.mark.parametrize("async_", [False, True])
def test_kbd_in_sampling(tiny_llama_dir, monkeypatch, async_):
    probe = make_engine(tiny_llama_dir)
    prompts = make_prompts(probe, 3, seed=3)
    def run(engine, interrupt_at=None):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        real = fast_rows.draw
        n = {"k": 0}
        def draw(*a, **k):
            n["k"] += 1
            if n["k"] == interrupt_at:
                raise Sig()
            return real(*a, **k)
        monkeypatch.setattr(fast_rows, "draw", draw)
        done = {}
        log = []
        for it in range(60):
            if not engine.has_unfinished():
                break
            try:
                outs = engine.step()
            except Sig:
                log.append(f"{it}: interrupted")
                continue
            except Exception as e:
                log.append(f"{it}: {type(e).__name__} {e}")
                continue
            log.append(f"{it}: {[(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in outs]}")
            for o in outs:
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        monkeypatch.setattr(fast_rows, "draw", real)
        return done, log
    clean, _ = run(make_engine(tiny_llama_dir, async_scheduling=async_))
    got, log = run(make_engine(tiny_llama_dir, async_scheduling=async_), interrupt_at=4)
    print("\n".join(log[:14]))
    for r in clean:
        print(r, clean[r], got.get(r))
    assert got == clean
