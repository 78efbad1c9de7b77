"""Schema fuzzing (Schemathesis, on Hypothesis) of a live server with a real engine.

Every operation in the server's own OpenAPI schema gets schema-valid requests
("positive"), schema-valid ones moved into the sampling ranges ("valid", so that most reach
the engine) and schema-violating ones ("negative"). The oracle:

* never a 5xx, and never an SSE error event of type internal_server_error inside a 200;
* every body is JSON or an event stream (``/metrics`` answers in Prometheus's text format);
* afterwards ``/health`` answers within 1 s, and once idle ``/metrics`` shows every KV page
  free and no request running, waiting or swapped.

Generation is kept small (``max_tokens`` <= 8, ``n`` <= 2) so that `make test` spends its
time on inputs, not tokens. `make fuzz` (tests/fuzz_server.sh) runs many more examples,
randomized, optionally against a separate `pagedrs serve` process (PAGEDRS_SERVER_FUZZ_URL).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from server_fakes import live_server  # noqa: E402

MODEL = "tiny-llama"
EXAMPLES = int(os.environ.get("PAGEDRS_SERVER_FUZZ_EXAMPLES", "30"))  # per operation and mode
RANDOMIZED = os.environ.get("PAGEDRS_SERVER_FUZZ_RANDOM") == "1"
EXTERNAL_URL = os.environ.get("PAGEDRS_SERVER_FUZZ_URL")  # fuzz a running server instead of an in-process one
REPORT = os.environ.get("PAGEDRS_SERVER_FUZZ_REPORT")  # write the counts here as JSON
ENGINE_KW: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=16, num_gpu_blocks=64, max_num_seqs=8, max_model_len=256,
    swap_space_gb=0.01,
)
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2}
BODY_TYPES = ("application/json", "text/event-stream")


@pytest.fixture(scope="module")
def target(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    """(base url, OpenAPI schema) of the server under test."""
    if EXTERNAL_URL:
        yield EXTERNAL_URL, httpx.get(EXTERNAL_URL + "/openapi.json", timeout=30).json()
        return
    with live_server(request.getfixturevalue("tiny_llama_dir"), ENGINE_KW, MODEL) as live:
        yield live.url, live.app.openapi()


def _steer(body: Any, kind: str) -> None:
    """Shape a generated body for ``kind``; generation is kept short whatever the kind.

    * every kind: integer lengths above CAPS are lowered;
    * "positive" (schema-valid): names the served model, or nearly all would stop at the 404;
    * "valid": also moves every sampling field into SamplingParams's ranges, so that most
      requests reach the engine with extreme but allowed values (the defects of issue 10
      lived there: a huge top_k, a seed near 2**64, a tiny temperature);
    * "negative" (schema-violating): nothing more.
    """
    if not isinstance(body, dict):
        return
    for key, cap in CAPS.items():
        value = body.get(key)
        if _is_int(value) and value > cap:
            body[key] = cap
    if kind == "negative":
        return
    if "model" in body:
        body["model"] = MODEL
    if kind == "valid":
        for key, (low, high) in VALID_RANGES.items():
            value = body.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                clamped = min(max(value, low), high)
                body[key] = int(clamped) if isinstance(low, int) else float(clamped)
        if "best_of" in body:
            body["best_of"] = body.get("n", 1)
        _steer_beam_search(body)
        if isinstance(body.get("prompt"), list):
            body["prompt"] = _token_ids_in_vocab(body["prompt"]) or "fox"
        if isinstance(body.get("stop_token_ids"), list):
            body["stop_token_ids"] = [abs(t) % VOCAB for t in body["stop_token_ids"] if _is_int(t)]


BEAM_CONFLICTS = ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "logprobs", "top_logprobs", "stop", "stream")


def _steer_beam_search(body: dict[str, Any]) -> None:
    """Beam-search fields are valid only with use_beam_search=true, which refuses sampling settings."""
    if body.get("use_beam_search") is True:
        for key in BEAM_CONFLICTS:
            body.pop(key, None)
        body["temperature"] = 0
        if isinstance(body.get("length_penalty"), (int, float)):
            body["length_penalty"] = min(max(body["length_penalty"], -100), 100)
    else:
        body.pop("length_penalty", None)
        body.pop("early_stopping", None)


# SamplingParams's ranges (ends included; an excluded end is approached from inside).
VALID_RANGES: dict[str, tuple[float, float]] = {
    "n": (1, 2), "max_tokens": (1, 8), "max_completion_tokens": (1, 8), "min_tokens": (0, 1),
    "temperature": (0, 2), "top_p": (5e-324, 1), "top_k": (-1, 2**31 - 1), "min_p": (0, 1),
    "presence_penalty": (-2, 2), "frequency_penalty": (-2, 2), "repetition_penalty": (5e-324, 2),
    "logprobs": (0, 20), "top_logprobs": (0, 20), "seed": (0, 2**63 - 1), "priority": (-(2**31), 2**31 - 1),
}
VOCAB = 256  # byte tokens: inside the tiny tokenizer's vocabulary


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids_in_vocab(prompt: list[Any]) -> Any:
    if all(_is_int(t) for t in prompt):
        return [abs(t) % VOCAB for t in prompt]
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return [[abs(t) % VOCAB for t in p] for p in prompt]
    return [p for p in prompt if isinstance(p, str) and p] or None


def _check(path: str, response: Any, body: Any = None, method: str = "GET") -> None:
    """The oracle for one response (see the module docstring)."""
    text = response.text
    where = f"{path} {json.dumps(body)[:2000] if isinstance(body, dict) else ''} -> {response.status_code}: {text[:300]!r}{' ... ' + repr(text[-300:]) if len(text) > 300 else ''}"
    assert response.status_code < 500, where
    if method.upper() == "HEAD":  # /health and /v1/models answer HEAD: no body, by definition
        assert text == "", where
        return
    content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis keeps every value
    if path == "/metrics" and response.status_code == 200:
        assert content_type.startswith("text/plain"), where
        return
    assert content_type.startswith(BODY_TYPES), where
    if content_type.startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
        assert not response.stream_cut_short, "the client stopped reading the stream: raise max_stream_events"
        assert events and events[-1] == "[DONE]", where
        for event in events[:-1]:
            error = json.loads(event).get("error")
            assert error is None or error["type"] != "internal_server_error", where
    else:
        json.loads(response.text)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _wait_idle(url: str, timeout_s: float = 120.0) -> dict[str, float]:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(url)
        busy = m["pagedrs_requests_running"] + m["pagedrs_requests_waiting"] + m["pagedrs_requests_swapped"]
        if busy == 0 and m["pagedrs_kv_free_blocks"] == m["pagedrs_kv_total_blocks"]:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"not idle {timeout_s} s after the fuzz run: {m}")
        time.sleep(0.05)


def _fuzz(operation: Any, kind: str, url: str, counts: Counter[str]) -> None:
    """EXAMPLES cases of one operation and kind, each sent and checked."""
    mode = schemathesis.GenerationMode.NEGATIVE if kind == "negative" else schemathesis.GenerationMode.POSITIVE
    name = f"{operation.method.upper()} {operation.path} {kind}"

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, derandomize=not RANDOMIZED,
        suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        _steer(case.body, kind)
        response = case.call(base_url=url, timeout=120)
        counts[f"{name} {response.status_code}"] += 1
        _check(operation.path, response, case.body, case.method)

    try:
        fuzz()
    except Unsatisfiable:  # nothing to violate: a GET without parameters has no negative cases
        counts[f"{name} no-cases"] += 1


def test_schema_fuzz_never_500s_and_leaks_nothing(target: tuple[str, dict[str, Any]]) -> None:
    url, openapi = target
    schema = schemathesis.openapi.from_dict(openapi)
    schema.config.max_stream_events = 1_000_000  # read every stream to its end ([DONE] is checked)
    counts: Counter[str] = Counter()
    for result in schema.get_all_operations():
        for kind in ("positive", "valid", "negative"):
            _fuzz(result.ok(), kind, url, counts)
    health = httpx.get(url + "/health", timeout=1.0)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    metrics = _wait_idle(url)
    assert metrics["pagedrs_kv_free_blocks"] == metrics["pagedrs_kv_total_blocks"] > 0
    if REPORT:
        Path(REPORT).write_text(json.dumps(dict(sorted(counts.items())), indent=1))
    assert sum(counts.values()) >= EXAMPLES  # the fuzzer did run
