"""`python -m pagedrs.server` in a subprocess: it serves, drains on SIGTERM, stops at once on a
second signal, and exits 0 either way with every client answered in the OpenAI shape.

Outcomes only: how each stream ended, the exit status, and that the process ended well
within a generous bound (far below --shutdown-timeout where the second signal must cut it).
The drain deadline itself is tested in-process, on a fake engine (test_server_guard.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from pagedrs import LLM, SamplingParams  # noqa: E402
from pagedrs.net import free_port  # noqa: E402

MODEL = "tiny-llama"
GREEDY = dict(temperature=0.0, max_tokens=8)
START_TIMEOUT_S = 180


class ServerProcess:
    def __init__(self, model_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "pagedrs.server", "--model", str(model_dir), "--served-model-name", MODEL,
            "--port", str(self.port), "--block-size", "8", "--num-gpu-blocks", "64", "--max-model-len", "256",
            "--log-level", "warning", *extra,
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited early:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not answer /health within {START_TIMEOUT_S} s")
            time.sleep(0.2)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def output(self) -> str:
        return self.proc.stdout.read() if self.proc.stdout else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def start_server(tiny_llama_dir: Path) -> Iterator[Any]:
    started: list[ServerProcess] = []

    def start(*extra: str) -> ServerProcess:
        started.append(ServerProcess(tiny_llama_dir, *extra))
        return started[-1]

    yield start
    for server in started:
        server.kill()


class Stream(threading.Thread):
    """One streaming completion on its own thread; ``first`` is set once a chunk has arrived."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()
        self.events: list[str] = []

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": self.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    self.events.append(line)
                    self.first.set()

    def last_payload(self) -> dict[str, Any]:
        assert self.events[-1] == "data: [DONE]", self.events[-3:]
        return json.loads(self.events[-2].removeprefix("data: "))


def _start_streams(url: str, count: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(url, max_tokens) for _ in range(count)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(120), "a stream produced no chunk within 120 s"
    return streams


def test_serve_answers_then_drains_running_streams_on_sigterm_and_exits_0(start_server: Any, tiny_llama_dir: Path) -> None:
    server = start_server("--shutdown-timeout", "120")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.completions.create(model=MODEL, prompt="The quick brown fox", **GREEDY).choices[0].text
    offline = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=64,
                  max_model_len=256)
    assert got == offline.generate("The quick brown fox", SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    streams = _start_streams(server.url, 3, max_tokens=40)
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(120) == 0, server.output()
    for s in streams:
        s.join(30)
        assert s.last_payload()["choices"][0]["finish_reason"] == "length"  # finished, not cut
    assert "Traceback" not in server.output()


def test_a_second_signal_aborts_at_once_with_openai_errors_and_exits_0(start_server: Any) -> None:
    server = start_server("--shutdown-timeout", "600")
    streams = _start_streams(server.url, 3, max_tokens=240)
    server.proc.send_signal(signal.SIGTERM)
    server.proc.send_signal(signal.SIGINT)
    assert server.wait(60) == 0, server.output()  # 60 s: far below the 600 s drain
    for s in streams:
        s.join(30)
        error = s.last_payload()["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_overloaded_error"
    assert "Traceback" not in server.output()
