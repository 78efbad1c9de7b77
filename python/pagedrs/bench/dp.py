"""Data-parallel replicas on Ray Serve: what routing by the cache buys (``pagedrs bench dp``).

One local Ray cluster, 2 replicas of the model, each with its own KV pool sized so that one
replica cannot hold every conversation but two can. Each routing in turn — ``cache`` (the
replicas' digests of cached block hashes, pagedrs.ray.router), ``approx`` (the same router
predicting from what it sent, never told of evictions), ``pow2`` (Ray's default, power of two
choices) and ``ray-prefix`` (Ray Serve LLM's own PrefixCacheAffinityRouter, given each prompt's
ids as text: pagedrs.ray.ray_prefix) — serves the same three workloads over HTTP through the ingress:

    multiturn   users come back with their conversation so far (a shared system prompt, then
                their own messages) plus a new message; turns interleaved across users
    shared      requests with one long system prompt and a short distinct question each
    random      random prompts: nothing to share (routing must not make it worse)

Replies are greedy; a user's next turn is its previous prompt, the reply's token ids as the
server returned them (vLLM's ``return_token_ids``) and a new message, so a turn can hit the
cache through the previous reply's pages, as a chat client's would.
Reported per routing and workload: prefill tokens computed (prompt tokens minus cached, from
each response's usage), prefix hit rate, served tokens/s (completion tokens over the wall
time), and the most requests one replica got over the mean.
"""

from __future__ import annotations

import concurrent.futures
import socket
import statistics
import time
from collections import Counter
from typing import Any

import numpy as np

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.engine_runner import progress
from pagedrs.bench.model_spec import kv_geometry, resolve_model
from pagedrs.bench.multiturn import FULL as MULTITURN_FULL
from pagedrs.bench.report import Column, markdown_table, render

ROUTINGS = ("cache", "approx", "pow2", "ray-prefix")
# The full run leaves out ``approx`` (an ablation of ``cache``: no digests), which --quick keeps:
# with bench multiturn's 48 users each routing takes about ten minutes on 2 cores.
FULL_ROUTINGS = ("cache", "pow2", "ray-prefix")
WORKLOADS = ("multiturn", "shared", "random")
# The multi-turn users are bench multiturn's own (the workload): 48 users x 4 turns, a
# 256-token system prompt, 64-token messages, 32-token replies carried into the next turn.
FULL = dict(users=MULTITURN_FULL["users"], turns=MULTITURN_FULL["turns"], system_tokens=MULTITURN_FULL["system_tokens"],
            user_tokens=MULTITURN_FULL["user_tokens"], reply_tokens=MULTITURN_FULL["reply_tokens"],
            shared_requests=48, shared_prefix=384, question_tokens=16, random_requests=32, random_tokens=128,
            concurrency=MULTITURN_FULL["concurrency"])
QUICK = dict(users=8, turns=3, system_tokens=64, user_tokens=32, reply_tokens=8, shared_requests=16,
             shared_prefix=128, question_tokens=8, random_requests=12, random_tokens=64, concurrency=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# One request of a round: (conversation, tokens). A conversation's prompt is its history so far
# (prompt and reply ids of its earlier turns) followed by ``tokens``; ``None``: ``tokens`` alone.
Turn = tuple[int | None, list[int]]


def _workloads(s: dict[str, int], vocab: int, seed: int = 0) -> tuple[dict[str, list[list[Turn]]], list[int]]:
    """Per workload, its rounds (the requests of a round run concurrently, rounds one after
    another), and the system prompt every conversation starts with."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(100, vocab - 100, n)]
    system = draw(s["system_tokens"])
    multiturn: list[list[Turn]] = [[(u, draw(s["user_tokens"])) for u in range(s["users"])] for _ in range(s["turns"])]
    prefix = draw(s["shared_prefix"])
    shared: list[list[Turn]] = [[(None, prefix + draw(s["question_tokens"])) for _ in range(s["shared_requests"])]]
    random_: list[list[Turn]] = [[(None, draw(s["random_tokens"])) for _ in range(s["random_requests"])]]
    return {"multiturn": multiturn, "shared": shared, "random": random_}, system


def oracle_prefill(rounds: list[list[Turn]], system: list[int], s: dict[str, int], block_size: int,
                   replicas: int = 2) -> int:
    """The fewest prefill tokens a router that balances load could compute on ``rounds``: every
    conversation stays on one replica and is never evicted; a prefix that first prompts share (the
    system prompt, the shared workload's prefix) is computed on each replica once, so ``replicas``
    times, after which it hits; a turn reuses every full page of the turns before it (the reply's
    last token was never fed back)."""
    held: dict[int, int] = {}  # conversation -> tokens whose K/V its replica holds
    firsts: list[list[int]] = []  # the first prompts so far
    computed = 0
    for turns in rounds:
        for user, tokens in turns:
            if user is not None and user in held:
                prompt_len = held[user] + 1 + len(tokens)  # the conversation so far, then the new message
                cached = held[user] // block_size * block_size
            else:
                prompt = (system if user is not None else []) + tokens
                prompt_len = len(prompt)
                common = [_common_pages(prompt, other, block_size) for other in firsts]
                best = max(common, default=0)
                # the shared pages are on every replica once `replicas` earlier prompts computed them
                cached = best * block_size if sum(c >= best for c in common) >= replicas else 0
                firsts.append(prompt)
            computed += prompt_len - cached
            if user is not None:
                held[user] = prompt_len + s["reply_tokens"] - 1
    return computed


def _common_pages(a: list[int], b: list[int], block_size: int) -> int:
    """Full pages ``a`` and ``b`` start with in common."""
    n = 0
    while (n + 1) * block_size <= min(len(a), len(b)) and a[n * block_size:(n + 1) * block_size] == \
            b[n * block_size:(n + 1) * block_size]:
        n += 1
    return n


def _serve_rounds(url: str, model: str, rounds: list[list[Turn]], system: list[int], s: dict[str, int],
                  replicas: int = 2) -> dict[str, Any]:
    import httpx

    counts: Counter[str] = Counter()
    prompt_tokens = cached_tokens = completion_tokens = 0
    latencies: list[float] = []
    held: list[int] = []  # per request: what its replica held when it arrived there, itself included
    history: dict[int, list[int]] = {}  # conversation -> prompt + reply ids of its turns so far

    def one(turn: Turn) -> tuple[str, dict[str, Any], float, float, int]:
        user, tokens = turn
        prompt = tokens if user is None else history.get(user, system) + tokens
        start = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": s["reply_tokens"],
                                                      "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
                       timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"bench dp: a request failed with {r.status_code}: {r.text[:300]}")
        body = r.json()
        if user is not None:  # one request per conversation in a round: no other thread writes this entry
            history[user] = body["choices"][0]["prompt_token_ids"] + body["choices"][0]["token_ids"]
        return (r.headers.get("x-pagedrs-replica", "?"), body["usage"], start, time.perf_counter(),
                int(r.headers.get("x-pagedrs-replica-load", "0")))

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(s["concurrency"]) as pool:
        for turns in rounds:
            for replica, usage, start, end, load in pool.map(one, turns):
                held.append(load)
                latency = end - start
                counts[replica] += 1
                prompt_tokens += usage["prompt_tokens"]
                cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                completion_tokens += usage["completion_tokens"]
                latencies.append(latency)
    wall = time.perf_counter() - started
    mean = sum(counts.values()) / replicas  # over every replica: one that got nothing counts too
    return {
        "prefill_tokens_computed": prompt_tokens - cached_tokens, "prompt_tokens": prompt_tokens,
        "hit_rate_pct": 100.0 * cached_tokens / max(1, prompt_tokens), "tokens_per_s": completion_tokens / wall,
        "wall_s": wall, "latency_p50_s": statistics.median(latencies), "requests_per_replica": dict(counts),
        "max_over_mean": max(counts.values()) / mean if counts else 0.0,
        # the most one replica held at once, over the mean of what the clients keep in flight
        "peak_in_flight_over_mean": max(held, default=0) / (s["concurrency"] / replicas),
    }


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    import ray
    from ray import serve

    from pagedrs import EngineArgs
    from pagedrs.ray import build_app

    s = dict(QUICK if cfg.quick else FULL)
    routings = ROUTINGS if cfg.quick else FULL_ROUTINGS
    folder = resolve_model(cfg.model, weights=True)
    geo = kv_geometry(folder, cfg.dtype)
    bs = cfg.block_size
    longest = s["system_tokens"] + s["turns"] * (s["user_tokens"] + s["reply_tokens"]) - s["reply_tokens"]  # last prompt
    conv_blocks = -(-(longest + s["reply_tokens"]) // bs)
    # One replica holds about 60% of the conversations; the two together all of them.
    blocks = max(s["concurrency"] * conv_blocks + 4, int(0.6 * s["users"] * conv_blocks))
    engine_args = EngineArgs(model=str(folder), device=cfg.device, dtype=cfg.dtype, weight_dtype="float32",
                             block_size=bs, num_gpu_blocks=blocks, kv_host_cache_gb=0, swap_space_gb=0,
                             max_model_len=max(longest, s["shared_prefix"] + s["question_tokens"]) + s["reply_tokens"] + bs,
                             max_num_seqs=s["concurrency"], cpu_threads=1)
    work, system = _workloads(s, geo.vocab_size)
    data: dict[str, Any] = {"settings": {**s, "block_size": bs, "blocks_per_replica": blocks, "replicas": 2,
                                         "conversation_blocks": conv_blocks}, "model": cfg.model, "machine": machine}
    ray.init(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for routing in routings:
            progress(f"dp: {routing}: starting 2 replicas")
            serve.run(build_app(engine_args, num_replicas=2, routing=routing, model_name="m"), name="pagedrs-dp",
                      route_prefix="/")
            for name in WORKLOADS:
                progress(f"dp: {routing}: {name}")
                data[f"{routing}/{name}"] = _serve_rounds(f"http://127.0.0.1:{port}", "m", work[name], system, s)
            serve.delete("pagedrs-dp")
    finally:
        serve.shutdown()
        ray.shutdown()
    for name in WORKLOADS:  # the bound routing is measured against (no run: the workload's arithmetic)
        data[f"oracle/{name}"] = {"prefill_tokens_computed": oracle_prefill(work[name], system, s, bs)}
    for name in WORKLOADS:
        pow2 = data[f"pow2/{name}"]
        for routing in [r for r in routings if r != "pow2"] + ["oracle"]:
            row = data[f"{routing}/{name}"]
            row["prefill_vs_pow2_x"] = row["prefill_tokens_computed"] / max(1, pow2["prefill_tokens_computed"])
            if "tokens_per_s" in row:
                row["tokens_per_s_vs_pow2_x"] = row["tokens_per_s"] / pow2["tokens_per_s"] if pow2["tokens_per_s"] else 0.0
    return data, _markdown(data, machine)


_COLUMNS = [
    Column("workload", "workload"), Column("routing", "routing"),
    Column("prefill tokens computed", "prefill_tokens_computed"), Column("vs pow2", "prefill_vs_pow2_x", "{:.2f}x"),
    Column("hit rate", "hit_rate_pct", "{:.1f}%"), Column("tokens/s", "tokens_per_s", "{:.1f}"),
    Column("vs pow2", "tokens_per_s_vs_pow2_x", "{:.2f}x"), Column("requests max/mean", "max_over_mean", "{:.2f}"),
    Column("in flight max/mean", "peak_in_flight_over_mean", "{:.2f}"),
]


def _markdown(data: dict[str, Any], machine: str) -> str:
    rows = [{"workload": w, "routing": r if r != "oracle" else "bound (balanced, never evicted)", **data[f"{r}/{w}"]}
            for w in WORKLOADS for r in (*ROUTINGS, "oracle") if f"{r}/{w}" in data]
    s = data["settings"]
    notes = [
        f"2 replicas on a local Ray cluster, {s['blocks_per_replica']} blocks of {s['block_size']} tokens each (a "
        f"conversation reaches {s['conversation_blocks']}); {s['concurrency']} requests in flight; greedy, "
        f"{s['reply_tokens']} tokens per reply.",
        f"multiturn: {s['users']} users x {s['turns']} turns, system prompt {s['system_tokens']} tokens, "
        f"messages {s['user_tokens']}, each turn's prompt carrying the earlier replies' token ids; shared: {s['shared_requests']} requests on a {s['shared_prefix']}-token prefix; "
        f"random: {s['random_requests']} prompts of {s['random_tokens']}.",
        "'bound': the fewest prefill tokens a router that uses every replica could compute (bench/dp.py "
        "oracle_prefill: each conversation on one replica, never evicted, a shared prefix computed once per "
        "replica); a router that sends everything to one replica can go below it, at the price of the load.",
        "Goals (issue 28): cache routing's prefill tokens <= 0.6x pow2's and tokens/s >= 1.3x on multiturn; never "
        "worse than pow2 on random; no replica over 1.5x the mean requests. 'requests max/mean': of all requests "
        "(a replica whose hits finish sooner serves more); 'in flight max/mean': the most requests one replica "
        "held at once (its own count) over concurrency / replicas: what the bounded-load rule caps (ceil(1.25 x the "
        "mean)).",
        "tokens/s comes from one run per routing, one after another: on a shared machine it moves with the load; "
        "prefill tokens and hit rates do not.",
        f"Model {data['model']}.",
    ]
    return render("Data-parallel replicas on Ray Serve: routing by the cache", markdown_table(rows, _COLUMNS), notes,
                  machine)
