"""The padded decode path end to end on the CPU: greedy tokens equal to the unpadded engine's and to
transformers' (float32), with prefix caching, chunked prefill and preemption in the same runs; padding
rows stay on the scratch page, which the scheduler never hands out.

On the CPU nothing is captured (``pad_decode=True`` runs the path CUDA graphs replay, eagerly); the
CUDA kernels' side of it runs under the emulator in tests/test_decode_graphs_kernels.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.decode_graphs import DecodePadding, capture_sizes
from pagedrs.model_runner import ModelRunner

torch.set_num_threads(1)
POISON = 1e4  # the scratch page's contents at start: a real row that read it would attend to nonsense


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt_ids):]


def prompts(vocab: int, count: int, shared: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (3 + (7 * i + 5) % 23,), generator=g).tolist() for i in range(count)]


class StepLog:
    """Every step's block tables and whether it ran padded (and to which size)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.tables: list[list[list[int]]] = []
        self.sizes: list[int | None] = []
        original = runner.execute

        def execute(step, compute_logits=True, **kw):  # (kw: asynchronous scheduling's device fill)
            if step.num_tokens:
                self.tables.append(step.block_tables.tolist())
                self.sizes.append(runner.padded_size(step))
            return original(step, compute_logits, **kw)

        runner.execute = execute  # type: ignore[method-assign]


def run(folder: Path, ps: list[list[int]], max_tokens: int | list[int], **kw) -> tuple[dict[str, list[int]], Engine, StepLog]:
    args = dict(model=str(folder), block_size=4, num_gpu_blocks=24, swap_space_gb=0.01, max_model_len=128,
                max_num_batched_tokens=24, max_num_seqs=6, enable_prefix_caching=True, preemption_mode="swap",
                admission_policy="prompt_only", watermark=0.0)  # fmt: skip
    args.update(kw)
    engine = Engine(EngineArgs(**args))
    runner = engine.core.executor.runner
    if runner.static is not None:  # poisoned (finite: the torch backend multiplies masked keys by 0)
        runner.kv_cache[:, :, runner.static.scratch_block] = POISON
    log = StepLog(runner)
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(ps)
    for i, (p, n) in enumerate(zip(ps, lengths, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
    return done, engine, log


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_padded_decode_equals_unpadded_and_transformers(tiny_model_dir, hf_tiny, mode):
    """24 pages of 4 tokens for 8 requests of up to ~45 tokens: preemption; a 24-token budget chunks
    prompts; a 9-token shared prefix gives prefix hits. Decode steps of 1..6 rows pad to 1, 2, 4, 8."""
    vocab = hf_tiny.config.vocab_size
    ps = prompts(vocab, 8, shared=9, seed=3)
    padded, engine, log = run(tiny_model_dir, ps, 16, pad_decode=True, preemption_mode=mode)
    plain, plain_engine, plain_log = run(tiny_model_dir, ps, 16, pad_decode=False, preemption_mode=mode)
    assert padded == plain
    for i, p in enumerate(ps):
        assert padded[f"r{i}"] == hf_greedy(hf_tiny, p, 16), f"request r{i}"
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_hits"] > 0
    assert stats["num_gpu_blocks"] == plain_engine.stats()["num_gpu_blocks"] == 24
    runner = engine.core.executor.runner
    assert runner.kv_cache.shape[2] == 25 and plain_engine.core.executor.runner.kv_cache.shape[2] == 24
    # the scratch page (id 24) is never in a table the scheduler made
    assert max(b for t in log.tables for row in t for b in row) < 24
    padded_sizes = {s for s in log.sizes if s is not None}
    assert padded_sizes <= {1, 2, 4, 8} and len(padded_sizes) >= 3
    assert None in log.sizes, "prefill and mixed steps run unpadded"
    assert all(s is None for s in plain_log.sizes)
    assert any(len(t) < s for t, s in zip(log.tables, log.sizes, strict=True) if s is not None), "padding rows ran"
    # padding rows wrote their K/V to slot 0 of the scratch page (read by nothing else), and nothing else of it
    scratch = runner.kv_cache[:, :, 24]
    assert (scratch[:, :, 0] != POISON).all() and (scratch[:, :, 1:] == POISON).all()


def test_decode_steps_wider_than_the_largest_capture_size_run_unpadded(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr("pagedrs.executor.local.capture_sizes", lambda n: capture_sizes(n, limit=2))
    ps = prompts(256, 6, shared=0, seed=5)
    lengths = [4, 6, 8, 10, 12, 14]  # the batch narrows from 6 rows to 1
    padded, engine, log = run(tiny_llama_dir, ps, lengths, pad_decode=True, num_gpu_blocks=64,
                              max_num_batched_tokens=256)  # fmt: skip
    plain, _, _ = run(tiny_llama_dir, ps, lengths, pad_decode=False, num_gpu_blocks=64, max_num_batched_tokens=256)
    assert padded == plain
    assert engine.core.executor.runner.padding.sizes == (1, 2)
    widths = [(len(t), s) for t, s in zip(log.tables, log.sizes, strict=True)]
    assert (6, None) in widths, "a decode step of 6 rows ran unpadded"
    assert any(s == 2 for _, s in widths) and any(s == 1 for _, s in widths)


def test_the_scratch_page_comes_out_of_kv_cache_memory(tiny_llama_dir):
    """A pool sized in bytes holds the scratch page too: the scheduler gets one block fewer."""
    base = dict(model=str(tiny_llama_dir), block_size=4, max_model_len=64, swap_space_gb=0.0)
    plain = Engine(EngineArgs(**base, kv_cache_memory=2**20))
    per_block = plain.stats()["kv_bytes_per_block"]
    padded = Engine(EngineArgs(**base, kv_cache_memory=2**20, pad_decode=True))
    assert padded.stats()["num_gpu_blocks"] == plain.stats()["num_gpu_blocks"] - 1 == 2**20 // per_block - 1
    runner = padded.core.executor.runner
    assert runner.kv_cache.shape[2] == 2**20 // per_block
    assert runner.static is not None and runner.static.scratch_block == padded.stats()["num_gpu_blocks"]
    assert runner.padding.table_width == 16  # ceil(64 / 4)


class _EagerGraphs:
    """Stands in for DecodeGraphs on the CPU: a "replay" runs the padded forward on the model as it
    was at capture (not through the runner's attribute, which a benchmark may wrap)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.sizes, self.replays = runner.padding.sizes, 0
        model, backend, views, bs = runner.model, runner.backend, runner.kv_views, runner.block_size
        width = runner.padding.table_width * bs

        def forward(step):
            backend.plan_padded_decode(step.meta, bs, model.heads_per_rank, model.kv_heads_per_rank, width)
            return model.compute_logits(model(step.input_ids, step.positions, views, step.meta, backend))

        self._forward = forward

    def replay(self, step):
        self.replays += 1
        return self._forward(step)


def test_bench_overhead_stamps_a_graph_replay_as_the_forward_pass(tmp_path):
    """`pagedrs bench overhead --device cuda` runs with CUDA graphs: a replay calls no model, so the
    benchmark stamps the replay itself (here with a stand-in graph set on a padded CPU engine)."""
    from pagedrs.bench import overhead

    spec = overhead.OverheadSpec(batch_sizes=(3,), layers=2, prompt_len=4, warmup_steps=1, steps=3)
    engine = overhead.build_overhead_engine(overhead.write_model(tmp_path / "m", 2), spec)
    plain = overhead.time_decode_steps(engine, spec, 3, seed=0)
    runner = engine.core.executor.runner
    padded_runner = ModelRunner(runner.loaded, num_gpu_blocks=runner.num_gpu_blocks, num_cpu_blocks=0,
                                block_size=runner.block_size, backend=runner.backend,
                                padding=DecodePadding(sizes=(1, 2, 4), table_width=8))  # fmt: skip
    padded_runner.graphs = graphs = _EagerGraphs(padded_runner)
    engine.core.executor.runner = padded_runner
    rows = overhead.time_decode_steps(engine, spec, 3, seed=1)
    assert graphs.replays >= spec.steps and len(rows) == len(plain) == spec.steps
    # the head runs inside the replay: its own part is the two stamps' distance, nothing
    assert all(0 < r["head"] < r["forward"] / 10 and r["runner"] >= r["forward"] for r in rows)


def test_padded_decode_under_asynchronous_scheduling_equals_the_synchronous_engine(tiny_llama_dir):
    """Placeholder input ids are filled before the step reaches the runner; the padded path then copies
    them into its static buffers like any other id."""
    ps = prompts(256, 6, shared=5, seed=9)
    lengths = [5, 9, 13, 7, 11, 3]
    sync, _, _ = run(tiny_llama_dir, ps, lengths, pad_decode=False)
    padded_async, engine, log = run(tiny_llama_dir, ps, lengths, pad_decode=True, async_scheduling=True)
    assert padded_async == sync
    assert any(s is not None and len(t) < s for t, s in zip(log.tables, log.sizes, strict=True))
