"""The Ray Serve app on a local Ray cluster: 2 replicas of a tiny model behind the ingress.

Needs ``ray[serve]`` (the ``ray`` extra) and ``PAGEDRS_TEST_RAY=1``; ``make test-ray`` installs the
one and sets the other (a Ray cluster takes ~45 s to start on 2 cores, and the module ~3 minutes:
too long for ``make test``'s budget, which runs tests/test_ray_routing.py instead).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

if os.environ.get("PAGEDRS_TEST_RAY") != "1":
    pytest.skip("the Ray app's tests run with PAGEDRS_TEST_RAY=1 (make test-ray)", allow_module_level=True)
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from pagedrs import EngineArgs  # noqa: E402
from pagedrs.ray import build_app  # noqa: E402
from pagedrs.ray.replica import REPLICA_HEADER  # noqa: E402
from pagedrs.server.options import ServerOptions  # noqa: E402
from server_fakes import live_server  # noqa: E402

pytestmark = pytest.mark.leaves_requests  # the leak fixture cannot see into Ray's actors: checked below instead

BLOCK = 4
KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=96, max_model_len=160,
                          kv_host_cache_gb=0, swap_space_gb=0)
MAX_BODY = 64 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayApp:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model

    def complete(self, prompt: Any, **fields: Any) -> httpx.Response:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 1, **fields}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def ray_app(tiny_llama_dir: Path) -> Iterator[RayApp]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(EngineArgs(model=str(tiny_llama_dir), **KW), num_replicas=2, routing="cache", model_name="tiny",
                    server_options=ServerOptions(max_request_bytes=MAX_BODY), routing_stats_period_s=0.25)
    serve.run(app, name="pagedrs", route_prefix="/")
    try:
        yield RayApp(f"http://127.0.0.1:{port}", "tiny")
    finally:
        serve.shutdown()
        ray.shutdown()


def _prompts() -> list[list[int]]:
    return [[3 + (i * 7 + j * 3) % 250 for j in range(4 * BLOCK + 1 + i)] for i in range(6)]


def test_greedy_through_ray_equals_the_single_server(ray_app: RayApp, tiny_llama_dir: Path):
    with live_server(tiny_llama_dir, KW, "tiny") as single:
        for prompt in _prompts():
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 1}
            want = httpx.post(single.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            got = ray_app.complete(prompt).json()["choices"][0]
            assert got["text"] == want["text"]
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)


def test_a_repeated_prefix_goes_where_it_is_cached(ray_app: RayApp):
    """Each conversation's second turn lands on the replica that ran its first and reuses its pages;
    power of two would miss about half of them with 2 replicas."""
    for i, prompt in enumerate(_prompts()):
        first = ray_app.complete(prompt + [200 + i])
        again = ray_app.complete(prompt + [200 + i, 7, 8])
        assert first.status_code == again.status_code == 200
        assert again.headers[REPLICA_HEADER.decode()] == first.headers[REPLICA_HEADER.decode()], i
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (len(prompt) // BLOCK) * BLOCK - BLOCK, (i, cached)


@pytest.mark.parametrize(("fields", "param"), [({"max_tokens": -1}, "max_tokens"), ({"temperature": float("nan")}, None),
                                               ({"best_of": 10_000}, None), ({"no_such_field": 1}, None)])
def test_bad_input_gets_the_single_servers_answer(ray_app: RayApp, tiny_llama_dir: Path, fields: dict[str, Any],
                                                  param: str | None):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, **fields}
    raw = json.dumps(body, allow_nan=True)
    with live_server(tiny_llama_dir, KW, "tiny") as single:
        want = httpx.post(single.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                          timeout=60)
    got = httpx.post(ray_app.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                     timeout=60)
    assert 400 <= want.status_code < 500
    assert (got.status_code, got.json()) == (want.status_code, want.json())
    if param is not None:
        assert got.json()["error"]["param"] == param


def test_non_utf8_and_oversized_bodies(ray_app: RayApp):
    bad = httpx.post(ray_app.url + "/v1/completions", content=b"\xff\xfe{", headers={"content-type": "application/json"},
                     timeout=60)
    assert 400 <= bad.status_code < 500, bad.text
    big = httpx.post(ray_app.url + "/v1/completions", content=b"x" * (MAX_BODY + 1),
                     headers={"content-type": "application/json"}, timeout=60)
    assert big.status_code == 413 and str(MAX_BODY) in big.json()["error"]["message"]


def test_a_replica_killed_mid_stream_ends_its_stream_and_comes_back(ray_app: RayApp):
    body = {"model": "tiny", "prompt": _prompts()[0], "max_tokens": 130, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    outcome: dict[str, Any] = {}

    def read() -> None:
        with httpx.stream("POST", ray_app.url + "/v1/completions", json=body, timeout=120) as r:
            outcome["replica"] = r.headers[REPLICA_HEADER.decode()]
            lines = []
            try:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 4:
                        outcome["started"] = True
            except httpx.HTTPError as exc:
                outcome["transport_error"] = repr(exc)
            outcome["lines"] = lines

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 60
    while "started" not in outcome and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcome.get("started"), outcome
    ray.kill(ray.get_actor(outcome["replica"], namespace="serve"), no_restart=False)
    reader.join(timeout=90)
    assert not reader.is_alive(), "the stream hung after its replica died"
    lines = outcome["lines"]
    assert "data: [DONE]" not in lines, "a stream whose replica died must not look complete"
    assert outcome.get("transport_error") or any('"replica_failed"' in line for line in lines), lines[-3:]
    # Meanwhile requests route around it (or retry once); Ray brings it back.
    for prompt in _prompts()[:3]:
        assert ray_app.complete(prompt).status_code == 200
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = serve.status().applications["pagedrs"].deployments["PagedrsReplica"]
        if status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica did not come back: {serve.status()}")


def test_nothing_is_left_in_the_replicas(ray_app: RayApp):
    """The leak check, across the actor boundary: every replica's pages are free once all is answered."""
    handle = serve.get_deployment_handle("PagedrsReplica", app_name="pagedrs")
    deadline = time.monotonic() + 30
    while True:
        stats = [handle.stats.remote().result(timeout_s=60) for _ in range(6)]  # each replica, most likely
        if all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for s in stats:
        assert s["num_running"] == 0 and s["num_waiting"] == 0, s
        assert s["num_free_gpu_blocks"] == s["num_gpu_blocks"], s


def test_rays_own_prefix_router_serves_and_keeps_a_conversation_together(ray_app: RayApp, tiny_llama_dir: Path):
    """routing="ray-prefix" (Ray's PrefixCacheAffinityRouter, given the prompt's ids as text): the same
    answers as the single server, a turn follows its conversation's first (queues are balanced here,
    one request at a time), and a request without a prompt is still served."""
    serve.delete("pagedrs")
    app = build_app(EngineArgs(model=str(tiny_llama_dir), **KW), num_replicas=2, routing="ray-prefix",
                    model_name="tiny", routing_stats_period_s=0.25)
    serve.run(app, name="pagedrs", route_prefix="/")
    with live_server(tiny_llama_dir, KW, "tiny") as single:
        for i, prompt in enumerate(_prompts()):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.0}
            want = httpx.post(single.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            first = ray_app.complete(prompt)
            again = ray_app.complete(prompt + [7, 8])
            assert first.json()["choices"][0]["text"] == want
            assert again.headers[REPLICA_HEADER.decode()] == first.headers[REPLICA_HEADER.decode()], i
    assert httpx.get(ray_app.url + "/v1/models", timeout=60).status_code == 200
