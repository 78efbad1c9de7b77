"""``bench dp``'s conversations, against one server without Ray: each turn's prompt is the
previous prompt, the previous reply's ids and a new message, and with one request at a time
every turn after the first finds in the cache exactly the full pages of what came before
(the system prompt for a user's first turn, once one user has sent it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

from pagedrs.bench.dp import _serve_rounds, _workloads, oracle_prefill  # noqa: E402
from server_fakes import assert_nothing_left, live_server  # noqa: E402

BS = 8
SETTINGS = dict(users=3, turns=3, system_tokens=20, user_tokens=6, reply_tokens=5, shared_requests=2,
                shared_prefix=16, question_tokens=4, random_requests=2, random_tokens=8, concurrency=1)
ENGINE_KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=BS, num_gpu_blocks=64, max_num_seqs=4,
                                 max_model_len=128, swap_space_gb=0.01)


def test_turns_carry_the_replies_and_hit_the_cache_through_them(tiny_llama_dir: Path) -> None:
    s = SETTINGS
    work, system = _workloads(s, vocab=256)
    with live_server(tiny_llama_dir, ENGINE_KW, "m") as live:
        got = _serve_rounds(live.url, "m", work["multiturn"], system, s, replicas=1)
        shared = _serve_rounds(live.url, "m", work["shared"], system, s, replicas=1)
        assert_nothing_left(live.loop)
    per_turn = s["user_tokens"] + s["reply_tokens"]
    prompts = [s["system_tokens"] + t * per_turn + s["user_tokens"] for t in range(s["turns"])]
    assert got["prompt_tokens"] == s["users"] * sum(prompts), "each turn's prompt holds every earlier reply"
    cached = 0
    for t in range(s["turns"]):
        for u in range(s["users"]):
            if t == 0:  # the system prompt's full pages, once the first user has computed them
                cached += 0 if u == 0 else (s["system_tokens"] // BS) * BS
            else:  # everything before, but the last reply token (never fed back) and a partial page
                cached += ((prompts[t - 1] + s["reply_tokens"] - 1) // BS) * BS
    assert got["prefill_tokens_computed"] == got["prompt_tokens"] - cached
    # the bound bench dp reports is this arithmetic: one replica, nothing evicted, is exactly it
    assert oracle_prefill(work["multiturn"], system, s, BS, replicas=1) == got["prefill_tokens_computed"]
    assert oracle_prefill(work["shared"], system, s, BS, replicas=1) == shared["prefill_tokens_computed"]
    assert got["max_over_mean"] == 1.0 and got["requests_per_replica"] == {"?": s["users"] * s["turns"]}


def test_the_bound_computes_a_shared_prefix_once_per_replica():
    s = dict(SETTINGS, shared_requests=5)
    work, system = _workloads(s, vocab=256)
    one, two = (oracle_prefill(work["shared"], system, s, BS, replicas=r) for r in (1, 2))
    shared_pages = s["shared_prefix"] // BS * BS
    assert two - one == shared_pages, "the second replica computes the shared pages once more"
    assert oracle_prefill(work["random"], system, s, BS) == s["random_requests"] * s["random_tokens"]
