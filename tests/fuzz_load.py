"""A load for `make fuzz` (tests/fuzz_server.sh): concurrent clients against a running server.

``python tests/fuzz_load.py URL [REQUESTS]``: REQUESTS (default 200) completions, 32 at a time,
half of them streaming, every fourth streaming one disconnecting after 3 chunks; then waits
(bounded) until /metrics shows every KV page free. Prints a JSON summary.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

MODEL = "tiny-llama"


async def one(client: httpx.AsyncClient, url: str, i: int) -> str:
    stream = i % 2 == 0
    body = {"model": MODEL, "prompt": f"The quick brown fox {i}", "max_tokens": 48, "temperature": 1.0,
            "seed": i, "ignore_eos": True, "stream": stream}
    if not stream:
        return str((await client.post(url + "/v1/completions", json=body)).status_code)
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        chunks = 0
        async for line in response.aiter_lines():
            chunks += bool(line)
            if i % 8 == 0 and chunks == 3:
                return "disconnected"
        return str(response.status_code)


async def run(url: str, total: int) -> dict[str, int]:
    limit = asyncio.Semaphore(32)
    outcomes: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=300) as client:

        async def bounded(i: int) -> None:
            async with limit:
                outcome = await one(client, url, i)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        await asyncio.gather(*(bounded(i) for i in range(total)))
    return outcomes


def free_equals_total(url: str, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
        values = {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}
        if values["pagedrs_kv_free_blocks"] == values["pagedrs_kv_total_blocks"]:
            return True
        time.sleep(0.1)
    return False


if __name__ == "__main__":
    url, total = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200
    outcomes = asyncio.run(run(url, total))
    idle = free_equals_total(url)
    print(json.dumps({"requests": total, "outcomes": outcomes, "free_equals_total_after": idle}))
    sys.exit(0 if idle else 1)
