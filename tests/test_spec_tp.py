"""Speculative decoding with tensor parallelism (gloo, two spawned CPU ranks): rank 0 proposes and
verifies; the verify rows reach the other rank as an ordinary multi-row step. Greedy output with
speculation on two ranks equals one rank without it, and no page is left behind."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("psutil")

from engine_runs import greedy_tokens  # noqa: E402
from pagedrs import Engine, EngineArgs, SamplingParams  # noqa: E402
from pagedrs.core import spec_step  # noqa: E402

BASE = dict(block_size=4, num_gpu_blocks=64, max_model_len=128, swap_space_gb=0.001, cpu_threads=1)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": None}


def test_tp2_with_speculation_equals_one_rank_without(tiny_llama_dir, monkeypatch):
    unit = [11, 42, 97, 5, 203]
    prompts = [unit * 3, [20 + (7 * j) % 250 for j in range(9)], unit[:3] * 4 + [8]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = greedy_tokens(Engine(EngineArgs(model=str(tiny_llama_dir), **BASE)), prompts, params)

    def propose_(tokens, k, lo, hi):  # the reference's next k tokens, draft L % (k + 1) spoiled
        t = tokens.tolist()
        for prompt, ref in zip(prompts, expected):
            if t[: len(prompt)] == prompt:
                drafts = list(ref[len(t) - len(prompt): len(t) - len(prompt) + k])
                cut = len(t) % (k + 1)
                if cut < len(drafts):
                    drafts[cut] = (drafts[cut] + 1) % 256
                return np.asarray(drafts, dtype=np.uint32)
        return np.zeros(0, dtype=np.uint32)

    monkeypatch.setattr(spec_step, "propose", propose_)  # rank 0 proposes: the workers never do
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, speculative_config=SPEC, **BASE))
    try:
        assert greedy_tokens(engine, prompts, params) == expected
        stats = engine.stats()
        assert stats["spec_accepted"] > 0 and stats["spec_proposed"] > stats["spec_accepted"], stats
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    finally:
        engine.shutdown()
