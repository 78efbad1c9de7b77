"""``pagedrs bench serve``: the served path measured as users run it, beside the offline engine.

Starts ``pagedrs serve`` (default settings: engine core in its own process, every core it
may use) on 127.0.0.1, replays a seeded workload through HTTP with the official ``openai``
client at a fixed concurrency (streaming, ``ignore_eos``, so every system generates the
same tokens), and reports generated tokens/s, time to first token and request latency
(p50 / p99), errors, the server's CPU use (its process tree, in cores) and RSS, and the
share of the core's busy time spent inside ``Engine.step``. Then the offline engine
(``LLM.generate``, same thread count) runs the same requests in the same process run.

Two workloads: ShareGPT-like random lengths (mean ~120 prompt / ~120 generated tokens in
the full run) and the same with every prompt behind one shared 600-token prefix
(``--workload random|prefix`` runs one; ``--no-offline`` skips the offline engine;
``--serve-args=...`` passes flags to the server, e.g. ``--serve-args=--no-prefill-first``).

TTFT references: "unloaded" is the median of three prompts sent one at a time to the idle
server (the issue's reference); "same prompts unloaded" sends the steady requests' prompt
lengths one at a time (like for like). The server's request trace splits each steady
request's TTFT into its parts (``ttft_breakdown``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pagedrs.bench import ttft_breakdown
from pagedrs.bench.config import BenchConfig
from pagedrs.bench.report import Column, markdown_table, render
from pagedrs.bench.workloads import BenchRequest, LengthDistribution, Workload, WorkloadSpec, synthetic_workload
from pagedrs.engine_args import usable_cores

SERVE_FULL = WorkloadSpec(
    name="sharegpt-like-serve",
    num_requests=96,
    prompt=LengthDistribution(mean=120, sigma=0.9, minimum=4, maximum=768),
    output=LengthDistribution(mean=120, sigma=0.8, minimum=4, maximum=512),
    max_model_len=1024,
)
SERVE_QUICK = WorkloadSpec(
    name="sharegpt-like-serve-quick",
    num_requests=16,
    prompt=LengthDistribution(mean=32, sigma=0.9, minimum=4, maximum=256),
    output=LengthDistribution(mean=32, sigma=0.8, minimum=4, maximum=128),
    max_model_len=512,
)


@dataclass(frozen=True)
class ServeSettings:
    concurrency: int
    shared_prefix_tokens: int


def _shared_prefix(workload: Workload, prefix_len: int, vocab_size: int) -> Workload:
    rng = np.random.default_rng(12345)
    prefix = rng.integers(vocab_size // 8, vocab_size, size=prefix_len).tolist()
    room = workload.spec.max_model_len + prefix_len
    requests = [replace(r, prompt_token_ids=prefix + r.prompt_token_ids) for r in workload.requests]
    return Workload(spec=replace(workload.spec, name=workload.spec.name + "+prefix", max_model_len=room), requests=requests)


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def _replay(url: str, model: str, requests: list[BenchRequest], concurrency: int, tag: str = "bench") -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=os.environ.get("PAGEDRS_API_KEY", "unused"), max_retries=0,
                         timeout=3600)
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    steady_ttfts: list[float] = []  # requests that started after the first `concurrency`: into a full server
    latencies: list[float] = []
    started = 0
    generated = 0
    errors: list[str] = []
    # Per request (by the X-Request-Id sent): client send and first-chunk times (time.monotonic,
    # the clock of the server's request trace) and whether it arrived at a full server.
    client_times: dict[str, tuple[float, float, bool]] = {}

    async def one(index: int, req: BenchRequest) -> None:
        nonlocal generated, started
        async with gate:
            start = time.monotonic()
            steady = started >= concurrency
            started += 1
            first = None
            request_id = f"{tag}{index}"
            try:
                stream = await client.completions.create(
                    model=model, prompt=req.prompt_token_ids, max_tokens=req.max_tokens, temperature=0.0,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                    extra_headers={"X-Request-Id": request_id},
                )
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].text is not None:
                        first = time.monotonic() - start
                        client_times[request_id] = (start, start + first, steady)
                    if chunk.usage is not None:
                        generated += chunk.usage.completion_tokens
            except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            latencies.append(time.monotonic() - start)
            if first is not None:
                ttfts.append(first)
                if steady:
                    steady_ttfts.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    wall = time.perf_counter() - start
    await client.close()
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall if wall else 0.0,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "steady_ttft_p50_s": _percentile(steady_ttfts, 50),
        "steady_ttft_p99_s": _percentile(steady_ttfts, 99),
        "latency_p50_s": _percentile(latencies, 50),
        "latency_p99_s": _percentile(latencies, 99),
        "errors": len(errors),
        "error_samples": errors[:3],
        "client_times": client_times,
    }


class _Server:
    """``pagedrs serve`` in a subprocess, with its process tree's CPU time and RSS."""

    def __init__(self, cfg: BenchConfig, max_model_len: int, trace_path: str) -> None:
        from pagedrs.net import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedrs.server", "--model", cfg.model, "--port", str(self.port),
               "--dtype", cfg.dtype, "--block-size", str(cfg.block_size), "--max-model-len", str(max_model_len),
               "--log-level", "warning", "--request-trace", trace_path, *cfg.serve_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"pagedrs serve exited with {self.proc.returncode}: {err[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"pagedrs serve was not healthy within {timeout_s} s")

    def _tree(self) -> list[Any]:
        import psutil

        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds of (the API process, everything under it: the engine core and its helpers)."""
        api = children = 0.0
        for p in self._tree():
            try:
                t = p.cpu_times()
            except Exception:  # noqa: BLE001 - a process that just exited
                continue
            if p.pid == self.proc.pid:
                api += t.user + t.system
            else:
                children += t.user + t.system
        return api, children

    def rss_bytes(self) -> int:
        total = 0
        for p in self._tree():
            try:
                total += p.memory_info().rss
            except Exception:  # noqa: BLE001
                pass
        return total

    def metric(self, name: str) -> float | None:
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith(name + " "):
                        return float(line.split()[1])
        except OSError:
            return None
        return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _fresh_copies(requests: list[BenchRequest], prefix_len: int) -> list[BenchRequest]:
    """The same prompt lengths (and shared prefix), each prompt's own tokens reversed: the prefix
    cache knows the prefix but not the rest, as it did when the originals arrived."""
    return [replace(r, prompt_token_ids=r.prompt_token_ids[:prefix_len] + r.prompt_token_ids[prefix_len:][::-1],
                    max_tokens=1) for r in requests]


def _serve_run(cfg: BenchConfig, workload: Workload, model_name: str, settings: ServeSettings,
               prefix_len: int) -> dict[str, Any]:
    trace_dir = tempfile.TemporaryDirectory(prefix="pagedrs-bench-serve-")
    trace_path = os.path.join(trace_dir.name, "requests.jsonl")
    server = _Server(cfg, workload.spec.max_model_len, trace_path)
    try:
        server.wait_ready()
        warm = [BenchRequest("warm", workload.requests[0].prompt_token_ids, 4)]
        asyncio.run(_replay(server.url, model_name, warm, 1, tag="warm"))
        # Unloaded: a few requests one at a time (their median), each a prompt of the workload.
        singles = [replace(r, max_tokens=4) for r in workload.requests[1:4]]
        unloaded = asyncio.run(_replay(server.url, model_name, singles, 1, tag="unloaded"))
        api0, core0 = server.cpu_seconds()
        client0 = time.process_time()
        result = asyncio.run(_replay(server.url, model_name, workload.requests, settings.concurrency))
        # The load generator (this process: the openai client parsing 32 SSE streams) shares the
        # machine's cores with the server; on 2 cores what it uses is taken from the engine.
        result["client_cpu_cores"] = (time.process_time() - client0) / result["wall_s"]
        api1, core1 = server.cpu_seconds()
        result["server_cpu_cores"] = (api1 - api0 + core1 - core0) / result["wall_s"]
        result["api_cpu_cores"] = (api1 - api0) / result["wall_s"]
        result["core_cpu_cores"] = (core1 - core0) / result["wall_s"]
        result["server_rss_gb"] = server.rss_bytes() / 1e9
        result["core_step_fraction"] = server.metric("pagedrs_core_step_fraction")
        result["unloaded_ttft_s"] = unloaded["ttft_p50_s"]
        steady = result["steady_ttft_p99_s"]
        result["steady_ttft_p99_over_unloaded"] = steady / unloaded["ttft_p50_s"] if steady and unloaded["ttft_p50_s"] else None
        # Like for like: the steady requests' prompt lengths, one at a time into an idle server.
        # The TTFT spread over prompt lengths is there without any load (a 480-token prompt's
        # prefill takes several times a 90-token one's), and the p50 above does not hold it.
        alone = asyncio.run(_replay(server.url, model_name,
                                    _fresh_copies(workload.requests[settings.concurrency:], prefix_len), 1, tag="alone"))
        result["unloaded_same_prompts_ttft_p50_s"] = alone["ttft_p50_s"]
        result["unloaded_same_prompts_ttft_p99_s"] = alone["ttft_p99_s"]
        result["steady_ttft_p99_over_unloaded_p99"] = (
            steady / alone["ttft_p99_s"] if steady and alone["ttft_p99_s"] else None)
        result["steady_ttft_p50_over_unloaded_p50"] = (
            result["steady_ttft_p50_s"] / alone["ttft_p50_s"] if result["steady_ttft_p50_s"] and alone["ttft_p50_s"] else None)
    finally:
        server.stop()
    trace = ttft_breakdown.read_trace(trace_path) if os.path.exists(trace_path) else {}
    trace_dir.cleanup()
    # Every request of the unloaded run arrived at an idle server: none is "steady" there.
    result["ttft_breakdown_unloaded"] = ttft_breakdown.summarize(
        ttft_breakdown.join(unloaded.pop("client_times"), trace, steady_only=False))
    result["ttft_breakdown_steady"] = ttft_breakdown.summarize(ttft_breakdown.join(result.pop("client_times"), trace))
    return result


def _offline_run(cfg: BenchConfig, workload: Workload, threads: int, max_num_seqs: int | None) -> dict[str, Any]:
    """``LLM.generate`` on the same requests; ``max_num_seqs`` caps the batch as the clients' concurrency does."""
    from pagedrs import LLM, SamplingParams

    extra = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    llm = LLM(model=cfg.model, dtype=cfg.dtype, block_size=cfg.block_size, cpu_threads=threads,
              max_model_len=workload.spec.max_model_len, **extra)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in workload.requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "generated_tokens": generated, "tokens_per_s": generated / wall}


def run(cfg: BenchConfig, machine: str) -> tuple[dict[str, Any], str]:
    from pagedrs.models import load_model

    spec = SERVE_QUICK if cfg.quick else SERVE_FULL
    if cfg.num_requests:
        spec = replace(spec, num_requests=cfg.num_requests)
    settings = ServeSettings(concurrency=8 if cfg.quick else 32, shared_prefix_tokens=128 if cfg.quick else 600)
    loaded = load_model(cfg.model)
    vocab, name = loaded.config.vocab_size, loaded.name
    del loaded
    model_name = cfg.model  # the server serves --model under that name
    threads = int(os.environ.get("PAGEDRS_CPU_THREADS") or usable_cores())  # what `pagedrs serve` uses too
    random = synthetic_workload(spec, vocab)
    by_name = {"random": random, "prefix": _shared_prefix(random, settings.shared_prefix_tokens, vocab)}
    workloads = [by_name[name] for name in cfg.serve_workloads]
    rows = []
    skipped = {"wall_s": None, "generated_tokens": None, "tokens_per_s": None}
    for workload in workloads:
        prefix_len = settings.shared_prefix_tokens if workload is by_name["prefix"] else 0
        served = _serve_run(cfg, workload, model_name, settings, prefix_len)
        # The served clients keep `concurrency` requests in flight; the offline engine given
        # every request at once batches up to max_num_seqs (256) and so does a different job.
        # Same batch cap = same workload; the uncapped run is shown beside it.
        offline = _offline_run(cfg, workload, threads, settings.concurrency) if cfg.serve_offline else skipped
        uncapped = _offline_run(cfg, workload, threads, None) if cfg.serve_offline else skipped
        served["served_over_offline"] = served["tokens_per_s"] / offline["tokens_per_s"] if offline["tokens_per_s"] else None
        served["served_over_uncapped"] = served["tokens_per_s"] / uncapped["tokens_per_s"] if uncapped["tokens_per_s"] else None
        rows.append({"workload": workload.spec.name, "system": f"pagedrs serve (default, {threads} threads)", **served})
        rows.append({"workload": workload.spec.name,
                     "system": f"offline LLM.generate ({threads} threads, max_num_seqs={settings.concurrency})", **offline})
        rows.append({"workload": workload.spec.name, "system": f"offline LLM.generate ({threads} threads, all at once)",
                     **uncapped})
    columns = [
        Column("workload", "workload"), Column("system", "system"), Column("tok/s", "tokens_per_s", "{:.1f}"),
        Column("TTFT p50 s", "ttft_p50_s", "{:.2f}"), Column("TTFT p99 s", "ttft_p99_s", "{:.2f}"),
        Column("steady TTFT p50 s", "steady_ttft_p50_s", "{:.2f}"), Column("steady TTFT p99 s", "steady_ttft_p99_s", "{:.2f}"),
        Column("latency p50 s", "latency_p50_s", "{:.2f}"), Column("latency p99 s", "latency_p99_s", "{:.2f}"),
        Column("errors", "errors"), Column("server CPU (cores)", "server_cpu_cores", "{:.2f}"),
        Column("API CPU", "api_cpu_cores", "{:.2f}"), Column("core CPU", "core_cpu_cores", "{:.2f}"),
        Column("client CPU", "client_cpu_cores", "{:.2f}"),
        Column("server RSS GB", "server_rss_gb", "{:.2f}"), Column("core in step", "core_step_fraction", "{:.0%}"),
        Column("unloaded TTFT s", "unloaded_ttft_s", "{:.2f}"),
    ]
    notes = [
        f"model {name}; {spec.num_requests} requests at concurrency {settings.concurrency}, streaming, ignore_eos; "
        f"shared-prefix variant: {settings.shared_prefix_tokens}-token prefix",
        "served/offline throughput at the same batch cap (and against the uncapped offline run): " + ", ".join(
            f"{w.spec.name}: {rows[3 * i]['served_over_offline']:.0%} ({rows[3 * i]['served_over_uncapped']:.0%})"
            for i, w in enumerate(workloads) if rows[3 * i]["served_over_offline"] and rows[3 * i]["served_over_uncapped"]
        ),
        "steady TTFT: requests that started after the first `concurrency` ones, i.e. arrived at a saturated "
        "server; steady p99 / unloaded: " + ", ".join(
            f"{w.spec.name}: {rows[3 * i]['steady_ttft_p99_over_unloaded']:.1f}x"
            for i, w in enumerate(workloads) if rows[3 * i].get("steady_ttft_p99_over_unloaded")
        ),
        "like for like (the steady requests' prompt lengths sent one at a time to the idle server): steady p99 / "
        "unloaded p99, steady p50 / unloaded p50: " + ", ".join(
            f"{w.spec.name}: {rows[3 * i]['steady_ttft_p99_over_unloaded_p99']:.1f}x, "
            f"{rows[3 * i]['steady_ttft_p50_over_unloaded_p50']:.1f}x (unloaded p50 "
            f"{rows[3 * i]['unloaded_same_prompts_ttft_p50_s']:.2f} s, p99 {rows[3 * i]['unloaded_same_prompts_ttft_p99_s']:.2f} s)"
            for i, w in enumerate(workloads) if rows[3 * i].get("steady_ttft_p99_over_unloaded_p99")
        ),
        "targets (issue 17): served >= 90% of offline; default serve >= 1.5x 61-66 tok/s on the random workload; "
        "shared-prefix TTFT p99 under load <= 2x unloaded TTFT",
    ]
    for i, w in enumerate(workloads):
        for label, key in (("steady (arrived at a full server)", "ttft_breakdown_steady"), ("unloaded", "ttft_breakdown_unloaded")):
            notes.append(f"TTFT breakdown, {w.spec.name}, {label} (parts add up to the TTFT; see bench/ttft_breakdown.py):\n\n"
                         + "\n".join(ttft_breakdown.render(rows[3 * i].get(key, {}))) + "\n")
    data = {"workloads": [w.summary() for w in workloads], "rows": rows, "threads": threads,
            "concurrency": settings.concurrency, "machine": machine, "serve_args": list(cfg.serve_args)}
    return data, render("Served path: HTTP through pagedrs serve vs the offline engine", markdown_table(rows, columns),
                        notes, machine)
