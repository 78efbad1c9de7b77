"""Tenants and the prefix cache's side channel (issue 23, item 8, server side; item 7 on a real engine).

Several API keys (``--api-key-file``: key -> tenant), an admin key for the admin endpoints,
``cache_salt`` (vLLM's semantics) and ``--prefix-cache-isolation per-tenant``. On the fake
engine, whose prefix cache reuses full pages of earlier prompts under the same salt, the
tests check which requests share pages; on a real engine (once it takes ``cache_salt``)
that the reuse the core reports reaches ``usage``, through the core process too.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from pagedrs import Engine  # noqa: E402
from pagedrs.outputs import RequestOutput  # noqa: E402
from pagedrs.server.cli import main  # noqa: E402
from pagedrs.server.options import ServerOptions  # noqa: E402
from pagedrs.server.tenants import KeyFileError, engine_salt, load_api_key_file  # noqa: E402
from server_fakes import MODEL, FakeEngine, Served, assert_nothing_left, live_server, served_factory  # noqa: E402

KEYS = {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob"}
ADMIN = "sk-admin"
PROMPT = "a shared system prompt"  # 22 tokens on the fake: 5 full pages of 4 can be reused


@pytest.fixture
def make_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()


def complete(served: Served, key: str | None, **fields: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields}
    return httpx.post(served.url + "/v1/completions", json=body, headers=headers, timeout=60)


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def salts(served: Served) -> list[str | None]:
    """The cache salt of every request the engine was given, in order."""
    return [entry["cache_salt"] for entry in served.engine.added.values()]


# --- the key file -------------------------------------------------------------------------------


def test_a_key_file_maps_keys_to_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# key tenant\nsk-alice-1 alice\n\n  sk-alice-2\talice  \nsk-bob bob\n")
    assert load_api_key_file(str(path)) == KEYS


@pytest.mark.parametrize("text,line,message", [
    ("sk-a alice\nsk-b\n", 2, "expected '<key> <tenant>' (2 fields separated by spaces), got 1"),
    ("sk-a alice extra\n", 1, "got 3"),
    ("sk-a al/ice\n", 1, "tenant 'al/ice' must be 1-64 letters, digits and . _ -"),
    ("sk-a alice\n# a comment\nsk-a bob\n", 3, "this key is already given to tenant 'alice'"),
    ("x" * 513 + " alice\n", 1, "the key has 513 characters; at most 512 allowed"),
])
def test_a_bad_key_file_names_its_path_and_line(tmp_path: Path, text: str, line: int, message: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KeyFileError) as caught:
        load_api_key_file(str(path))
    assert str(caught.value).startswith(f"--api-key-file {str(path)!r} line {line}: ")
    assert message in str(caught.value)


def test_an_empty_or_missing_key_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(KeyFileError, match="has no keys"):
        load_api_key_file(str(empty))
    with pytest.raises(KeyFileError, match="cannot be read"):
        load_api_key_file(str(tmp_path / "missing"))


@pytest.mark.parametrize("args,message", [
    (["--api-key-file", "{bad}"], "line 2: expected '<key> <tenant>'"),
    (["--prefix-cache-isolation", "per-tenant"], "needs API keys to tell tenants apart"),
    (["--api-key-file", "{good}", "--admin-api-key", "sk-bob"], "admin_api_key is also a tenant's API key"),
    (["--max-seqs-per-request", "0"], "max_seqs_per_request=0 is out of range: allowed >= 1"),
])
def test_serve_exits_2_before_starting_an_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str,
) -> None:
    (tmp_path / "bad").write_text("sk-a alice\nsk-b\n")
    (tmp_path / "good").write_text("sk-bob bob\n")
    names_the_bad_file = "{bad}" in args
    args = [a.format(bad=tmp_path / "bad", good=tmp_path / "good") for a in args]
    assert main([*args, "--model", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert message in err and "cannot start the engine" not in err
    if names_the_bad_file:
        assert repr(str(tmp_path / "bad")) in err


# --- who may call what --------------------------------------------------------------------------


def test_each_tenant_key_opens_v1_and_only_the_admin_key_opens_metrics(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine(), options=ServerOptions(api_keys=KEYS, admin_api_key=ADMIN, api_key="sk-old"))
    for key in [*KEYS, "sk-old"]:
        assert complete(served, key).status_code == 200, key
        assert httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    for key in (ADMIN, "sk-nobody", None):
        response = complete(served, key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert httpx.get(served.url + "/health").status_code == 200


def test_without_an_admin_key_metrics_takes_any_tenant_key(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine(), options=ServerOptions(api_keys=KEYS))
    assert httpx.get(served.url + "/metrics", headers={"Authorization": "Bearer sk-bob"}).status_code == 200
    assert httpx.get(served.url + "/metrics").status_code == 401


# --- which requests share cached pages ----------------------------------------------------------


def test_per_tenant_isolation_shares_pages_within_a_tenant_only(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine(), options=ServerOptions(api_keys=KEYS, prefix_cache_isolation="per-tenant"))
    assert cached(complete(served, "sk-alice-1")) == 0
    assert cached(complete(served, "sk-bob")) == 0  # the same prompt, another tenant: no page shared
    assert cached(complete(served, "sk-alice-2")) == 20  # alice's other key: her cache
    assert cached(complete(served, "sk-bob", cache_salt="x")) == 0
    assert cached(complete(served, "sk-alice-1", cache_salt="x")) == 0  # the same client salt, another tenant
    assert cached(complete(served, "sk-alice-2", cache_salt="x")) == 20
    alice, bob, alice_again, bob_x, alice_x, alice_x_again = salts(served)
    assert alice == alice_again and alice_x == alice_x_again
    assert len({alice, bob, bob_x, alice_x}) == 4 and all(len(s or "") == 64 for s in salts(served))


def test_shared_isolation_shares_pages_under_the_same_salt(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine(), options=ServerOptions(api_keys=KEYS))
    assert cached(complete(served, "sk-alice-1")) == 0
    assert cached(complete(served, "sk-bob")) == 20  # one cache for everyone without a salt
    assert cached(complete(served, "sk-bob", cache_salt="x")) == 0  # a salt starts a cache of its own
    assert cached(complete(served, "sk-alice-1", cache_salt="x")) == 20  # ... shared by whoever knows it
    assert cached(complete(served, "sk-alice-1", cache_salt="y")) == 0
    assert salts(served)[:2] == [None, None]


@pytest.mark.parametrize("salt,message", [
    (5, "Input should be a valid string"),
    (["x"], "Input should be a valid string"),
    ("", "cache_salt has 0 bytes in UTF-8; allowed 1 to 256"),
    ("é" * 129, "cache_salt has 258 bytes in UTF-8; allowed 1 to 256"),  # 129 characters: bytes are counted
])
def test_a_bad_cache_salt_is_a_400(make_served: Callable[..., Served], salt: Any, message: str) -> None:
    served = make_served(FakeEngine())
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "x"}]})):
        response = httpx.post(served.url + path, json={"model": MODEL, "cache_salt": salt, **body}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "cache_salt" and message in error["message"]
    assert served.count("add") == 0
    assert cached(complete(served, None, cache_salt="é" * 128)) == 0  # 256 bytes: allowed


def test_engine_salts_never_collide_across_modes_tenants_and_client_salts() -> None:
    cases = [("shared", None, "x"), ("shared", None, "y"), ("per-tenant", "a", None), ("per-tenant", "a", "x"),
             ("per-tenant", "b", None), ("per-tenant", "b", "x"), ("per-tenant", "a\0x", None)]
    made = [engine_salt(*case) for case in cases]
    assert len(set(made)) == len(cases) and all(s is not None and len(s) == 64 for s in made)
    assert engine_salt("shared", "a", None) is None  # shared and unsalted: the one shared cache
    assert engine_salt("per-tenant", "a", "x") == engine_salt("per-tenant", "a", "x")  # stable across restarts
    with pytest.raises(ValueError, match="needs the request's tenant"):
        engine_salt("per-tenant", None, "x")


# --- a real engine: what the core reused reaches usage --------------------------------------------

ENGINE_HAS_SALTS = "cache_salt" in inspect.signature(Engine.add_request).parameters and "num_cached_tokens" in {
    f.name for f in dataclasses.fields(RequestOutput)}
KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=8, num_gpu_blocks=32, max_model_len=64)


@pytest.mark.skipif(not ENGINE_HAS_SALTS, reason="needs Engine.add_request(cache_salt=...) and "
                    "RequestOutput.num_cached_tokens (the lead's engine change)")
@pytest.mark.parametrize("core_process", [False, True], ids=["in-process", "core-process"])
def test_a_real_engine_reports_its_reuse_and_salts_separate_it(tiny_llama_dir: Path, core_process: bool) -> None:
    prompt = list(range(5, 25))  # 20 tokens: 2 full pages of 8 can be reused
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    with live_server(tiny_llama_dir, KW, "tiny", core_process=core_process) as live:
        def usage(**fields: Any) -> int:
            response = httpx.post(live.url + "/v1/completions", json={**body, **fields}, timeout=120)
            assert response.status_code == 200, response.text
            return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert usage() == 0
        assert usage() == 16
        assert usage(cache_salt="tenant-x") == 0  # a salted request never reuses an unsalted page
        assert usage(cache_salt="tenant-x") == 16
        assert usage(cache_salt="tenant-y") == 0
        assert_nothing_left(live.loop)
