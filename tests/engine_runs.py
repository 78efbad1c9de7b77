"""Running an engine's requests to their end, for tests that compare what two engines decode."""

from __future__ import annotations

from typing import Any

from pagedrs import Engine


def drain(engine: Engine, max_steps: int = 100_000) -> dict[str, Any]:
    """Steps until no request is left (checking the engine's invariants after each step; at most
    ``max_steps``); each request's final ``RequestOutput`` by id, failed ones included."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        engine.check_invariants()
    return done


def final_outputs(engine: Engine, prompts: list[Any], params: Any) -> list[Any]:
    """Adds one request per prompt (ids ``r0``, ``r1``, ...), steps until none is left (``drain``) and
    returns each request's final ``RequestOutput`` in prompt order; every request must end without an error."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = drain(engine)
    outs = [done[f"r{i}"] for i in range(len(prompts))]
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return outs


def greedy_tokens(engine: Engine, prompts: list[Any], params: Any) -> list[list[int]]:
    """``final_outputs``' first sample's token ids, per prompt."""
    return [list(o.outputs[0].token_ids) for o in final_outputs(engine, prompts, params)]
