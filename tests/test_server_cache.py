"""The prefix cache's server surface: usage.prompt_tokens_details.cached_tokens_by_tier (a
pagedrs extension), POST /reset_prefix_cache behind the admin key (409 while requests run),
and the /metrics series for evictions by policy and resets; on a real engine, in this process
and in its own (the reset travels the core pipe)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("pagedrs._core")

from pagedrs.server.options import ServerOptions  # noqa: E402
from server_fakes import MODEL, FakeEngine, Served, assert_nothing_left, live_server, served_factory  # noqa: E402

ADMIN = "sk-admin"
TENANT = "sk-tenant"
KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=8, num_gpu_blocks=32, max_model_len=64,
                          kv_host_cache_gb=0)
OPTIONS = ServerOptions(api_key=TENANT, admin_api_key=ADMIN)


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
def make_served():
    yield from served_factory()


@pytest.mark.parametrize(("options", "key", "status", "code"), [
    (ServerOptions(), None, 403, "admin_key_required"),  # no key configured: never open
    (OPTIONS, None, 401, "invalid_api_key"),
    (OPTIONS, TENANT, 401, "invalid_api_key"),  # an admin key is set: a tenant's key does not open it
    (OPTIONS, "sk-wrong", 401, "invalid_api_key"),
])
def test_reset_needs_the_admin_key(make_served, options: ServerOptions, key: str | None, status: int, code: str) -> None:
    served: Served = make_served(FakeEngine(), options=options)
    response = httpx.post(served.url + "/reset_prefix_cache", headers=bearer(key), timeout=30)
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["code"] == code
    if status == 403:
        assert "/reset_prefix_cache" in body["message"] and "--admin-api-key" in body["message"]


@pytest.mark.parametrize("core_process", [False, True], ids=["inproc", "core-process"])
def test_usage_by_tier_and_a_reset_on_a_real_engine(tiny_llama_dir: Path, core_process: bool) -> None:
    prompt = list(range(5, 25))  # 20 tokens: 2 full pages of 8 can be reused
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    with live_server(tiny_llama_dir, KW, "tiny", core_process=core_process, options=OPTIONS) as live:
        def details(**fields: Any) -> dict[str, Any]:
            response = httpx.post(live.url + "/v1/completions", json={**body, **fields}, headers=bearer(TENANT),
                                  timeout=120)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]

        def reset() -> httpx.Response:
            return httpx.post(live.url + "/reset_prefix_cache", headers=bearer(ADMIN), timeout=60)

        assert details() == {"cached_tokens": 0, "cached_tokens_by_tier": {"device": 0, "host": 0, "disk": 0}}
        assert details() == {"cached_tokens": 16, "cached_tokens_by_tier": {"device": 16, "host": 0, "disk": 0}}
        response = reset()
        assert response.status_code == 200, response.text
        dropped = response.json()["dropped_pages"]
        assert dropped["device"] >= 2 and dropped["host"] == dropped["disk"] == 0, dropped
        assert details() == {"cached_tokens": 0, "cached_tokens_by_tier": {"device": 0, "host": 0, "disk": 0}}

        metrics = httpx.get(live.url + "/metrics", headers=bearer(ADMIN), timeout=30).text
        assert 'pagedrs_prefix_cache_resets_total{outcome="done"} 1.0' in metrics
        assert 'pagedrs_prefix_cache_evictions_total{policy="lru"}' in metrics
        assert_nothing_left(live.loop)


def test_a_reset_while_a_request_runs_is_a_409_and_clears_nothing(make_served) -> None:
    permits = threading.Semaphore(0)  # the engine thread steps only when the test lets it
    served: Served = make_served(FakeEngine(permits=permits), options=OPTIONS)
    body = {"model": MODEL, "prompt": "a shared system prompt", "max_tokens": 2}
    permits.release(10)
    first = httpx.post(served.url + "/v1/completions", json=body, headers=bearer(TENANT), timeout=30)
    assert first.status_code == 200, first.text
    while permits.acquire(blocking=False):  # the permits it left: none now
        pass
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, served.url + "/v1/completions", json={**body, "max_tokens": 6},
                              headers=bearer(TENANT), timeout=60)
        deadline = time.monotonic() + 30
        while served.count("add") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the add is applied at the start of a step, which then waits for a permit
        queued = served.loop._commands.qsize()  # the engine thread waits in the step: nothing takes from it
        reset = pool.submit(httpx.post, served.url + "/reset_prefix_cache", headers=bearer(ADMIN), timeout=30)
        while served.loop._commands.qsize() == queued and time.monotonic() < deadline + 30:
            time.sleep(0.01)  # the reset is queued for the engine thread, behind the step (a fixed 0.2 s lost the race
            # on a loaded machine: the step ended first, the next waited for a permit, and the reset behind it)
        permits.release(1)  # that step ends; the reset runs before the next: the request is unfinished
        refused = reset.result()
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "prefix_cache_busy" and "1 request(s) are in the engine" in error["message"]
        permits.release(10_000)
        cached = running.result().json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0, "the refused reset cleared nothing"
    done = httpx.post(served.url + "/reset_prefix_cache", headers=bearer(ADMIN), timeout=30)
    assert done.status_code == 200 and done.json()["dropped_pages"]["device"] > 0, done.text
    again = httpx.post(served.url + "/v1/completions", json=body, headers=bearer(TENANT), timeout=30)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    metrics = httpx.get(served.url + "/metrics", headers=bearer(ADMIN), timeout=30).text
    assert 'pagedrs_prefix_cache_resets_total{outcome="refused"} 1.0' in metrics
    assert 'pagedrs_prefix_cache_resets_total{outcome="done"} 1.0' in metrics


class PinningEngine(FakeEngine):
    """A FakeEngine that records the pins it is asked for (the salt it would key them by)."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: list[str | None] = []

    def pin(self, prompt: Any, ttl_s: float | None, salt: str | None) -> Any:
        from types import SimpleNamespace

        self.pinned.append(salt)
        return SimpleNamespace(pin_id=f"pin-{len(self.pinned) - 1}", num_tokens=16, num_pages=2, ttl_s=ttl_s,
                               expires_in_s=None)


PER_TENANT = ServerOptions(api_keys={"sk-alice": "alice", "sk-bob": "bob"}, admin_api_key=ADMIN,
                           prefix_cache_isolation="per-tenant")


@pytest.mark.parametrize(("body", "param", "says"), [
    # every request refuses these salts: a pin under one could never be hit, and it used up the pin cap
    ({"cache_salt": ""}, "cache_salt", "cache_salt has 0 bytes in UTF-8; allowed 1 to 256"),
    ({"cache_salt": "x" * 300}, "cache_salt", "cache_salt has 300 bytes in UTF-8; allowed 1 to 256"),
    ({"cache_salt": 5}, "cache_salt", "cache_salt"),
    # no API key names this tenant: no request could hit its pin
    ({"tenant": "nosuchtenant"}, "tenant", "tenant is 'nosuchtenant', which no API key of this server belongs to, "
                                           "so no request could hit the pin; allowed: alice, bob"),
])
def test_a_pin_no_request_could_hit_is_refused_naming_the_field(make_served, body: dict[str, Any], param: str,
                                                               says: str) -> None:
    served: Served = make_served(engine := PinningEngine(), options=PER_TENANT)
    refused = httpx.post(served.url + "/v1/cache/pin", json={"prompt": "a system prompt", "tenant": "alice", **body},
                         headers=bearer(ADMIN), timeout=30)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert says in error["message"] and error["param"] == param, error
    assert engine.pinned == []
    done = httpx.post(served.url + "/v1/cache/pin", json={"prompt": "a system prompt", "tenant": "alice",
                                                          "cache_salt": "s"}, headers=bearer(ADMIN), timeout=30)
    assert done.status_code == 200 and done.json()["id"] == "pin-0", done.text
    assert len(engine.pinned) == 1 and engine.pinned[0] is not None


REFUSED_RESETS: list[tuple[str, bytes, str | None, str]] = [
    # each of these was a 200 that cleared every tier
    ("", b'{"tier": "disk"}', "tier", "takes no body (got tier)"),
    ("?tier=host", b"", "tier", "'tier' is not a query parameter of /reset_prefix_cache"),
    ("?reset_running_requests=true", b"", "reset_running_requests",
     "reset_running_requests='true' is not supported: a reset is refused (409) while requests are in the engine"),
    ("?reset_external=false", b"", "reset_external", "reset_external='false' is not supported"),
    ("?device=gpu", b"", "device", "'device' is not a query parameter"),
    ("?reset_external=true&reset_external=true", b"", "reset_external", "given twice"),
    ("", b"[1]", None, "takes no body (got [1])"),
    ("", b'{"a": 1, "a": 2}', None, "the key 'a' twice"),
]


def test_a_reset_refuses_what_it_would_not_do(make_served) -> None:
    """Every field of vLLM's reset is honoured exactly or refused naming it; any other field too."""
    served: Served = make_served(FakeEngine(), options=OPTIONS)
    for query, body, param, says in REFUSED_RESETS:
        refused = httpx.post(served.url + "/reset_prefix_cache" + query, content=body, timeout=30,
                             headers={**bearer(ADMIN), "Content-Type": "application/json"})
        assert refused.status_code == 400, (query, body, refused.text)
        error = refused.json()["error"]
        assert says in error["message"] and error.get("param") == param, error
    assert served.count("reset_prefix_cache") == 0
    for query, body in [("?reset_running_requests=false&reset_external=true", b""), ("?reset_external=1", b"{}"),
                        ("", b"")]:  # vLLM's values that ask for what the reset does
        done = httpx.post(served.url + "/reset_prefix_cache" + query, content=body, headers=bearer(ADMIN), timeout=30)
        assert done.status_code == 200 and "dropped_pages" in done.json(), done.text
    assert served.count("reset_prefix_cache") == 3


def test_a_pin_message_names_which_field_is_wrong(make_served) -> None:
    """It said "must have a string 'role' and a string 'content'; got keys ['content', 'role']", param "prompt"."""
    served: Served = make_served(engine := PinningEngine(), options=OPTIONS)
    for message, says in [({"role": "user", "content": 5}, "messages.0.content is 5, a number; allowed: a string"),
                          ({"role": "bogus", "content": 5}, "messages.0.role is \"bogus\", a string; allowed: one of "
                                                            "'system', 'developer', 'user', 'assistant', 'tool'"),
                          ({"role": "user", "content": [{"type": "text", "text": "hi"}]},
                           "messages.0.content is [{\"type\": \"text\", \"text\": \"hi\"}], an array; allowed: a string")]:
        refused = httpx.post(served.url + "/v1/cache/pin", json={"messages": [message]}, headers=bearer(ADMIN),
                             timeout=30)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["message"].startswith(says) and error["param"] == "messages", error
    assert engine.pinned == []
