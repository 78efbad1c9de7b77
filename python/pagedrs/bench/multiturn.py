"""Multi-turn chat: users come back to conversations the device has long evicted.

A seeded workload: U users, T turns each. Turn t of a user is its whole conversation so
far (a system prompt all users share, then its own user messages and the engine's
greedy replies) plus a new user message. Users are interleaved (round t serves every
user's turn t, in order, at most ``concurrency`` at a time), and the device pool holds
about a quarter of the live conversations, so by the time a user returns, the device
has evicted most of its pages. The tier sets compared:

    device only       evicted pages are gone: every return recomputes the conversation
    +host             evicted pages go to a host pool that holds every conversation
    +host+disk        a host pool for a quarter of the conversations; pages evicted from
                      it go on to a disk store
    warm restart      +host+disk, the engine shut down after turn 2 and a new one started
                      on the same store (device and host empty, the disk store reopened)

Every set runs under the default eviction policy (LRU); ``device`` and ``+host+disk`` run
again under LFU with aging (``EngineArgs.eviction_policy="lfu"``), so the table compares the
two policies' hit rates on the same conversations.

Reported per set: prefix hit rate by tier (hit blocks / queried blocks), prefill tokens
computed, KV bytes moved between tiers, output tokens/s and time to first token
(median, p99; from a request's submission). Greedy outputs are identical in every set
(the engine is exact), so every set runs the very same conversations.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedrs.bench.config import BenchConfig
from pagedrs.bench.engine_runner import build_engine, greedy_params, progress, warm_up
from pagedrs.bench.model_spec import kv_geometry, resolve_model
from pagedrs.bench.report import Column, markdown_table, render

FULL = dict(users=48, turns=4, system_tokens=256, user_tokens=64, reply_tokens=32, concurrency=4)
QUICK = dict(users=8, turns=3, system_tokens=64, user_tokens=32, reply_tokens=8, concurrency=2)
SETS = ("device", "host", "host_disk", "warm_restart")
POLICY_SETS = {"device_lfu": "device", "host_disk_lfu": "host_disk"}  # run under LFU: set -> its LRU twin
_COUNTERS = ("prefix_queries", "prefix_hits", "prefix_hits_device", "prefix_hits_host", "prefix_hits_disk",
             "num_prompt_tokens_computed", "num_generated_tokens", "kv_bytes_to_host", "kv_bytes_from_host",
             "kv_bytes_to_disk", "kv_bytes_from_disk")


@dataclass
class Conversations:
    """The seeded messages and, as the run goes, each user's conversation so far."""

    system: list[int]
    messages: list[list[list[int]]]  # [user][turn] -> user message tokens
    history: list[list[int]]  # [user] -> tokens so far (system + messages + replies)

    @classmethod
    def make(cls, s: dict[str, int], vocab: int, seed: int = 0) -> Conversations:
        rng = np.random.default_rng(seed)

        def draw(n: int) -> list[int]:
            return [int(t) for t in rng.integers(100, vocab - 100, n)]
        system = draw(s["system_tokens"])
        messages = [[draw(s["user_tokens"]) for _ in range(s["turns"])] for _ in range(s["users"])]
        return cls(system, messages, [list(system) for _ in range(s["users"])])


def _run_turns(engine: Any, conv: Conversations, turns: range, s: dict[str, int], ttft: list[float]) -> None:
    """Every user's turn t for t in turns, users in order, at most `concurrency` in flight."""
    answered: set[str] = set()
    for t in turns:
        queue = list(range(s["users"]))
        in_flight: dict[str, tuple[int, list[int], float]] = {}
        while queue or in_flight:
            while queue and len(in_flight) < s["concurrency"]:
                u = queue.pop(0)
                prompt = conv.history[u] + conv.messages[u][t]
                rid = f"u{u}-t{t}"
                engine.add_request(rid, {"prompt_token_ids": prompt}, greedy_params(s["reply_tokens"]))
                in_flight[rid] = (u, prompt, time.perf_counter())
            for out in engine.step():
                if out.request_id not in in_flight:
                    continue
                if out.error:
                    raise RuntimeError(f"request {out.request_id} failed in the engine: {out.error}")
                u, prompt, submitted = in_flight[out.request_id]
                if out.outputs[0].token_ids and out.request_id not in answered:
                    answered.add(out.request_id)
                    ttft.append(time.perf_counter() - submitted)
                if out.finished:
                    conv.history[u] = prompt + list(out.outputs[0].token_ids)
                    del in_flight[out.request_id]
        progress(f"turn {t + 1} of {s['turns']} done")


def _counters(engine: Any) -> dict[str, float]:
    stats = engine.stats()
    return {k: float(stats[k]) for k in _COUNTERS}


def _run_set(name: str, cfg: BenchConfig, s: dict[str, int], vocab: int, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    conv = Conversations.make(s, vocab)
    ttft: list[float] = []
    totals = dict.fromkeys(_COUNTERS, 0.0)
    wall = 0.0
    restart_info: dict[str, Any] = {}
    phases = [range(s["turns"])] if name != "warm_restart" else [range(2), range(2, s["turns"])]
    history_at_restart: list[list[int]] = []
    for i, turns in enumerate(phases):
        engine = build_engine(cfg.model, **engine_kwargs)
        warm_up(engine, vocab)
        before = _counters(engine)
        start = time.perf_counter()
        if i == 1:
            restart_info["pages_on_disk_at_restart"] = int(engine.stats()["num_cached_disk_blocks"])
            _run_turns(engine, conv, turns[:1], s, ttft)
            # The pages written before the restart that this turn reads again: every
            # committed full block of each user's conversation as it stood (all tokens
            # but the last reply token, whose K/V is never computed).
            written = sum((len(h) - 1) // cfg.block_size for h in history_at_restart)
            hits = _counters(engine)["prefix_hits"] - before["prefix_hits"]
            restart_info["restart_hit_pct"] = 100.0 * hits / written
            turns = turns[1:]
        _run_turns(engine, conv, turns, s, ttft)
        wall += time.perf_counter() - start
        after = _counters(engine)
        for k in _COUNTERS:
            totals[k] += after[k] - before[k]
        history_at_restart = [list(h) for h in conv.history]
        engine.shutdown()
        del engine
        gc.collect()
    q = totals["prefix_queries"] or 1.0
    moved = sum(totals[k] for k in ("kv_bytes_to_host", "kv_bytes_from_host", "kv_bytes_to_disk", "kv_bytes_from_disk"))
    return {
        "hit_rate_pct": 100.0 * totals["prefix_hits"] / q,
        "hit_device_pct": 100.0 * totals["prefix_hits_device"] / q,
        "hit_host_pct": 100.0 * totals["prefix_hits_host"] / q,
        "hit_disk_pct": 100.0 * totals["prefix_hits_disk"] / q,
        "prefill_tokens_computed": int(totals["num_prompt_tokens_computed"]),
        "bytes_moved": int(moved),
        "output_tokens": int(totals["num_generated_tokens"]),
        "tokens_per_s": totals["num_generated_tokens"] / wall if wall else 0.0,
        "ttft_p50_s": float(np.median(ttft)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "wall_s": wall,
        **restart_info,
    }


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    s = dict(QUICK if cfg.quick else FULL)
    if cfg.num_requests is not None:
        s["users"] = cfg.num_requests
    folder = resolve_model(cfg.model)
    geo = kv_geometry(folder, cfg.dtype)
    bs = cfg.block_size
    final_len = s["system_tokens"] + s["turns"] * (s["user_tokens"] + s["reply_tokens"])
    conv_blocks = -(-final_len // bs)
    device_blocks = max(s["concurrency"] * conv_blocks + 2, s["users"] * conv_blocks // 4)
    bytes_per_block = geo.bytes_per_token * bs
    # +host: a host tier that holds every conversation (as the 4 GiB default does on a GPU
    # machine); +host+disk: a quarter of them on the host, the rest left to the disk.
    all_gb = s["users"] * conv_blocks * bytes_per_block / 2**30
    host_gb = {"device": 0.0, "host": all_gb, "host_disk": all_gb / 4, "warm_restart": all_gb / 4}
    disk_gb = 2 * s["users"] * s["turns"] * conv_blocks * bytes_per_block / 2**30
    common = dict(device=cfg.device, dtype=cfg.dtype, block_size=bs, num_gpu_blocks=device_blocks,
                  max_model_len=final_len + bs, swap_space_gb=0, max_num_seqs=s["concurrency"])
    data: dict[str, Any] = {"settings": {**s, "block_size": bs, "device_blocks": device_blocks,
                                         "conversation_blocks": conv_blocks, "host_cache_gb": host_gb}}
    with tempfile.TemporaryDirectory(prefix="pagedrs-multiturn-") as tmp:
        for name in SETS:
            kw = dict(common, kv_host_cache_gb=host_gb[name])
            if name in ("host_disk", "warm_restart"):
                kw.update(kv_disk_path=f"{tmp}/{name}", kv_disk_gb=disk_gb)
            progress(f"multiturn: {name}")
            data[name] = _run_set(name, cfg, s, geo.vocab_size, kw)
        for name, twin in POLICY_SETS.items():
            kw = dict(common, kv_host_cache_gb=host_gb[twin], eviction_policy="lfu")
            if twin == "host_disk":
                kw.update(kv_disk_path=f"{tmp}/{name}", kv_disk_gb=disk_gb)
            progress(f"multiturn: {name}")
            data[name] = _run_set(name, cfg, s, geo.vocab_size, kw)
    dev, host = data["device"], data["host"]
    data["prefill_reduction_host_x"] = dev["prefill_tokens_computed"] / max(1, host["prefill_tokens_computed"])
    data["ttft_p50_speedup_host_x"] = dev["ttft_p50_s"] / host["ttft_p50_s"] if host["ttft_p50_s"] else 0.0
    data["model"] = cfg.model
    data["machine"] = machine
    return data, _markdown(data, machine)


_LABELS = {"device": "device only", "host": "+host", "host_disk": "+host+disk", "warm_restart": "warm restart (+host+disk)",
           "device_lfu": "device only, LFU", "host_disk_lfu": "+host+disk, LFU"}
_COLUMNS = [
    Column("tiers", "label"),
    Column("hit rate", "hit_rate_pct", "{:.1f}%"),
    Column("device", "hit_device_pct", "{:.1f}%"),
    Column("host", "hit_host_pct", "{:.1f}%"),
    Column("disk", "hit_disk_pct", "{:.1f}%"),
    Column("prefill tokens computed", "prefill_tokens_computed"),
    Column("KV MB moved", "mb_moved", "{:.1f}"),
    Column("tokens/s", "tokens_per_s", "{:.1f}"),
    Column("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
    Column("TTFT p99 s", "ttft_p99_s", "{:.3f}"),
]


def _markdown(data: dict[str, Any], machine: str) -> str:
    rows = [{"label": _LABELS[n], "mb_moved": data[n]["bytes_moved"] / 2**20, **data[n]} for n in (*SETS, *POLICY_SETS)]
    s = data["settings"]
    warm = data["warm_restart"]
    notes = [
        f"{s['users']} users x {s['turns']} turns, interleaved, {s['concurrency']} in flight; system prompt "
        f"{s['system_tokens']} tokens, user messages {s['user_tokens']}, greedy replies {s['reply_tokens']}; seed 0.",
        f"Device pool {s['device_blocks']} blocks of {s['block_size']} tokens (a conversation reaches "
        f"{s['conversation_blocks']} blocks). Host tier: every conversation for +host "
        f"({s['host_cache_gb']['host'] * 1024:.1f} MiB), a quarter of them for +host+disk and the restart.",
        f"+host vs device only: {data['prefill_reduction_host_x']:.2f}x fewer prefill tokens, "
        f"{data['ttft_p50_speedup_host_x']:.2f}x lower median TTFT (targets: 2x and 1.5x).",
        f"Warm restart: {warm.get('pages_on_disk_at_restart', 0)} pages on disk at restart; "
        f"{warm.get('restart_hit_pct', 0.0):.1f}% of the pages of the conversations before the restart were hits "
        f"in the turn after it (target 90%).",
        "Eviction policy, hit rate LRU -> LFU: " + "; ".join(
            f"{_LABELS[twin]} {data[twin]['hit_rate_pct']:.1f}% -> {data[name]['hit_rate_pct']:.1f}%"
            for name, twin in POLICY_SETS.items()) + " (every other row: LRU).",
        f"Model {data['model']}. Hit rates are over prompt blocks eligible for a hit.",
    ]
    return render("Multi-turn chat: device, host and disk page tiers", markdown_table(rows, _COLUMNS), notes, machine)


def plot(data: dict[str, Any], plot_dir: str) -> list[str]:
    from pagedrs.bench.charts import bars, pyplot, save

    plt = pyplot()
    labels = ["device", "+host", "+host+disk", "restart"]
    colors = ["#7f7f7f", "#2a7ab9", "#4c9a2a", "#d9822b"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    bars(axes[0], labels, [data[n]["prefill_tokens_computed"] for n in SETS], colors, "{:.0f}")
    axes[0].set_title("prefill tokens computed")
    bars(axes[1], labels, [data[n]["ttft_p50_s"] for n in SETS], colors, "{:.3f}")
    axes[1].set_title("median TTFT (s)")
    bars(axes[2], labels, [data[n]["hit_rate_pct"] for n in SETS], colors, "{:.0f}%")
    axes[2].set_title("prefix hit rate")
    return [save(plt, fig, plot_dir, "multiturn.png")]
