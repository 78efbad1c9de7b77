"""The page tiers below the device, end to end: greedy tokens equal to transformers with
every tier combination on pools so small that pages really travel device → host → disk
→ device, and after a restart on the disk store; damaged and mismatched stores are
ignored (one warning) without ever changing an output.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from pagedrs import Engine, EngineArgs
from pagedrs.kv_tiers.disk_store import FILE_NAME, HEADER_BYTES
from test_engine import greedy, hf_greedy, run_all

BLOCK = 4
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * BLOCK  # tiny llama: layers x K,V x kv heads x head_dim x fp32


def gib(blocks: int) -> float:
    return blocks * BYTES_PER_BLOCK / 2**30


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def conversations(vocab: int, users: int = 6, seed: int = 0) -> list[list[int]]:
    """Per user a distinct prompt of 8-9 blocks after a shared 2-block system prefix."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab, (2 * BLOCK,), generator=g).tolist()
    return [system + torch.randint(3, vocab, (25 + 3 * u % 7,), generator=g).tolist() for u in range(users)]


def engine(model_dir, **kw) -> Engine:
    args = dict(model=str(model_dir), block_size=BLOCK, num_gpu_blocks=24, swap_space_gb=0, max_model_len=256,
                kv_host_cache_gb=0, max_num_seqs=2)
    args.update(kw)
    return Engine(EngineArgs(**args))


def two_turns(eng: Engine, prompts: list[list[int]], max_tokens: int = 6) -> list[dict[str, list[int]]]:
    """Every user once, then every user again: the second turn finds pages the first
    turn's later users pushed off the device."""
    return [run_all(eng, prompts, greedy(max_tokens)) for _ in range(2)]


TIERS = {
    "device": dict(),
    "host": dict(kv_host_cache_gb=gib(20)),
    "host+disk": dict(kv_host_cache_gb=gib(24), kv_disk_gb=gib(400)),
    "disk": dict(kv_disk_gb=gib(400)),
}


@pytest.mark.parametrize("tiers", sorted(TIERS))
def test_greedy_matches_transformers_with_every_tier_combination(tiny_llama_dir, hf_model, tmp_path, tiers):
    kw = dict(TIERS[tiers])
    if "kv_disk_gb" in kw:
        kw["kv_disk_path"] = str(tmp_path / "store")
    eng = engine(tiny_llama_dir, **kw)
    prompts = conversations(eng.loaded.config.vocab_size)
    turns = two_turns(eng, prompts)
    for turn in turns:
        for i, p in enumerate(prompts):
            assert turn[f"r{i}"] == hf_greedy(hf_model, p, 6), f"{tiers}: user {i}"
    s = eng.stats()
    queried_again = s["prefix_queries"]
    assert s["prefix_hits"] == s["prefix_hits_device"] + s["prefix_hits_host"] + s["prefix_hits_disk"]
    misses = sum(s[k] for k in ("prefix_misses_never_seen", "prefix_misses_evicted", "prefix_misses_evicted_disk",
                                "prefix_misses_invalidated"))
    assert misses == queried_again - s["prefix_hits"]
    if tiers == "device":
        assert s["prefix_hits_host"] == s["prefix_hits_disk"] == 0
        assert s["prefix_misses_evicted"] > 0, "the device alone lost the first turn's pages"
    if "host" in tiers:
        assert s["prefix_hits_host"] > 0 and s["host_cache_saves"] > 0
    if "disk" in tiers:
        assert s["prefix_hits_disk"] > 0 and s["disk_writes"] > 0, s
    eng.shutdown()


def test_host_tier_is_off_by_default_on_the_cpu_explicit_sizes_are_honoured_and_zero_disables(tiny_llama_dir):
    """On a CPU device the pool is host RAM already: no host tier unless asked for (sizing.py)."""
    auto = engine(tiny_llama_dir, kv_host_cache_gb=None)
    assert auto.stats()["num_host_cache_blocks"] == 0 and not auto.scheduler_config.host_cache_evicted
    on = engine(tiny_llama_dir, kv_host_cache_gb=gib(30))
    assert on.stats()["num_host_cache_blocks"] == 30, "an explicit size is honoured, beyond the 24-page pool too"
    assert on.scheduler_config.host_cache_evicted
    off = engine(tiny_llama_dir, kv_host_cache_gb=0)
    assert off.stats()["num_host_cache_blocks"] == 0 and not off.scheduler_config.host_cache_evicted
    with pytest.raises(ValueError, match="kv_host_cache_gb is -1"):
        EngineArgs(kv_host_cache_gb=-1)
    with pytest.raises(ValueError, match="kv_disk_gb is 0"):
        EngineArgs(kv_disk_gb=0)


@pytest.mark.parametrize("cache_off", [dict(enable_prefix_caching=False), dict(kv_layout="contiguous")])
@pytest.mark.parametrize("host", [dict(kv_host_cache_gb=gib(20)), dict(host_cache_evicted=True, swap_space_gb=gib(8))])
def test_a_host_cache_without_prefix_cache_pages_to_hold_is_refused(cache_off, host):
    """The host cache holds evicted prefix-cache pages: without prefix caching (or with the contiguous
    baseline) it was accepted and sized to 0 or never used (num_host_cache_blocks 0, host_cache_saves 0)."""
    field = next(iter(host))
    with pytest.raises(ValueError, match=f"{field} is .* with (enable_prefix_caching=False|kv_layout='contiguous'): "
                       "the host cache holds evicted prefix-cache pages, so it needs enable_prefix_caching=True and "
                       "kv_layout='paged'"):
        EngineArgs(**cache_off, **host)
    EngineArgs(**cache_off, kv_host_cache_gb=0)  # off, and auto (None: 0 on the CPU, none without pages on CUDA)
    EngineArgs(**cache_off, kv_host_cache_gb=None)


def test_an_auto_host_cache_without_prefix_caching_is_none_on_any_device(tiny_llama_dir, monkeypatch):
    from pagedrs.kv_tiers import sizing

    monkeypatch.setattr(sizing, "resolved_host_cache_gb", lambda value, device_type: gib(20))  # CUDA's auto
    assert engine(tiny_llama_dir, kv_host_cache_gb=None).stats()["num_host_cache_blocks"] == 20
    off = engine(tiny_llama_dir, kv_host_cache_gb=None, enable_prefix_caching=False)
    assert off.stats()["num_host_cache_blocks"] == 0 and not off.scheduler_config.host_cache_evicted


def restart(model_dir, path, **kw) -> Engine:
    return engine(model_dir, kv_disk_path=str(path), kv_disk_gb=gib(400), **kw)


def test_a_restart_finds_the_pages_on_disk(tiny_llama_dir, hf_model, tmp_path):
    first = restart(tiny_llama_dir, tmp_path)
    prompts = conversations(first.loaded.config.vocab_size)
    run_all(first, prompts, greedy(4))
    first.shutdown()  # flushes device-cached pages to disk

    second = restart(tiny_llama_dir, tmp_path)
    assert second.stats()["num_cached_disk_blocks"] > 0
    done = run_all(second, prompts, greedy(6))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, 6)
    s = second.stats()
    eligible = sum((len(p) - 1) // BLOCK for p in prompts)
    assert s["prefix_hits_disk"] + s["prefix_hits_device"] >= 0.9 * eligible, s
    second.shutdown()


EXIT_CHILD = """
import sys
from pagedrs import Engine, EngineArgs, SamplingParams
model, path, gb = sys.argv[1], sys.argv[2], float(sys.argv[3])
eng = Engine(EngineArgs(model=model, block_size=4, num_gpu_blocks=24, swap_space_gb=0, max_model_len=256,
                        kv_host_cache_gb=0, kv_disk_path=path, kv_disk_gb=gb))
eng.add_request("r", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=2, temperature=0.0))
while eng.has_unfinished():
    eng.step()
"""  # exits without shutdown(): the finalizer flushes at interpreter exit


def test_interpreter_exit_flushes_like_shutdown(tiny_llama_dir, tmp_path):
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", EXIT_CHILD, str(tiny_llama_dir), str(tmp_path), str(gib(400))],
                   check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=300)
    eng = restart(tiny_llama_dir, tmp_path)
    assert eng.stats()["num_cached_disk_blocks"] == (37 - 1) // BLOCK
    eng.shutdown()


def fill_store(model_dir, path) -> list[list[int]]:
    eng = restart(model_dir, path)
    prompts = conversations(eng.loaded.config.vocab_size)
    run_all(eng, prompts, greedy(2))
    eng.shutdown()
    return prompts


def test_a_store_of_another_model_is_ignored_with_one_warning(tiny_llama_dir, tmp_path, tmp_path_factory, caplog):
    from conftest import make_tiny_model

    other_dir = tmp_path_factory.mktemp("tiny-llama-other-weights")
    other_hf = make_tiny_model("llama", other_dir, seed=1)  # same geometry, other weights
    prompts = fill_store(tiny_llama_dir, tmp_path)
    with caplog.at_level(logging.WARNING, logger="pagedrs.kv_tiers"):
        eng = restart(other_dir, tmp_path)
    warnings = [r for r in caplog.records if "ignoring the KV disk store" in r.getMessage()]
    assert len(warnings) == 1 and "fingerprint" in warnings[0].getMessage()
    done = run_all(eng, prompts, greedy(4))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(other_hf, p, 4)
    s = eng.stats()
    assert s["prefix_hits_disk"] == 0 and s["prefix_misses_invalidated"] > 0, s
    eng.shutdown()


def test_a_model_that_differs_in_one_embedding_row_gets_a_fresh_store(tiny_llama_dir, tmp_path, tmp_path_factory,
                                                                       caplog):
    """A fine-tune that retrains a few tokens' rows (added tokens) and nothing else: the fingerprint hashed
    a strided sample of 4096 values a tensor (here every 4th of the embedding's first 16,384), so the
    edited model kept it and was served the first model's pages, its greedy tokens wrong with no error.
    Every byte is hashed now."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    edited = tmp_path_factory.mktemp("tiny-llama-one-row")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, edited / f.name)
    weights = load_file(str(edited / "model.safetensors"))
    row = weights["model.embed_tokens.weight"].shape[0] - 5  # past the sampled span
    weights["model.embed_tokens.weight"][row] += 0.5
    save_file(weights, str(edited / "model.safetensors"), metadata={"format": "pt"})
    edited_hf = transformers.AutoModelForCausalLM.from_pretrained(str(edited), dtype=torch.float32).eval()
    writer = restart(tiny_llama_dir, tmp_path)
    prompts = [[row] + p[1:] for p in conversations(writer.loaded.config.vocab_size)]  # in the shared pages
    run_all(writer, prompts, greedy(2))
    writer.shutdown()
    with caplog.at_level(logging.WARNING, logger="pagedrs.kv_tiers"):
        eng = restart(edited, tmp_path)
    assert any("fingerprint" in r.getMessage() for r in caplog.records if "ignoring the KV disk store" in r.getMessage())
    done = run_all(eng, prompts, greedy(4))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(edited_hf, p, 4)
    assert eng.stats()["prefix_hits_disk"] == 0
    eng.shutdown()


@pytest.fixture(scope="module")
def two_gguf_models(tmp_path_factory):
    """Two random models of one geometry (seeds 0 and 1, norms all ones in both, a tied Q8_0 table) as
    GGUF files whose matrices the Rust kernels hold, and the first again with its products in Q4_0."""
    import gguf

    from conftest import make_tiny_model
    from gguf_writer import KERNEL_QTYPES, write_gguf

    root = tmp_path_factory.mktemp("gguf-fingerprints")
    tied = {**KERNEL_QTYPES, "token_embd": gguf.GGMLQuantizationType.Q8_0}
    files = {}
    for seed in (0, 1):
        hf = make_tiny_model("mistral", root / f"hf{seed}", seed=seed, tie_word_embeddings=True)
        write_gguf(hf, root / f"hf{seed}", root / f"m{seed}.gguf", qtypes=tied)
        files[seed] = root / f"m{seed}.gguf"
        if seed == 0:
            q4 = {name: gguf.GGMLQuantizationType.Q4_0 for name in KERNEL_QTYPES} | {"token_embd": tied["token_embd"]}
            write_gguf(hf, root / "hf0", root / "m0-q4_0.gguf", qtypes=q4)
            files["q4_0"] = root / "m0-q4_0.gguf"
    return files


@pytest.mark.parametrize("other", [1, "q4_0"])
def test_a_store_of_another_gguf_model_is_ignored(two_gguf_models, tmp_path, other, caplog, monkeypatch):
    """A GGUF model's matrices live in the Rust kernels (their modules' weight is None) and its tied table
    reads the head's tiles: its state_dict held the norms alone, all ones in both files, so the two models
    (or one model in two quantizations) shared a fingerprint and the second engine answered from the
    first's pages, greedy tokens differing with no warning. The fingerprint now hashes those weights."""
    from pagedrs.kv_tiers import model_fingerprint

    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "cache"))
    first, second = two_gguf_models[0], two_gguf_models[other]
    kw = dict(weight_dtype="gguf", kv_disk_path=str(tmp_path / "disk"), kv_disk_gb=gib(400))
    writer = engine(first, **kw)
    prompts = conversations(writer.loaded.config.vocab_size)
    run_all(writer, prompts, greedy(2))
    fingerprint = model_fingerprint(writer.loaded.model, writer.loaded.config)
    writer.shutdown()  # its pages go to disk
    same = engine(first, **kw)  # the same file finds its own pages: the digest does not change between loads
    run_all(same, prompts, greedy(2))
    assert same.stats()["prefix_hits_disk"] > 0
    same.shutdown()

    alone = engine(second, weight_dtype="gguf")
    want = run_all(alone, prompts, greedy(4))
    assert model_fingerprint(alone.loaded.model, alone.loaded.config) != fingerprint
    alone.shutdown()
    with caplog.at_level(logging.WARNING, logger="pagedrs.kv_tiers"):
        reader = engine(second, **kw)
    assert any("another fingerprint" in r.getMessage() for r in caplog.records)
    assert run_all(reader, prompts, greedy(4)) == want
    assert reader.stats()["prefix_hits_disk"] == 0
    reader.shutdown()


@pytest.mark.parametrize("change", ["dtype", "block_size"])
def test_a_store_of_another_dtype_or_block_size_is_ignored(tiny_llama_dir, tmp_path, change, caplog):
    fill_store(tiny_llama_dir, tmp_path)
    kw = {"dtype": "bfloat16"} if change == "dtype" else {"block_size": 8}
    with caplog.at_level(logging.WARNING, logger="pagedrs.kv_tiers"):
        eng = restart(tiny_llama_dir, tmp_path, **kw)
    assert any(change in r.getMessage() for r in caplog.records)
    assert eng.stats()["num_cached_disk_blocks"] == 0
    eng.shutdown()


def slot_bytes_of(path) -> int:
    import json
    import struct

    raw = open(path / FILE_NAME, "rb").read(HEADER_BYTES)
    (length,) = struct.unpack_from("<I", raw, 16)
    return json.loads(raw[20 : 20 + length])["slot_bytes"]


def test_a_damaged_page_is_ignored_and_the_others_still_hit(tiny_llama_dir, hf_model, tmp_path, caplog):
    prompts = fill_store(tiny_llama_dir, tmp_path / "s")
    store = tmp_path / "s"
    slot = slot_bytes_of(store)
    probe = restart(tiny_llama_dir, store)
    before = probe.stats()["num_cached_disk_blocks"]
    probe.shutdown()
    data = (store / FILE_NAME).read_bytes()
    used = next(i for i in range(len(data) // slot) if data[HEADER_BYTES + i * slot:][:4] == b"PGSL")
    at = HEADER_BYTES + used * slot + slot // 2  # inside the page of the first slot in use
    with open(store / FILE_NAME, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="pagedrs.kv_tiers"):
        eng = restart(tiny_llama_dir, store)
    assert eng.stats()["num_cached_disk_blocks"] == before - 1
    assert sum("1 damaged page" in r.getMessage() for r in caplog.records) == 1
    done = run_all(eng, prompts, greedy(5))
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == hf_greedy(hf_model, p, 5)
    assert eng.stats()["prefix_hits_disk"] > 0
    eng.shutdown()


def test_a_truncated_store_keeps_the_pages_before_the_cut(tiny_llama_dir, tmp_path):
    fill_store(tiny_llama_dir, tmp_path)
    full = restart(tiny_llama_dir, tmp_path)
    pages = full.stats()["num_cached_disk_blocks"]
    full.shutdown()
    slot = slot_bytes_of(tmp_path)
    data = (tmp_path / FILE_NAME).read_bytes()
    used = [i for i in range(len(data) // slot) if data[HEADER_BYTES + i * slot:][:4] == b"PGSL"]
    cut = used[len(used) // 2]
    os.truncate(tmp_path / FILE_NAME, HEADER_BYTES + cut * slot + slot // 3)  # in the middle of a page
    eng = restart(tiny_llama_dir, tmp_path)
    assert eng.stats()["num_cached_disk_blocks"] == sum(u < cut for u in used) < pages
    eng.shutdown()
    os.truncate(tmp_path / FILE_NAME, 100)  # not even a header: started afresh
    eng = restart(tiny_llama_dir, tmp_path)
    assert eng.stats()["num_cached_disk_blocks"] == 0
    eng.shutdown()


def test_a_second_engine_on_an_open_store_does_not_start(tiny_llama_dir, tmp_path):
    """The operator asked for the tier: a store another engine holds is a startup error, not a warning."""
    from pagedrs.kv_tiers.errors import StoreBusyError

    first = restart(tiny_llama_dir, tmp_path)
    with pytest.raises(StoreBusyError, match="open in another engine") as err:
        restart(tiny_llama_dir, tmp_path)
    assert isinstance(err.value, ValueError) and f"kv_disk_path={str(tmp_path)!r}" in str(err.value)
    assert first.stats()["num_disk_blocks"] > 0, "the engine holding the store keeps its tier"
    first.shutdown()


def test_multiturn_bench_quick_smoke(tiny_llama_dir, tmp_path):
    import json

    import pagedrs.bench as bench

    argv = ["multiturn", "--quick", "--num-requests", "8", "--model", str(tiny_llama_dir),
            "--out", str(tmp_path / "out"), "--plot", str(tmp_path / "plots")]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "out" / "multiturn.json").read_text())
    assert (tmp_path / "plots" / "multiturn.png").stat().st_size > 0
    dev, host, disk, warm = (data[n] for n in ("device", "host", "host_disk", "warm_restart"))
    assert dev["output_tokens"] == host["output_tokens"] == disk["output_tokens"] == warm["output_tokens"]
    assert dev["hit_host_pct"] == dev["hit_disk_pct"] == 0 and dev["bytes_moved"] == 0
    assert host["prefill_tokens_computed"] < dev["prefill_tokens_computed"]
    assert host["hit_host_pct"] > 0 and warm["hit_disk_pct"] > 0
    assert warm["restart_hit_pct"] >= 90.0


def _tier_fuzzer(model_dir, hf_model, store_dir):
    """Random interleavings of greedy requests over shared prefixes, aborts, steps and
    engine restarts on the same disk store, with tiny device, host and disk tiers: every
    finished output equals transformers', and the invariants hold after every operation."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

    reference: dict[tuple[int, ...], list[int]] = {}
    hits = {"prefix_hits_host": 0, "prefix_hits_disk": 0}
    families = [[7 + f] * 9 + [40 + f, 41, 42] for f in range(3)]

    class Machine(RuleBasedStateMachine):
        @initialize(blocks=st.integers(14, 22), host=st.sampled_from([0, 6, 12]), disk=st.sampled_from([6, 40]),
                    run=st.integers(0, 10**6))
        def build(self, blocks, host, disk, run):
            self.kw = dict(num_gpu_blocks=blocks, kv_host_cache_gb=gib(host), kv_disk_gb=gib(disk),
                           kv_disk_path=str(store_dir / f"run{run}"), max_num_seqs=3)
            self.engine = engine(model_dir, **self.kw)
            self.live: dict[str, list[int]] = {}
            self.next_id = 0

        @rule(family=st.integers(0, 2), extra=st.integers(0, 9))
        def add(self, family, extra):
            prompt = families[family] + [60 + (family * 13 + i * 7) % 90 for i in range(extra)]
            self.next_id += 1
            rid = f"r{self.next_id}"
            self.engine.add_request(rid, prompt, greedy(3))
            self.live[rid] = prompt

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def abort(self, data):
            rid = data.draw(st.sampled_from(sorted(self.live)))
            self.engine.abort(rid)
            del self.live[rid]

        @rule()
        def step(self):
            for out in self.engine.step():
                if out.finished and out.request_id in self.live:
                    prompt = self.live.pop(out.request_id)
                    key = tuple(prompt)
                    if key not in reference:
                        reference[key] = hf_greedy(hf_model, prompt, 3)
                    assert out.outputs[0].token_ids == reference[key], f"prompt {prompt}"

        def _close(self):
            while self.live:
                self.step()
            stats = self.engine.stats()
            for k in hits:
                hits[k] += stats[k]
            self.engine.shutdown()

        @rule()
        def restart(self):
            self._close()
            self.engine = engine(model_dir, **self.kw)

        @invariant()
        def consistent(self):
            if hasattr(self, "engine"):
                self.engine.check_invariants()

        def teardown(self):
            if hasattr(self, "engine"):
                self._close()

    return Machine, hits


def test_tier_fuzzer(tiny_llama_dir, hf_model, tmp_path):
    from hypothesis import HealthCheck, settings

    machine, hits = _tier_fuzzer(tiny_llama_dir, hf_model, tmp_path)
    examples = int(os.environ.get("PAGEDRS_FUZZ_EXAMPLES", "15"))
    run = settings(max_examples=examples, stateful_step_count=25, deadline=None, derandomize=True,
                   suppress_health_check=list(HealthCheck))(machine)
    run.TestCase().runTest()
    assert hits["prefix_hits_host"] > 0 and hits["prefix_hits_disk"] > 0, f"the fuzzer never reached a tier: {hits}"


def test_the_fingerprint_sees_one_byte_of_a_block_tables_own_blocks():
    """A table with its own blocks (an untied one) is hashed whole: one code changed changes the digest."""
    import numpy as np

    from pagedrs.kv_tiers import model_fingerprint
    from pagedrs.models.embedding import BlockEmbedding

    blocks = np.zeros((4, 34), np.uint8)  # Q8_0 rows of 32: an f16 scale of 0.5, then 32 codes
    blocks[:, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    changed = blocks.copy()
    changed[1, 5] = 3

    def digest(b: np.ndarray) -> str:
        return model_fingerprint(torch.nn.Sequential(BlockEmbedding(b, "Q8_0", 32, torch.float32)), "config")

    assert digest(blocks) == digest(blocks.copy()) != digest(changed)
