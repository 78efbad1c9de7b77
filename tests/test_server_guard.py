"""The server's defences, on a fake engine: API key, body limits, read timeouts, keep-alive after
client errors, the last-resort JSON 500, one request's failure staying its own, and the drain.

Each test states an outcome (a status, a body, a closed connection) and waits for it on a
condition or a socket with a generous deadline; none measures time.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from pagedrs.server.options import ServerOptions  # noqa: E402
from server_fakes import EXPLODE, MODEL, POISON, FakeEngine, Served, served_factory, wait_until  # noqa: E402


@pytest.fixture
def make_served() -> Iterator[Callable[..., Served]]:
    yield from served_factory()

KEY = "sk-test-0123456789"
SMALL_BODY_LIMIT = 64 * 1024


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout bounds the wait)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


# --- API key ------------------------------------------------------------------------------


@pytest.fixture
def keyed(make_served: Callable[..., Served]) -> Served:
    return make_served(FakeEngine(), options=ServerOptions(api_key=KEY))


@pytest.mark.parametrize("headers,message", [
    ({}, "Missing API key"),
    ({"Authorization": "Bearer wrong-key"}, "Incorrect API key provided"),
    ({"Authorization": f"Basic {KEY}"}, "Malformed Authorization header"),
    ({"Authorization": "Bearer"}, "Malformed Authorization header"),
])
def test_v1_routes_need_the_api_key(keyed: Served, headers: dict[str, str], message: str) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
        response = httpx.request(method, keyed.url + path, headers=headers, json={"model": MODEL, "prompt": "a"})
        error = _error(response, 401)
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert message in error["message"]
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_right_key_is_accepted_and_health_is_open(keyed: Served) -> None:
    assert keyed.client(api_key=KEY).completions.create(model=MODEL, prompt="a", max_tokens=2).choices[0].text == "ab"
    assert httpx.get(keyed.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(keyed.url + "/health").json() == {"status": "ok"}
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="wrong").models.list()


def test_metrics_public_opens_metrics_only(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine(), options=ServerOptions(api_key=KEY, metrics_public=True))
    assert httpx.get(served.url + "/metrics").status_code == 200
    _error(httpx.get(served.url + "/v1/models"), 401)


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedrs.server.cli import build_parser, server_options

    monkeypatch.setenv("PAGEDRS_API_KEY", "from-env")
    assert server_options(build_parser().parse_args([])).api_key == "from-env"
    assert server_options(build_parser().parse_args(["--api-key", "flag"])).api_key == "flag"


@pytest.mark.parametrize("flag, env, named", [("", None, "--api-key"), ("  ", "from-env", "--api-key"),
                                              (None, "", "$PAGEDRS_API_KEY")])
def test_an_empty_api_key_is_refused_not_read_as_none(monkeypatch: pytest.MonkeyPatch, flag, env, named) -> None:
    """`--api-key "$KEY"` with KEY unset started a server anyone could use: an empty key given is an error."""
    from pagedrs.server.cli import build_parser, main, server_options

    monkeypatch.delenv("PAGEDRS_API_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("PAGEDRS_API_KEY", env)
    argv = [] if flag is None else ["--api-key", flag]
    with pytest.raises(ValueError, match=rf"{re.escape(named)} is empty: pass a non-empty key"):
        server_options(build_parser().parse_args(argv))
    assert main(argv) == 2  # before any model loads


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_outside_0_to_65535_is_refused_with_the_flags(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It failed in bind() with a traceback, after the model had loaded."""
    from pagedrs.server.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--port", port])
    assert exc.value.code == 2 and "allowed: 0 to 65535" in capsys.readouterr().err


# --- body size and read timeouts ---------------------------------------------------------------


@pytest.fixture
def limited(make_served: Callable[..., Served]) -> Served:
    return make_served(FakeEngine(), options=ServerOptions(max_request_bytes=SMALL_BODY_LIMIT, read_timeout_s=0.5))


def test_a_declared_body_over_the_limit_gets_413(limited: Served) -> None:
    body = json.dumps({"model": MODEL, "prompt": "a" * SMALL_BODY_LIMIT}).encode()
    response = httpx.post(limited.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    error = _error(response, 413)
    assert f"--max-request-bytes is {SMALL_BODY_LIMIT}" in error["message"]


def test_a_chunked_body_over_the_limit_gets_413(limited: Served) -> None:
    """No Content-Length: the streamed bytes are counted."""

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "fake", "prompt": "'
        for _ in range(2 * SMALL_BODY_LIMIT // 1024):
            yield b"a" * 1024
        yield b'"}'

    response = httpx.post(limited.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    error = _error(response, 413)
    assert f"--max-request-bytes={SMALL_BODY_LIMIT}" in error["message"]


def test_a_partial_request_head_is_answered_408_and_closed(limited: Served) -> None:
    with socket.create_connection((limited.http.host, limited.http.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith("The request head did not arrive")


def test_an_idle_connection_is_closed(limited: Served) -> None:
    with socket.create_connection((limited.http.host, limited.http.port), timeout=30) as sock:
        assert _read_until_closed(sock) == b""


def test_a_body_that_stalls_is_answered_408_and_closed(limited: Served) -> None:
    with socket.create_connection((limited.http.host, limited.http.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive within --read-timeout=0.5 s" in reply


def test_a_malformed_request_head_gets_a_json_400(limited: Served) -> None:
    with socket.create_connection((limited.http.host, limited.http.port), timeout=30) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"


# --- keep-alive after client errors, and the last-resort 500 -----------------------------------


def test_errors_keep_the_connection_alive(make_served: Callable[..., Served]) -> None:
    """A 400 (lone surrogate), a 404, a 500 (the tokenizer raises) and a 200 all travel on one connection."""
    served = make_served(FakeEngine())
    conn = http.client.HTTPConnection(served.http.host, served.http.port, timeout=60)
    sock = None
    cases = [
        ("/v1/completions", b'{"model": "fake", "prompt": "\\ud800"}', 400),
        ("/v1/nothing-here", b"{}", 404),
        ("/v1/chat/completions",
         json.dumps({"model": MODEL, "messages": [{"role": "user", "content": EXPLODE}]}).encode(), 500),
        ("/v1/completions", b'{"model": "fake", "prompt": "a", "max_tokens": 2}', 200),
    ]
    try:
        for path, body, status in cases:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            payload = json.loads(response.read())
            assert response.status == status, payload
            assert response.getheader("content-type") == "application/json"
            assert (status == 200) == ("error" not in payload)
            sock = sock or conn.sock
            assert conn.sock is sock and sock is not None, f"the connection was closed after a {status}"
    finally:
        conn.close()


def test_an_unexpected_exception_is_a_json_500_without_details(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine())
    body = {"model": MODEL, "prompt": f"a{EXPLODE}", "stream": True}
    error = _error(httpx.post(served.url + "/v1/completions", json=body), 500)
    assert error["type"] == "internal_server_error" and "ZeroDivisionError" not in error["message"]


# --- one request's failure -------------------------------------------------------------------------


def test_a_request_the_engine_fails_fails_alone(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine())
    client = served.client()
    with ThreadPoolExecutor(2) as pool:
        bystander = pool.submit(lambda: list(client.completions.create(
            model=MODEL, prompt="a", max_tokens=6, stream=True)))
        with pytest.raises(openai.InternalServerError) as failed:
            client.completions.create(model=MODEL, prompt=POISON, max_tokens=6)
        chunks = bystander.result(timeout=60)
    assert "injected failure of this request" in failed.value.body["message"]
    assert "".join(c.choices[0].text for c in chunks) == "abcdef"


# --- 503s say when to retry --------------------------------------------------------------------


def test_503_carries_retry_after(make_served: Callable[..., Served]) -> None:
    served = make_served(FakeEngine(), max_waiting=0)
    response = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
    error = _error(response, 503)
    assert error["code"] == "server_overloaded" and int(response.headers["retry-after"]) >= 1


# --- the drain -----------------------------------------------------------------------------------


def _sse_events(url: str, body: dict[str, Any], into: list[str]) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        into.extend(line for line in response.iter_lines() if line)


def test_drain_refuses_new_requests_and_lets_running_ones_finish(make_served: Callable[..., Served]) -> None:
    permits = threading.Semaphore(0)
    served = make_served(FakeEngine(permits=permits), options=ServerOptions(shutdown_timeout_s=60))
    events: list[str] = []
    streamer = threading.Thread(target=_sse_events, args=(served.url, {
        "model": MODEL, "prompt": "a", "max_tokens": 3, "stream": True}, events))
    streamer.start()
    wait_until(lambda: served.count("step") >= 1, "the stream's first step")
    served.http.drain()
    refused = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "b"})
    assert _error(refused, 503)["code"] == "server_shutting_down" and refused.headers["retry-after"]
    assert _error(httpx.get(served.url + "/health"), 503)["code"] == "server_shutting_down"
    permits.release(10_000)
    streamer.join(60)
    texts = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1]]
    # A stream that lags gets merged events (DeltaStream); the text is the same, in order.
    assert "".join(texts) == "abc" and all(texts) and events[-1] == "data: [DONE]"
    assert served.http.join(60), "the server did not stop after its last request finished"


def test_drain_deadline_aborts_what_is_left_with_openai_errors(make_served: Callable[..., Served]) -> None:
    """Requests that cannot finish before --shutdown-timeout end with a 503 error (JSON, or an SSE
    error event and [DONE]), and the engine holds nothing afterwards (make_served checks)."""
    served = make_served(FakeEngine(max_model_len=2**40), options=ServerOptions(shutdown_timeout_s=0.2))
    endless = {"model": MODEL, "prompt": "a", "max_tokens": 10**9}
    events: list[str] = []
    streamer = threading.Thread(target=_sse_events, args=(served.url, {**endless, "stream": True}, events))
    streamer.start()
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, served.url + "/v1/completions", json=endless, timeout=60)
        wait_until(lambda: served.count("add") == 2, "both requests in the engine")
        served.http.drain()
        error = _error(whole.result(timeout=60), 503)
    streamer.join(60)
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["code"] == "server_shutting_down"
    assert served.http.join(60)
    assert not served.engine.has_unfinished()
