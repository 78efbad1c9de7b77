"""Speculative decoding (prompt lookup): greedy output with speculation equals greedy output
without it and transformers' in every mode; rejected drafts leave no trace (the leak fixture,
the prefix cache); bad configurations are refused at startup naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedrs import LLM, Engine, EngineArgs, SamplingParams
from pagedrs.core import spec_step
from pagedrs.spec.config import CPU_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from pagedrs.spec.ngram import propose

# never off by batch size: these tests speculate at batch 4, above the CPU's default (2)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt_ids):]


def make_engine(model_dir, spec=NGRAM, **kw) -> Engine:
    args = dict(model=str(model_dir), block_size=4, num_gpu_blocks=96, swap_space_gb=0.001, max_model_len=256,
                speculative_config=spec)
    args.update(kw)
    return Engine(EngineArgs(**args))


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Two repetitive prompts (lookups find them) and two random ones."""
    g = torch.Generator().manual_seed(seed)
    unit = torch.randint(3, vocab, (5,), generator=g).tolist()
    return [unit * 4, (unit[:3] + [7]) * 3 + unit[:2],
            torch.randint(3, vocab, (11,), generator=g).tolist(), torch.randint(3, vocab, (19,), generator=g).tolist()]


def run_all(engine: Engine, batch, params) -> dict[str, list[list[int]]]:
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[list[int]]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        engine.scheduler.check_invariants()
    return done


def greedy(max_tokens: int = 20, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# ---- the proposer and the config ----------------------------------------------------------


def test_ngram_proposes_what_followed_the_newest_longest_match():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3])
    assert propose(t, 3, 1, 3).tolist() == [4, 5, 6]  # the newest earlier "1 2 3"
    assert propose(t, 8, 1, 3).tolist() == [4, 5, 6, 1, 2, 3]  # runs to the end of the sequence
    assert propose(np.array([5, 6, 7, 5, 8, 6, 7]), 2, 1, 2).tolist() == [5, 8]  # "6 7" beats "7"
    assert propose(np.array([5, 6, 7, 5, 8, 6, 7]), 2, 3, 3).tolist() == []  # no 3-gram repeats
    assert propose(np.array([4]), 2, 1, 3).tolist() == []
    assert propose(np.array([4, 4]), 2, 1, 3).tolist() == [4]
    assert propose(t, 3, 1, 3).dtype == np.uint32


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens is 0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens is 17"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens is 2.0"),
    ({"method": "ngram", "num_speculative_tokens": float("nan")}, "num_speculative_tokens is nan"),
    ({"method": "ngram"}, "num_speculative_tokens is missing"),
    ({"method": "medusa2", "num_speculative_tokens": 2}, "method is 'medusa2'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is missing"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max is 2, below prompt_lookup_min = 3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": float("nan")}, "min_acceptance_rate is nan"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, "unknown field(s) ['draft']"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_configs_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match="speculative_config") as info:
        EngineArgs(model=None, speculative_config=config)
    assert message in str(info.value)


@pytest.mark.parametrize(("field", "value"), [("async_scheduling", True)])
def test_unsupported_combinations_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"speculative_config with {field}={value!r}: not supported yet"):
        EngineArgs(model=None, speculative_config=NGRAM, **{field: value})


def test_config_defaults_follow_vllm():
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 5})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (1, 5)


def test_disable_by_batch_size_defaults_by_device_and_none_means_never_off():
    plain = {"method": "ngram", "num_speculative_tokens": 4}
    assert SpeculativeConfig.parse(plain).disable_by_batch_size == CPU_DISABLE_BY_BATCH_SIZE == 2
    assert SpeculativeConfig.parse(plain, "cuda").disable_by_batch_size is None  # vLLM's default
    assert SpeculativeConfig.parse({**plain, "disable_by_batch_size": None}).disable_by_batch_size is None
    assert SpeculativeConfig.parse({**plain, "disable_by_batch_size": 5}, "cuda").disable_by_batch_size == 5
    with pytest.raises(ValueError, match="speculative_config.disable_by_batch_size is 0"):
        SpeculativeConfig.parse({**plain, "disable_by_batch_size": 0})


def test_the_default_cpu_off_switch_stops_drafts_above_batch_two(tiny_llama_dir):
    """The repetitive prompts find lookups, so at batch 1 the default config proposes; at batch 4
    (above the CPU default, 2) it proposes nothing and the tokens are those of a plain engine."""
    default = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    plain = make_engine(tiny_llama_dir, spec=None)
    batch = prompts(plain.loaded.config.vocab_size)
    want = run_all(plain, batch, greedy())
    engine = make_engine(tiny_llama_dir, spec=default)
    assert run_all(engine, batch, greedy()) == want
    assert engine.stats()["spec_proposed"] == 0
    one = make_engine(tiny_llama_dir, spec=default)
    assert run_all(one, batch[:1], greedy()) == {"r0": want["r0"]}
    assert one.stats()["spec_proposed"] > 0


# ---- exactness ------------------------------------------------------------------------------


def oracle(monkeypatch, model, batch: list[list[int]], vocab: int, max_tokens: int = 20) -> None:
    """A proposer that knows transformers' greedy continuation and spoils it on purpose: at a
    sequence of length L it proposes the next k reference tokens with draft number L % (k + 1)
    changed (none when that is k: all accepted, plus the bonus). So every step exercises a
    different cut: rejection at the first draft, partial acceptance, full acceptance."""
    references = [(p, hf_greedy(model, p, max_tokens)) for p in batch]

    def propose_(tokens, k, lo, hi):
        t = tokens.tolist()
        for prompt, ref in references:
            if t[: len(prompt)] == prompt:
                drafts = list(ref[len(t) - len(prompt): len(t) - len(prompt) + k])
                cut = len(t) % (k + 1)
                if cut < len(drafts):
                    drafts[cut] = (drafts[cut] + 1) % vocab
                return np.asarray(drafts, dtype=np.uint32)
        return np.zeros(0, dtype=np.uint32)

    monkeypatch.setattr(spec_step, "propose", propose_)


@pytest.mark.parametrize("mode", ["ngram", "plain", "no_prefix_caching", "chunked", "swap", "recompute"])
def test_greedy_with_speculation_equals_without_and_transformers(tiny_llama_dir, hf_model, mode, monkeypatch):
    kw = {
        "ngram": {},  # the real proposer: few of its lookups hit on a random tiny model
        "plain": {},
        "no_prefix_caching": {"enable_prefix_caching": False},
        "chunked": {"max_num_batched_tokens": 8},
        # 12 pages of 4 tokens for 4 requests of up to 40 tokens: preemption all along
        "swap": {"num_gpu_blocks": 12, "preemption_mode": "swap", "swap_space_gb": 0.01, "watermark": 0.0,
                 "enable_prefix_caching": False, "admission_policy": "prompt_only"},
        "recompute": {"num_gpu_blocks": 12, "preemption_mode": "recompute", "watermark": 0.0,
                      "admission_policy": "prompt_only"},
    }[mode]
    spec = make_engine(tiny_llama_dir, **kw)
    plain = make_engine(tiny_llama_dir, spec=None, **kw)
    vocab = spec.loaded.config.vocab_size
    batch = prompts(vocab)
    if mode != "ngram":
        oracle(monkeypatch, hf_model, batch, vocab)
    with_spec, without = run_all(spec, batch, greedy()), run_all(plain, batch, greedy())
    assert with_spec == without
    for i, p in enumerate(batch):
        assert with_spec[f"r{i}"][0] == hf_greedy(hf_model, p, 20), f"r{i} ({mode})"
    stats = spec.stats()
    assert stats["spec_proposed"] > 0 and 0 < stats["spec_accepted"] <= stats["spec_proposed"], stats
    if mode in ("swap", "recompute"):
        assert stats["num_preemptions"] > 0


def test_n_greater_than_one_and_batch_one(tiny_llama_dir, hf_model, monkeypatch):
    engine, plain = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir, spec=None)
    batch = prompts(engine.loaded.config.vocab_size)[:1]
    oracle(monkeypatch, hf_model, batch, engine.loaded.config.vocab_size)
    expected = hf_greedy(hf_model, batch[0], 20)
    assert run_all(engine, batch, greedy(n=3))["r0"] == [expected] * 3
    assert engine.stats()["spec_accepted"] > 0
    one = make_engine(tiny_llama_dir)
    assert run_all(one, batch, greedy())["r0"] == run_all(plain, batch, greedy())["r0"] == [expected]
    assert one.stats()["num_steps"] < plain.stats()["num_steps"]  # several tokens per step where drafts hit


def test_max_tokens_and_stop_tokens_cut_inside_an_accepted_run(tiny_llama_dir, hf_model, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    batch = prompts(engine.loaded.config.vocab_size)[:2]
    oracle(monkeypatch, hf_model, batch, engine.loaded.config.vocab_size)
    full = [hf_greedy(hf_model, p, 20) for p in batch]
    for max_tokens in (1, 2, 3, 7, 13):
        done = run_all(engine, batch, greedy(max_tokens=max_tokens))
        assert [done[f"r{i}"][0] for i in range(2)] == [f[:max_tokens] for f in full], max_tokens
    stop = full[0][9]  # a token deep in the run the lookups accept
    done = run_all(engine, batch[:1], greedy(stop_token_ids=[stop]))
    cut = full[0][: full[0].index(stop) + 1]
    assert done["r0"][0] == cut


def test_stop_strings_cut_the_same_text(tiny_llama_dir):
    """The front end's text rule sees several tokens in one step and cuts where it would without."""
    text = {}
    for spec in (NGRAM, None):
        llm = LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=96, swap_space_gb=0.001, max_model_len=256,
                  speculative_config=spec)
        full = llm.generate(["abc abc abc abc"], greedy(max_tokens=24), use_tqdm=False)[0].outputs[0].text
        stop = full[len(full) // 2: len(full) // 2 + 2]
        out = llm.generate(["abc abc abc abc"], greedy(max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0]
        text[spec is None] = (full, stop, out.text, out.token_ids)
    assert text[True] == text[False]
    assert len(text[True][2]) < len(text[True][0])


def test_seeded_sampling_draws_the_same_tokens(tiny_llama_dir, hf_model, monkeypatch):
    """Drawing from P_j and accepting iff the draw is the draft is Leviathan's rule for a one-hot
    proposal; with a seed it spends the generator exactly as decoding without speculation does."""
    outs = {}
    for spec in (NGRAM, None):
        engine = make_engine(tiny_llama_dir, spec=spec)
        batch = prompts(engine.loaded.config.vocab_size)
        oracle(monkeypatch, hf_model, batch, engine.loaded.config.vocab_size)  # greedy guesses: some accepted
        outs[spec is None] = run_all(engine, batch, SamplingParams(max_tokens=20, temperature=0.8, seed=3,
                                                                   ignore_eos=True))
        if spec is not None:
            assert engine.stats()["spec_accepted"] > 0
    assert outs[True] == outs[False]


# ---- no trace of rejected tokens -------------------------------------------------------------


def test_the_prefix_cache_never_returns_a_rejected_drafts_page(tiny_llama_dir, hf_model, monkeypatch):
    """A rejected proposal fills a whole page with K/V of tokens the sequence never had; a later
    prompt made of exactly those tokens must not hit that page (only the verified ones before it)."""
    engine = make_engine(tiny_llama_dir)
    vocab = engine.loaded.config.vocab_size
    prompt = torch.randint(3, vocab, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    out = hf_greedy(hf_model, prompt, 6)
    wrong = [(out[1] + 1) % vocab or 3, 5, 6, 7]  # d1 differs from the greedy token: all four rejected
    verified = prompt + out[:1]  # 8 tokens = 2 full pages; the drafts fill page 3 (positions 8..11)

    def rigged(tokens, k, lo, hi):
        return np.asarray(wrong, dtype=np.uint32) if tokens.tolist() == verified else np.zeros(0, dtype=np.uint32)

    monkeypatch.setattr(spec_step, "propose", rigged)
    done = run_all(engine, [prompt], greedy(max_tokens=6))
    assert done["r0"][0] == out
    stats = engine.stats()
    assert (stats["spec_proposed"], stats["spec_accepted"]) == (4, 0)
    engine.add_request("probe", verified + wrong + [9], greedy(max_tokens=1))
    cached = None
    while engine.has_unfinished():
        for o in engine.step():
            cached = o.num_cached_tokens if o.num_cached_tokens is not None else cached
    assert cached == 8, cached  # the two verified pages; the drafts' page was never published


def test_pool_too_tight_for_drafts_decodes_without_them(tiny_llama_dir, hf_model, monkeypatch):
    """Drafts never cost a preemption: with every page spoken for the decodes run alone."""
    engine = make_engine(tiny_llama_dir, num_gpu_blocks=10, preemption_mode="recompute", watermark=0.0,
                         enable_prefix_caching=False)
    batch = prompts(engine.loaded.config.vocab_size)[:2]
    oracle(monkeypatch, hf_model, batch, engine.loaded.config.vocab_size, max_tokens=18)
    done = run_all(engine, batch, greedy(max_tokens=18))
    for i, p in enumerate(batch):
        assert done[f"r{i}"][0] == hf_greedy(hf_model, p, 18)


def test_adaptive_rule_turns_lookup_off_for_a_sequence_that_never_accepts(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    monkeypatch.setattr(spec_step, "propose", lambda tokens, k, lo, hi: np.asarray([3, 3, 3, 3], dtype=np.uint32))
    batch = prompts(engine.loaded.config.vocab_size)[2:3]
    run_all(engine, batch, greedy(max_tokens=40))
    stats = engine.stats()
    # EMA 1.0 -> 0.7 -> 0.49 -> 0.34 -> 0.24 -> 0.17 < 0.2: off after 5 verifications, for 16 steps
    assert stats["spec_verifications"] < 20, stats["spec_verifications"]


# chi-square critical values at p = 0.001 by degrees of freedom (a false failure once in 1000 seeds)
_CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def _chi2_homogeneity(a: list[int], b: list[int]) -> tuple[float, int]:
    """Pearson's chi-square of two samples over the categories both fill (expected count >= 5 each;
    the rest pooled), and its degrees of freedom."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    total = len(a) + len(b)
    common = [t for t, _ in (ca + cb).most_common(9) if (ca[t] + cb[t]) * min(len(a), len(b)) / total >= 5]
    cells = [(ca[t], cb[t]) for t in common]
    rest = (len(a) - sum(x for x, _ in cells), len(b) - sum(y for _, y in cells))
    if min(rest) > 0:
        cells.append(rest)
    stat = 0.0
    for x, y in cells:
        for observed, size in ((x, len(a)), (y, len(b))):
            expected = (x + y) * size / total
            stat += (observed - expected) ** 2 / expected
    return stat, len(cells) - 1


def test_sampling_distribution_with_speculation_matches_without(tiny_llama_dir, hf_model, monkeypatch):
    """Unseeded, temperature 0.7: the tokens drawn at the first verified draft (output 2) and the one
    after (output 3) follow the same distribution with and without speculation (chi-square
    homogeneity, p = 0.001 bound; 600 samples each, fixed torch seeds)."""
    prompt = prompts(300)[2]
    argmax: dict[tuple[int, ...], int] = {}

    def propose_argmax(tokens, k, lo, hi):  # the likeliest next token of the sequence as it is
        key = tuple(tokens.tolist())
        if key not in argmax:
            with torch.inference_mode():
                argmax[key] = int(hf_model(torch.tensor([list(key)])).logits[0, -1].argmax())
        return np.asarray([argmax[key]], dtype=np.uint32)

    monkeypatch.setattr(spec_step, "propose", propose_argmax)
    samples = {}
    for spec in (NGRAM, None):
        engine = make_engine(tiny_llama_dir, spec=spec, max_num_seqs=256, num_gpu_blocks=2048)
        torch.manual_seed(1 if spec else 2)
        done = run_all(engine, [prompt] * 600, SamplingParams(max_tokens=3, temperature=0.7, ignore_eos=True))
        samples[spec is None] = [v[0] for v in done.values()]
        if spec is not None:
            assert engine.stats()["spec_accepted"] > 50  # many draws went through an accepted draft
    for position in (1, 2):
        stat, df = _chi2_homogeneity([s[position] for s in samples[False]], [s[position] for s in samples[True]])
        assert df >= 2, df
        assert stat < _CHI2_CRIT_001[df], (position, stat, df)


def test_the_speculative_config_flag_parses_json_and_refuses_the_rest():
    import argparse

    from pagedrs.cli_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p, cpu_threads_help="")
    kwargs = engine_kwargs(p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert engine_kwargs(p.parse_args([]))["speculative_config"] is None
    for bad in ("{nope", "[1, 2]"):
        with pytest.raises(SystemExit):
            p.parse_args(["--speculative-config", bad])
