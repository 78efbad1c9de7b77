"""`pagedrs serve-ray` in a subprocess: it serves through Ray's proxy and, on SIGTERM, lets the
streams in flight finish (Ray's graceful shutdown of the replicas, bounded by
--shutdown-timeout) and exits 0, as `pagedrs serve` drains (tests/test_server_shutdown.py).

Needs ``ray[serve]`` and ``PAGEDRS_TEST_RAY=1`` (``make test-ray``): a local Ray cluster starts
inside the subprocess, which takes most of a minute on 2 cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

if os.environ.get("PAGEDRS_TEST_RAY") != "1":
    pytest.skip("the Ray app's tests run with PAGEDRS_TEST_RAY=1 (make test-ray)", allow_module_level=True)
pytest.importorskip("ray.serve")

from pagedrs.net import free_port  # noqa: E402
from test_server_shutdown import MODEL, _start_streams  # noqa: E402

START_TIMEOUT_S = 300


def test_serve_ray_drains_running_streams_on_sigterm_and_exits_0(tiny_llama_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedrs.cli", "serve-ray", "--model", str(tiny_llama_dir), "--served-model-name",
           MODEL, "--port", str(port), "--block-size", "8", "--num-gpu-blocks", "64", "--max-model-len", "256",
           "--device", "cpu", "--dtype", "float32", "--num-replicas", "1", "--shutdown-timeout", "120",
           "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster of its own
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"serve-ray did not answer within {START_TIMEOUT_S} s"
            time.sleep(0.5)
        streams = _start_streams(url, 2, max_tokens=40)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0
        for s in streams:
            s.join(30)
            assert s.last_payload()["choices"][0]["finish_reason"] == "length"  # finished, not cut
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
