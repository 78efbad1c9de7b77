"""Tensor parallelism across two Ray nodes: a replica with tensor_parallel_size=2 whose second
rank is a Ray actor on the other node (``distributed_executor_backend="ray"``), gloo on the CPU.

Two Ray nodes on 127.0.0.1 (ray.cluster_utils.Cluster), one CPU each: the replica takes one,
so the worker's bundle can only be placed on the other node. Needs ``ray[serve]`` and
``PAGEDRS_TEST_RAY=1`` (``make test-ray``).
"""

from __future__ import annotations

import os
import socket
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
from server_fakes import live_server  # noqa: E402

pytestmark = pytest.mark.leaves_requests  # the replica's pages are checked through its stats instead

KW: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks=64, max_model_len=128,
                          kv_host_cache_gb=0, swap_space_gb=0)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster.address
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def test_a_tensor_parallel_replica_spans_two_nodes(two_nodes: str, tiny_llama_dir: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, distributed_executor_backend="ray", **KW)
    serve.run(build_app(args, num_replicas=1, routing="pow2", model_name="tiny", ray_actor_options={"num_cpus": 1}),
              name="pagedrs-tp", route_prefix="/")
    handle = serve.get_deployment_handle("PagedrsReplica", app_name="pagedrs-tp")
    where = handle.placement.remote().result(timeout_s=120)
    assert len(where["worker_node_ids"]) == 1
    assert where["worker_node_ids"][0] != where["node_id"], "rank 1 should run on the other node"
    with live_server(tiny_llama_dir, KW, "tiny") as single:  # one rank, one process: the referee
        for prompt in ([5, 6, 7, 8, 9, 10, 11], list(range(20, 45))):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1}
            want = httpx.post(single.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            got = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()["choices"][0]
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            assert got["text"] == want["text"]
    stats = handle.stats.remote().result(timeout_s=60)
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"] and stats["num_running"] == 0
    serve.delete("pagedrs-tp")
