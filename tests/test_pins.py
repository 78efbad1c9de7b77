"""Pinned prefixes (issue 27 item 3): ``LLM.pin_prefix`` / ``unpin`` with a TTL and a cap, held
by the Rust core as hidden sequences; greedy output equal to transformers with a pinned system
prompt under memory pressure (the pin is what keeps the hit), on both clients, the server's
``/v1/cache`` endpoints behind the admin key, and ``serve --pin-prefix FILE``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pagedrs import LLM, Engine, EngineArgs
from pagedrs.core.pins import MAX_TTL_S
from pagedrs.errors import PinCapError, UnknownPinError
from pagedrs.server.engine_core import RemoteEngine
from test_engine import greedy, hf_greedy
from test_kv_tiers import BLOCK, engine

SYSTEM_BLOCKS = 3


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def tokens(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run(eng: Engine, prompts: dict[str, list[int]], max_tokens: int = 4) -> dict[str, Any]:
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, greedy(max_tokens))
    done: dict[str, Any] = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return done


def pressure(eng: Engine, seed: int) -> None:
    """Distinct prompts that fill the whole device pool: every unpinned cached page is evicted."""
    vocab = eng.vocab_size
    run(eng, {f"fill{seed}-{i}": tokens(vocab, 9 * BLOCK + 1, seed * 100 + i) for i in range(4)}, max_tokens=2)


def held_pages(eng: Engine) -> int:
    s = eng.stats()
    return s["num_gpu_blocks"] - s["num_free_gpu_blocks"]


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_system_prompt_survives_pressure_and_stays_exact(tiny_llama_dir, hf_model, pinned):
    eng = engine(tiny_llama_dir)
    vocab = eng.loaded.config.vocab_size
    system = tokens(vocab, SYSTEM_BLOCKS * BLOCK, seed=1)
    pin = eng.pin(system) if pinned else None
    if pin is not None:
        assert (pin.num_tokens, pin.num_pages, pin.ttl_s, pin.expires_in_s) == (SYSTEM_BLOCKS * BLOCK, SYSTEM_BLOCKS, None, None)
        assert eng.stats()["num_pins"] == 1 and eng.stats()["num_pinned_blocks"] == SYSTEM_BLOCKS
        assert held_pages(eng) == SYSTEM_BLOCKS
    pressure(eng, seed=2)
    user = system + tokens(vocab, 2 * BLOCK + 3, seed=3)
    out = run(eng, {"chat": user}, max_tokens=5)["chat"]
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, user, 5)
    expected = SYSTEM_BLOCKS * BLOCK if pinned else 0  # without the pin the pressure evicted it
    assert out.cached_tokens_by_tier == {"device": expected, "host": 0, "disk": 0}
    if pin is not None:
        eng.check_invariants()
        eng.unpin(pin.pin_id)
        with pytest.raises(UnknownPinError, match=pin.pin_id):
            eng.unpin(pin.pin_id)
    assert eng.stats()["num_pins"] == 0 and held_pages(eng) == 0
    eng.shutdown()


def test_ttl_expires_at_a_step_boundary_on_the_monotonic_clock(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    now = [1000.0]
    eng.core.pins.clock = lambda: now[0]
    system = tokens(eng.loaded.config.vocab_size, 2 * BLOCK, seed=4)
    pin = eng.pin(system, ttl_s=5)
    assert pin.ttl_s == 5 and pin.expires_in_s == 5
    now[0] += 4.0
    run(eng, {"a": system + [7, 8, 9]}, max_tokens=1)
    assert [p.expires_in_s for p in eng.list_pins()] == [1.0] and held_pages(eng) == 2
    now[0] += 1.0  # the TTL runs out: the next step boundary releases it
    run(eng, {"b": [5, 6, 7]}, max_tokens=1)
    assert eng.list_pins() == [] and held_pages(eng) == 0 and eng.core.pins.num_expired == 1
    with pytest.raises(KeyError):
        eng.unpin(pin.pin_id)
    eng.shutdown()


def test_the_cap_refuses_a_pin_past_it_and_shared_pages_count_once(tiny_llama_dir):
    eng = engine(tiny_llama_dir, max_pinned_fraction=0.25)  # 24 pages: at most 6 pinned
    vocab = eng.loaded.config.vocab_size
    system = tokens(vocab, 4 * BLOCK, seed=5)
    first = eng.pin(system)
    again = eng.pin(system[: 2 * BLOCK] + [1])  # its 2 full pages are pinned already: nothing new
    assert (first.num_pages, again.num_pages, eng.stats()["num_pinned_blocks"]) == (4, 2, 4)
    with pytest.raises(PinCapError, match=r"needs 3 more device pages; 4 are pinned and the cap is 6 of 24 "
                                          r"\(max_pinned_fraction=0.25\)"):
        eng.pin(tokens(vocab, 3 * BLOCK, seed=6))
    assert eng.stats()["num_pinned_blocks"] == 4, "the refused pin pinned nothing"
    eng.pin(tokens(vocab, 2 * BLOCK, seed=7))  # exactly up to the cap
    assert eng.stats()["num_pinned_blocks"] == 6
    for p in eng.list_pins():
        eng.unpin(p.pin_id)
    eng.shutdown()


@pytest.mark.parametrize("ttl", [-1, 0, math.nan, math.inf, -math.inf, MAX_TTL_S + 1, "5", True])
def test_a_bad_ttl_is_refused_naming_ttl_s(tiny_llama_dir, ttl):
    eng = engine(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"ttl_s=.* is out of range: allowed a finite number of seconds in \(0, 604800\]"):
        eng.pin(list(range(5, 5 + 2 * BLOCK)), ttl_s=ttl)
    assert eng.list_pins() == [] and held_pages(eng) == 0
    eng.shutdown()


def test_bad_prompts_and_unknown_ids_are_refused(tiny_llama_dir):
    eng = engine(tiny_llama_dir, num_gpu_blocks=24, max_model_len=256)
    with pytest.raises(ValueError, match="needs at least block_size = 4 tokens"):
        eng.pin([5, 6, 7])
    with pytest.raises(ValueError, match="max_model_len"):
        eng.pin(list(range(3, 3 + 300)))
    with pytest.raises(ValueError, match="the device pool holds 24 pages: it can never be pinned"):  # past the pool
        eng.pin(list(range(3, 3 + 25 * BLOCK)))
    with pytest.raises(ValueError, match="at least one token|empty"):
        eng.pin([])
    with pytest.raises(UnknownPinError, match="pin_id='pin-99' is not a live pin"):
        eng.unpin("pin-99")
    with pytest.raises(ValueError, match=r"messages\[0\] has no 'role' \(its keys: \['content'\]\); a pinned message "
                                         r"needs a string 'role' and a string 'content'"):
        eng.pin([{"content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] is 5 \(int\); a pinned message needs"):
        eng.pin([{"role": "user", "content": 5}])
    assert eng.list_pins() == [] and held_pages(eng) == 0 and not eng.has_unfinished()
    eng.shutdown()


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5, math.nan, True])
def test_max_pinned_fraction_is_validated(fraction):
    with pytest.raises(ValueError, match=r"max_pinned_fraction is .*; allowed a number in \(0, 1\]"):
        EngineArgs(model="x", max_pinned_fraction=fraction)


def test_a_reset_keeps_the_pinned_pages_and_clears_the_rest(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    vocab = eng.loaded.config.vocab_size
    system = tokens(vocab, 2 * BLOCK, seed=8)
    pin = eng.pin(system)
    other = tokens(vocab, 3 * BLOCK + 1, seed=9)
    run(eng, {"o": other}, max_tokens=1)
    report = eng.reset_prefix_cache()
    assert report.device == 3, "the other prompt's 3 full pages; the 2 pinned ones stay"
    done = run(eng, {"s": system + [4, 5], "o2": other}, max_tokens=1)
    assert done["s"].num_cached_tokens == 2 * BLOCK and done["o2"].num_cached_tokens == 0
    eng.unpin(pin.pin_id)
    eng.shutdown()


def test_requests_beside_a_pin_keep_stepping_and_the_fit_check_counts_pins(tiny_llama_dir, hf_model):
    eng = engine(tiny_llama_dir, num_gpu_blocks=16, max_pinned_fraction=0.5)
    vocab = eng.loaded.config.vocab_size
    prompt = tokens(vocab, 9, seed=10)
    eng.add_request("beside", {"prompt_token_ids": prompt}, greedy(6))
    pin = eng.pin(tokens(vocab, 8 * BLOCK, seed=11))  # its prefill steps "beside" too
    assert pin.num_pages == 8
    done: dict[str, Any] = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(done["beside"].outputs[0].token_ids) == hf_greedy(hf_model, prompt, 6)
    # 16 pages less 8 pinned: a request that needs 9 could never run now, and is refused up front
    with pytest.raises(ValueError, match="8 of them pinned"):
        eng.add_request("big", {"prompt_token_ids": tokens(vocab, 8 * BLOCK + 1, seed=12)}, greedy(2))
    eng.unpin(pin.pin_id)
    eng.shutdown()


def test_the_leak_check_names_pins_and_shutdown_frees_them(tiny_llama_dir):
    from conftest import leaked_state

    eng = engine(tiny_llama_dir)
    eng.pin(tokens(eng.loaded.config.vocab_size, 2 * BLOCK, seed=13))
    leaked = leaked_state(eng)
    assert leaked["num_pins"] == 1 and leaked["used_gpu_blocks"] == 2, leaked
    eng.shutdown()
    assert eng.scheduler.pins() == [] and eng.scheduler.num_pinned_blocks() == 0
    assert leaked_state(eng) == {}


def test_the_multiprocess_client_pins_unpins_and_expires(tiny_llama_dir, hf_model):
    # RemoteEngine: the mp client behind the Engine (the leak fixture cannot see into a core process)
    eng = RemoteEngine(EngineArgs(model=str(tiny_llama_dir), block_size=BLOCK, num_gpu_blocks=24, swap_space_gb=0,
                                  max_model_len=256, kv_host_cache_gb=0, max_num_seqs=2))
    try:
        vocab = eng.vocab_size
        system = tokens(vocab, SYSTEM_BLOCKS * BLOCK, seed=1)
        pin = eng.pin(system)
        short = eng.pin(tokens(vocab, BLOCK, seed=14), ttl_s=0.5)
        assert [p.pin_id for p in eng.list_pins()] == [pin.pin_id, short.pin_id]
        assert eng.stats()["num_pinned_blocks"] == SYSTEM_BLOCKS + 1
        with pytest.raises(PinCapError):
            eng.pin(tokens(vocab, 5 * BLOCK, seed=15))
        with pytest.raises(ValueError, match="ttl_s"):
            eng.pin(system, ttl_s=-1)
        pressure(eng, seed=2)
        user = system + tokens(vocab, 2 * BLOCK + 3, seed=3)
        out = run(eng, {"chat": user}, max_tokens=5)["chat"]
        assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, user, 5)
        assert out.cached_tokens_by_tier["device"] == SYSTEM_BLOCKS * BLOCK
        time.sleep(0.7)  # the short pin's TTL runs out while the core idles
        assert [p.pin_id for p in eng.list_pins()] == [pin.pin_id]
        eng.unpin(pin.pin_id)
        with pytest.raises(UnknownPinError):
            eng.unpin(pin.pin_id)
        stats = eng.stats()
        assert stats["num_pins"] == 0 and stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    finally:
        eng.shutdown()


def test_llm_pin_prefix_with_chat_messages(tiny_llama_dir):
    with LLM(model=str(tiny_llama_dir), block_size=BLOCK, num_gpu_blocks=64, swap_space_gb=0, max_model_len=256,
             kv_host_cache_gb=0, max_pinned_fraction=0.5) as llm:
        messages = [{"role": "system", "content": "You are a terse assistant who answers in one word."}]
        pin_id = llm.pin_prefix(messages)
        system = llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        chat = llm.engine.tokenizer.apply_chat_template(messages + [{"role": "user", "content": "Hi"}])
        assert chat[: len(system) // BLOCK * BLOCK] == system[: len(system) // BLOCK * BLOCK]
        out = llm.generate([{"prompt_token_ids": chat}], greedy(2), use_tqdm=False)[0]
        assert out.num_cached_tokens >= len(system) // BLOCK * BLOCK - BLOCK
        llm.unpin(pin_id)


# ---- the server ---------------------------------------------------------------------------

ADMIN, TENANT = "sk-admin", "sk-tenant"
SERVER_KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=8, num_gpu_blocks=32, max_model_len=64,
                                 kv_host_cache_gb=0)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_cache_endpoints_pin_list_unpin_behind_the_admin_key(tiny_llama_dir: Path) -> None:
    """In this process: the endpoints call the Engine's pin API, which the multiprocess client
    test above drives over the core pipe (a server over a core process adds ~25 s of start-up)."""
    from pagedrs.server.options import ServerOptions
    from server_fakes import assert_nothing_left, live_server

    options = ServerOptions(api_key=TENANT, admin_api_key=ADMIN)
    prompt = list(range(5, 25))  # 20 tokens: 2 full pages of 8
    with live_server(tiny_llama_dir, SERVER_KW, "tiny", options=options) as live:
        def call(method: str, path: str, key: str = ADMIN, **kw: Any) -> httpx.Response:
            return httpx.request(method, live.url + path, headers=bearer(key), timeout=120, **kw)

        assert call("POST", "/v1/cache/pin", key=TENANT, json={"prompt": prompt}).status_code == 401
        assert call("GET", "/v1/cache", key=TENANT).status_code == 401
        before = time.time()
        pinned = call("POST", "/v1/cache/pin", json={"prompt": prompt, "ttl_s": 600})
        assert pinned.status_code == 200, pinned.text
        body = pinned.json()
        assert (body["num_tokens"], body["num_pages"], body["ttl_s"]) == (16, 2, 600)
        assert before + 590 < body["expires_at"] <= time.time() + 600
        info = call("GET", "/v1/cache").json()
        assert [p["id"] for p in info["pins"]] == [body["id"]] and 0 < info["pins"][0]["ttl_left_s"] <= 600
        assert (info["pinned_pages"], info["max_pinned_pages"], info["total_pages"]["device"]) == (2, 8, 32)
        assert info["cached_pages"]["device"] >= 2 and 0 <= info["hit_rate"] <= 1
        done = call("POST", "/v1/completions", key=TENANT,
                    json={"model": "tiny", "prompt": prompt + [3], "max_tokens": 2, "temperature": 0.0})
        assert done.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16, done.text
        metrics = call("GET", "/metrics").text
        assert "pagedrs_prefix_pins 1.0" in metrics and "pagedrs_pinned_blocks 2.0" in metrics
        assert 'pagedrs_prefix_pin_requests_total{outcome="pinned"} 1.0' in metrics

        # bad bodies: 400 naming the field; past the cap: 409 naming it
        for bad, field in [({"prompt": prompt, "ttl_s": -1}, "ttl_s"), ({"prompt": prompt, "ttl_s": 1e9}, "ttl_s"),
                           ({"prompt": prompt, "ttl_s": "5"}, "ttl_s"), ({"prompt": prompt, "messages": []}, "prompt"),
                           ({}, "prompt"), ({"prompt": prompt, "colour": 1}, "colour"), ({"prompt": [1, 2]}, "block_size"),
                           # under the default shared isolation a tenant changes nothing: refused, never ignored
                           ({"prompt": prompt, "tenant": "alice"}, "--prefix-cache-isolation per-tenant"),
                           ({"prompt": list(range(3, 83))}, "max_model_len"),
                           ({"prompt": "a\ud800" * 20}, "lone surrogate"), ({"prompt": prompt, "cache_salt": "\udc80"}, "cache_salt"),
                           # a template renders them: 300 deep overflowed its stack (a 500)
                           ({"messages": [{"role": "user", "content": _nested(300)}]}, "nest 65 or more deep")]:
            refused = httpx.post(live.url + "/v1/cache/pin", content=json.dumps(bad).encode(), timeout=120,
                                 headers={**bearer(ADMIN), "Content-Type": "application/json"})  # \u escapes
            assert refused.status_code in (400, 422) and field in refused.text, (bad, refused.text)
        nan = httpx.post(live.url + "/v1/cache/pin", content=b'{"prompt": [5,6,7,8,9,10,11,12,13], "ttl_s": NaN}',
                         headers={**bearer(ADMIN), "Content-Type": "application/json"}, timeout=60)
        assert nan.status_code == 400 and "ttl_s" in nan.text, nan.text
        capped = call("POST", "/v1/cache/pin", json={"prompt": list(range(100, 160))})
        assert capped.status_code == 409 and "the cap is 8 of 32" in capped.json()["error"]["message"], capped.text

        assert call("DELETE", f"/v1/cache/pin/{body['id']}").json() == {"object": "cache.pin.deleted", "id": body["id"],
                                                                         "deleted": True}
        gone = call("DELETE", f"/v1/cache/pin/{body['id']}")
        assert gone.status_code == 404 and body["id"] in gone.json()["error"]["message"], gone.text
        assert call("GET", "/v1/cache").json()["pins"] == []
        stats = assert_nothing_left(live.loop)
        assert stats["num_pins"] == 0


def test_pin_prefix_file_good_and_bad(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    from pagedrs.server.cache_pins import load_pin_file, preload_pins
    from pagedrs.server.cli import main

    good = tmp_path / "pins.jsonl"
    good.write_text('# system prompts\n{"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13]}\n\n'
                    '{"messages": [{"role": "system", "content": "Answer in French."}], "ttl_s": 60}\n')
    eng = engine(tiny_llama_dir, max_pinned_fraction=1.0)
    ids = preload_pins(eng, str(good), "shared")
    assert len(ids) == 2 and [p.pin_id for p in eng.list_pins()] == ids and eng.list_pins()[1].ttl_s == 60
    eng.shutdown()
    for text, why in [('{"prompt": "a"}\n{"prompt": "b", "ttl": 5}\n', "line 2: ttl: ttl is not a field this server knows"),
                      ('{"prompt": "a"}\nnot json\n', "line 2: Expecting value"),
                      ('{"ttl_s": 5}\n', "line 1: it needs exactly one of 'prompt' and 'messages'"),
                      ('{"prompt": "a", "ttl_s": "long"}\n', "line 1: ttl_s")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError, match=why):
            load_pin_file(str(bad))
        assert main(["--model", str(tiny_llama_dir), "--pin-prefix", str(bad)]) == 2  # before any engine starts
        assert why.split(":")[0] in capsys.readouterr().err
    tenant = tmp_path / "tenant.jsonl"
    tenant.write_text('{"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13], "tenant": "alice"}\n')
    eng = engine(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"line 1: the pin was refused: .*tenant is 'alice', but the server runs "
                                         r"--prefix-cache-isolation shared"):
        preload_pins(eng, str(tenant), "shared")
    eng.shutdown()
    refused = tmp_path / "refused.jsonl"
    refused.write_text('{"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13]}\n{"prompt": [1, 2]}\n')
    eng = engine(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"line 2: the pin was refused: .*block_size = 4"):
        preload_pins(eng, str(refused), "shared")
    for p in eng.list_pins():
        eng.unpin(p.pin_id)
    eng.shutdown()


def test_a_pin_under_asynchronous_scheduling(tiny_llama_dir, hf_model):
    """Two steps in flight: the prefill's pages are pinned once its step is reported, never before."""
    eng = engine(tiny_llama_dir, async_scheduling=True)
    vocab = eng.loaded.config.vocab_size
    eng.add_request("beside", {"prompt_token_ids": tokens(vocab, 7, seed=20)}, greedy(8))
    system = tokens(vocab, SYSTEM_BLOCKS * BLOCK, seed=21)
    pin = eng.pin(system)
    assert pin.num_pages == SYSTEM_BLOCKS
    pressure(eng, seed=22)
    user = system + tokens(vocab, 5, seed=23)
    out = run(eng, {"chat": user}, max_tokens=4)["chat"]
    assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, user, 4)
    assert out.cached_tokens_by_tier["device"] == SYSTEM_BLOCKS * BLOCK
    eng.check_invariants()
    eng.unpin(pin.pin_id)
    eng.shutdown()


def _nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


class _RecordingEngine:
    """Takes ``--pin-prefix`` pins without an engine: what preload_pins asked for."""

    def __init__(self) -> None:
        self.pinned: list[tuple[Any, str | None]] = []

    def pin_prefix(self, prompt: Any, ttl_s: float | None, salt: str | None) -> str:
        self.pinned.append((prompt, salt))
        return f"pin-{len(self.pinned) - 1}"


@pytest.mark.parametrize(("line", "why"), [
    ('{"prompt": "abc", "cache_salt": ""}', "line 1: cache_salt: cache_salt has 0 bytes in UTF-8; allowed 1 to 256"),
    (json.dumps({"prompt": "abc", "cache_salt": "s" * 300}), "line 1: cache_salt: cache_salt has 300 bytes"),
])
def test_a_pin_file_salt_no_request_could_send_stops_the_start(tmp_path: Path, line: str, why: str) -> None:
    from pagedrs.server.cache_pins import load_pin_file

    path = tmp_path / "pins.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=why):
        load_pin_file(str(path))


def test_a_pin_file_tenant_no_api_key_names_stops_the_start(tmp_path: Path) -> None:
    from pagedrs.server.cache_pins import preload_pins

    path = tmp_path / "pins.jsonl"
    path.write_text('{"prompt": "abc", "tenant": "alice"}\n{"prompt": "abc", "tenant": "nosuchtenant"}\n')
    eng = _RecordingEngine()
    with pytest.raises(ValueError, match=r"line 2: the pin was refused: tenant is 'nosuchtenant', which no API key "
                                         r"of this server belongs to, so no request could hit the pin; allowed: alice, bob"):
        preload_pins(eng, str(path), "per-tenant", frozenset({"alice", "bob"}))
    assert [prompt for prompt, _ in eng.pinned] == ["abc"]  # line 1's, before the refusal


@pytest.mark.parametrize(("line", "why"), [
    # said "must have a string 'role' and a string 'content'; got keys ['content', 'role']", param "prompt"
    ('{"messages": [{"role": "user", "content": 5}]}', "line 1: messages.0.content is 5, a number; allowed: a string"),
    ('{"messages": [{"role": "system", "content": "a"}, {"role": "bogus", "content": "b"}]}',
     "line 1: messages.1.role is \"bogus\", a string; allowed: one of 'system', 'developer', 'user'"),
    ('{"messages": [{"content": "a"}]}', "line 1: messages.0.role is missing; allowed: one of 'system'"),
    # said "ttl_s.int: Input should be a valid integer"
    ('{"prompt": "x", "ttl_s": 1e400}', r"line 1: ttl_s is 1e400, a number too large \(it reads as infinity\); "
                                         r"allowed: seconds in \(0, 604800\], or null for no TTL"),
    ('{"prompt": [1, 2, -1e999]}', r"line 1: prompt.2 is -1e999, a number too large"),
    ('{"prompt": "x", "ttl_s": -5.5e-1, "ttl_s": 60}', "line 1: the line has the key 'ttl_s' twice in one object"),
    # json.loads kept the last of two equal keys: this line pinned [1, 2], silently
    ('{"prompt": "abc", "prompt": [1,2]}', "line 1: the line has the key 'prompt' twice in one object; each key may "
                                           "appear once"),
])
def test_a_bad_pin_file_line_is_named_with_its_field_and_value(tmp_path: Path, line: str, why: str) -> None:
    from pagedrs.server.cache_pins import load_pin_file

    path = tmp_path / "pins.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=why):
        load_pin_file(str(path))


def test_a_pin_file_saved_with_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    from pagedrs.server.cache_pins import load_pin_file

    path = tmp_path / "pins.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "abc", "ttl_s": 60}\n{"prompt": [1, 2]}\n')
    pins = load_pin_file(str(path))
    assert [(number, request.prompt, request.ttl_s) for number, request in pins] == [(1, "abc", 60), (2, [1, 2], None)]
    path.write_bytes(b'{"prompt": "abc"}\n\xef\xbb\xbf{"prompt": "x"}\n')  # only at the start: a mark elsewhere is text
    with pytest.raises(ValueError, match="line 2: "):
        load_pin_file(str(path))
