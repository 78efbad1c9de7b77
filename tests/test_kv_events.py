"""KV events for routers (core/kv_events.py): a subscriber that knows nothing but the ZMQ
stream rebuilds what every tier caches, through prefix hits, evictions down the tiers and a
reset, equal to what the core reports; the replay socket returns the batches it missed; the
wire format is vLLM's (msgpack, array_like tagged structs, [topic, seq, payload] frames);
greedy output is unchanged by events; and events cost nothing when off.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import pytest

msgpack = pytest.importorskip("msgpack")
zmq = pytest.importorskip("zmq")

from pagedrs import EngineArgs  # noqa: E402
from test_cache_surface import check_greedy, serve  # noqa: E402
from test_kv_tiers import BLOCK, conversations, engine, gib  # noqa: E402

MEDIA = ("GPU", "CPU", "DISK")


class Subscriber:
    """A router's side: a SUB socket for live batches and a REQ socket for replays."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.batches: dict[int, bytes] = {}

    def drain(self, quiet_s: float = 0.3) -> None:
        """Everything sent so far: reads until the socket stays quiet."""
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = payload

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every buffered batch from ``start`` on: a DEALER speaks the ROUTER's framing (a REQ
        socket would take one reply only)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            got = []
            while True:
                assert dealer.poll(5000), "the replay socket answered"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == (-1).to_bytes(8, "big", signed=True):
                    assert payload == b""
                    return got
                got.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)


class Mirror:
    """The cache as the stream alone says it is: per medium, the set of block hashes."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[int]] = defaultdict(set)
        self.kinds: dict[tuple[str, str], int] = defaultdict(int)

    def apply(self, payload: bytes, block_size: int) -> int:
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        for e in events:
            kind = e[0]
            if kind == "BlockStored":
                _, hashes, parent, tokens, bs, lora_id, medium = e
                assert bs == block_size and lora_id is None and medium in MEDIA
                assert len(tokens) == len(hashes) * block_size and all(isinstance(t, int) for t in tokens)
                assert parent is None or isinstance(parent, int)
                for h in hashes:
                    assert h not in self.tiers[medium], f"{h} stored twice on {medium}"
                    self.tiers[medium].add(h)
            elif kind == "BlockRemoved":
                _, hashes, medium = e
                for h in hashes:
                    assert h in self.tiers[medium], f"{h} removed from {medium} but never stored there"
                    self.tiers[medium].discard(h)
            else:
                assert e == ["AllBlocksCleared"], e
                medium = "*"
                self.tiers.clear()
            self.kinds[(kind, medium)] += 1
        return len(events)

    def assert_equals_core(self, scheduler: Any) -> None:
        for medium in MEDIA:
            assert sorted(self.tiers.get(medium, ())) == scheduler.cached_hashes(medium), medium


def rebuild(sub: Subscriber, block_size: int) -> tuple[Mirror, int]:
    """Live batches plus a replay of what the subscriber missed, applied in sequence order."""
    sub.drain()
    for seq, payload in sub.replay(0):
        assert sub.batches.setdefault(seq, payload) == payload, f"replayed batch {seq} equals the live one"
    seqs = sorted(sub.batches)
    assert seqs == list(range(len(seqs))), f"no gap in the sequence numbers: {seqs}"
    mirror, n = Mirror(), 0
    for seq in seqs:
        n += mirror.apply(sub.batches[seq], block_size)
    return mirror, n


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def test_a_subscriber_rebuilds_every_tier_from_the_stream(tiny_llama_dir, hf_model, tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    eng = engine(tiny_llama_dir, kv_host_cache_gb=gib(24), kv_disk_path=str(tmp_path / "store"), kv_disk_gb=gib(400),
                 kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay)
    sub = Subscriber(endpoint, replay)
    try:
        prompts = conversations(eng.loaded.config.vocab_size)
        serve(eng, prompts, tag="a")
        check_greedy(hf_model, prompts, serve(eng, prompts, tag="b"), tag="b")  # events change no token
        eng.core.kv_events.flush()
        mirror, n = rebuild(sub, BLOCK)
        mirror.assert_equals_core(eng.scheduler)
        assert all(mirror.tiers[m] for m in MEDIA), f"pages on every tier: { {m: len(mirror.tiers[m]) for m in MEDIA} }"
        assert mirror.kinds[("BlockRemoved", "GPU")] > 0 and mirror.kinds[("BlockStored", "CPU")] > 0, dict(mirror.kinds)
        assert eng.stats()["kv_events_published"] == n

        # A reset is one AllBlocksCleared, sent at once (no step needed); then the cache refills.
        eng.reset_prefix_cache()
        eng.core.kv_events.flush()
        sub.drain()
        last = max(sub.batches)
        assert msgpack.unpackb(sub.batches[last])[1] == [["AllBlocksCleared"]]
        serve(eng, prompts[:2], tag="c")
        eng.core.kv_events.flush()
        mirror, n = rebuild(sub, BLOCK)
        mirror.assert_equals_core(eng.scheduler)
        assert mirror.kinds[("AllBlocksCleared", "*")] == 1 and mirror.tiers["GPU"]
        assert eng.stats()["kv_events_published"] == n

        pytest.importorskip("prometheus_client")
        from pagedrs.server.metrics import ServerMetrics

        metrics = ServerMetrics()
        metrics.update_from_stats(eng.stats())
        assert f"pagedrs_kv_events_published_total {float(n)}" in metrics.render().decode()

        # The replay socket resends exactly the batches from the asked sequence number on.
        tail = sub.replay(last)
        assert [s for s, _ in tail] == list(range(last, max(sub.batches) + 1))
        assert all(sub.batches[s] == p for s, p in tail)
    finally:
        sub.close()
        eng.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_late_subscriber_gets_the_snapshot_by_replay(tiny_llama_dir, tmp_path, async_scheduling):
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    eng = engine(tiny_llama_dir, kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay,
                 async_scheduling=async_scheduling, num_gpu_blocks=12)
    try:
        prompts = conversations(eng.loaded.config.vocab_size, users=3)
        serve(eng, prompts)
        eng.core.kv_events.flush()
        sub = Subscriber(endpoint, replay)  # joined after every batch was sent: PUB dropped them
        time.sleep(0.2)
        mirror, _ = rebuild(sub, BLOCK)
        mirror.assert_equals_core(eng.scheduler)
        assert mirror.tiers["GPU"], "the replay alone told it what the device caches"
        sub.close()
    finally:
        eng.shutdown()


def test_events_are_off_by_default_and_cost_nothing(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    serve(eng, conversations(eng.loaded.config.vocab_size, users=2))
    assert eng.scheduler.cached_hashes("GPU"), "pages are cached"
    assert eng.scheduler.take_kv_events() == [], "the core logged nothing"
    assert eng.stats()["kv_events_published"] == 0
    eng.shutdown()


@pytest.mark.parametrize("kw, field", [
    (dict(kv_events_endpoint="localhost:5557"), "kv_events_endpoint"),
    (dict(kv_events_endpoint=5557), "kv_events_endpoint"),
    (dict(kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="5558"), "kv_events_replay_endpoint"),
    (dict(kv_events_replay_endpoint="tcp://*:5558"), "kv_events_replay_endpoint"),
    (dict(kv_events_endpoint="tcp://*:5557", kv_events_buffer_steps=0), "kv_events_buffer_steps"),
])
def test_bad_endpoints_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(model="unused", **kw)


def test_cached_hashes_rejects_an_unknown_medium(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="medium must be 'GPU', 'CPU' or 'DISK', got \"gpu\""):
        eng.scheduler.cached_hashes("gpu")
    eng.shutdown()


def test_serve_flags_reach_engine_args():
    import argparse

    from pagedrs.cli_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p, cpu_threads_help="")
    kw = engine_kwargs(p.parse_args(["--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558",
                                     "--kv-events-buffer-steps", "7"]))
    assert (kw["kv_events_endpoint"], kw["kv_events_replay_endpoint"], kw["kv_events_buffer_steps"]) == (
        "tcp://*:5557", "tcp://*:5558", 7)
    assert engine_kwargs(p.parse_args([]))["kv_events_endpoint"] is None, "off by default"


def test_an_endpoint_in_use_is_an_error_naming_the_field(tmp_path):
    import socket

    from pagedrs.core.kv_events import KvEventPublisher

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = KvEventPublisher(f"tcp://*:{port}", None, block_size=4)
    try:
        with pytest.raises(ValueError, match=rf"kv_events_endpoint is 'tcp://\*:{port}': cannot open it"):
            KvEventPublisher(f"tcp://*:{port}", None, block_size=4)
        with pytest.raises(ValueError, match=rf"kv_events_replay_endpoint is 'tcp://\*:{port}': cannot open it"):
            KvEventPublisher(f"ipc://{tmp_path}/ok", f"tcp://*:{port}", block_size=4)
    finally:
        first.close()
