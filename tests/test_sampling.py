"""Sampling: seeded reproducibility, truncation sets on a known distribution, penalty formulas, validation."""

from __future__ import annotations

import math

import pytest
import torch

from pagedrs.sampling import SamplingRow, apply_penalties, argmax_rows, sample
from pagedrs.sampling_params import SamplingParams

# token 0..4 carry 0.4, 0.3, 0.15, 0.1, 0.05 of the mass; 5..9 are impossible
KNOWN_PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0, 0, 0, 0, 0])
KNOWN_LOGITS = torch.log(KNOWN_PROBS.clamp_min(1e-12))


def _row(params: SamplingParams, out: list[int] | None = None, prompt: list[int] | None = None, **kw) -> SamplingRow:
    gen = None
    if params.seed is not None:
        gen = torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, gen, prompt or [], out or [], **kw)


def _draws(params: SamplingParams, n: int = 3000) -> set[int]:
    torch.manual_seed(0)
    rows = [_row(params) for _ in range(n)]
    return {r.token_id for r in sample(KNOWN_LOGITS.expand(n, -1).clone(), rows)}


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(temperature=1.0), {0, 1, 2, 3, 4}),
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_k=1), {0}),
        (SamplingParams(temperature=1.0, top_p=0.6), {0, 1}),  # 0.4 < 0.6 <= 0.4 + 0.3
        (SamplingParams(temperature=1.0, top_p=0.86), {0, 1, 2, 3}),  # 0.85 < 0.86
        (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),  # >= 0.2
        (SamplingParams(temperature=1.0, min_p=0.3), {0, 1, 2}),  # >= 0.12
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.5), {0, 1}),
        (SamplingParams(temperature=0.0, top_k=3), {0}),
    ],
)
def test_truncation_emits_exactly_the_allowed_set(params, allowed):
    """Over 3000 draws: never a token outside the set, and every token inside it shows up."""
    assert _draws(params) == allowed


def test_sampling_frequencies_follow_the_distribution():
    torch.manual_seed(1)
    n = 20000
    rows = [_row(SamplingParams(temperature=1.0)) for _ in range(n)]
    ids = torch.tensor([r.token_id for r in sample(KNOWN_LOGITS.expand(n, -1).clone(), rows)])
    freq = torch.bincount(ids, minlength=10).float() / n
    assert (freq - KNOWN_PROBS).abs().max().item() < 0.02


def test_seeded_rows_reproducible_whatever_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(1, 50)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(companions: int, steps: int = 6) -> list[int]:
        gen_row = _row(seeded)
        others = [_row(SamplingParams(temperature=1.0, seed=s if s % 2 else None)) for s in range(companions)]
        tokens = []
        for _ in range(steps):
            rows = others[: companions // 2] + [gen_row] + others[companions // 2 :]
            batch = torch.cat([torch.randn(companions // 2, 50), logits, torch.randn(companions - companions // 2, 50)])
            tokens.append(sample(batch, rows)[companions // 2].token_id)
        return tokens

    alone = run(0)
    assert run(3) == alone
    assert run(8) == alone
    assert len(set(alone)) > 1  # really random, not stuck on the argmax


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.1, 0.2, 4.0]])
    res = sample(logits, [_row(SamplingParams(temperature=0, logprobs=2)), _row(SamplingParams(temperature=0))])
    assert [r.token_id for r in res] == [1, 3]
    raw = torch.log_softmax(logits, -1)
    assert res[0].logprob == pytest.approx(raw[0, 1].item())
    assert res[0].top_logprobs == pytest.approx({1: raw[0, 1].item(), 2: raw[0, 2].item()})
    assert res[1].top_logprobs is None


def test_penalties_follow_vllm_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = _row(params, out=[0, 0, 1], prompt=[4])
    got = apply_penalties(logits.clone(), [row])[0].tolist()
    # token 0: seen, >0 -> 2/2 = 1, then -0.5*2 (freq) -0.25 (presence) = -0.25
    # token 1: seen, <0 -> -1*2 = -2, then -0.5*1 -0.25 = -2.75
    # token 4: in prompt only, <0 -> -2*2 = -4, no output penalty
    expected = [-0.25, -2.75, 0.5, 3.0, -4.0, 1.0]
    assert got == pytest.approx(expected)


def test_penalties_are_per_row():
    logits = torch.zeros(2, 4) + 1.0
    rows = [_row(SamplingParams(presence_penalty=1.0), out=[2]), _row(SamplingParams(), out=[2])]
    got = apply_penalties(logits.clone(), rows)
    assert got.tolist() == [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert sample(logits, [_row(params, out=[1], eos_token_ids=frozenset({2}))])[0].token_id == 4
    assert sample(logits, [_row(params, out=[1, 1], eos_token_ids=frozenset({2}))])[0].token_id == 2


def test_argmax_rows_is_torch_argmax_with_ties_nan_and_infinities():
    """The numpy fast path answers what torch.argmax answers: the first maximal index, NaN as maximal."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (64, 50), generator=gen).float()  # a handful of values: ties in every row
    x[3, [7, 20]] = float("nan")
    x[4] = float("-inf")
    x[5, [2, 40]] = float("inf")
    x[6, 10:] = float("-inf")
    x[7, 0] = float("nan")
    for case in (x, x.t().contiguous().t(), x[:, 5:], x.to(torch.bfloat16), torch.randn(3, 49152, generator=gen)):
        assert argmax_rows(case).tolist() == case.argmax(dim=-1).tolist()
    assert argmax_rows(x).dtype == torch.int64


def test_greedy_batch_equals_the_reference_path_with_logprobs_penalties_and_seeds():
    """Greedy rows take the argmax of the raw logits (or of the penalized ones) and report the
    raw log-probability, whatever the other rows of the batch ask for."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 1000, generator=gen) * 3
    before = logits.clone()
    rows = [
        _row(SamplingParams(temperature=0)),
        _row(SamplingParams(temperature=0, logprobs=3)),
        _row(SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=2.0), out=[], prompt=[]),
        _row(SamplingParams(temperature=0, frequency_penalty=2.0), out=[0, 0]),
        _row(SamplingParams(temperature=0.8, seed=7)),
    ]
    # rows 2 and 3 are penalized at the raw argmax, so the penalty must move them
    top = logits.argmax(-1)
    rows[2] = _row(rows[2].params, out=[int(top[2])])
    rows[3] = _row(rows[3].params, out=[int(top[3])] * 5)
    results = sample(logits, rows)
    assert sample(logits[3:4], rows[3:4])[0].token_id == results[3].token_id  # a view: frequency alone, in place
    assert torch.equal(logits, before)  # penalties never write into the caller's logits
    raw = torch.log_softmax(logits, -1)
    penalized = apply_penalties(logits.clone(), rows)
    expected = [int(top[0]), int(top[1]), int(penalized[2].argmax()), int(penalized[3].argmax())]
    assert [r.token_id for r in results[:4]] == expected
    assert expected[2] != top[2] and expected[3] != top[3]
    # x[t] - logsumexp(x) (sampling.chosen_logprobs): the log-softmax entry to float32 rounding
    assert [r.logprob for r in results[:4]] == pytest.approx([raw[i, t].item() for i, t in enumerate(expected)],
                                                               abs=2e-5, rel=0)
    top3 = raw[1].topk(3)
    want = dict(zip(top3.indices.tolist(), top3.values.tolist(), strict=True))
    # the alternatives are the log-softmax's; the chosen token's entry is its reported logprob
    assert results[1].top_logprobs == {**want, expected[1]: results[1].logprob}
    assert results[0].top_logprobs is None
    # the seeded row draws what it draws alone
    alone = sample(logits[4:].clone(), [_row(SamplingParams(temperature=0.8, seed=7))])
    assert results[4].token_id == alone[0].token_id


@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"n": 0}, "n", "1 <= n <= 1024"),
        ({"n": 100_000}, "n", "1 <= n <= 1024"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"temperature": float("inf")}, "temperature", "finite"),
        ({"top_p": 0.0}, "top_p", "0 < top_p <= 1"),
        ({"top_p": 1.5}, "top_p", "0 < top_p <= 1"),
        ({"top_p": float("nan")}, "top_p", "0 < top_p <= 1"),
        ({"top_k": -2}, "top_k", "0 / -1 to disable"),
        ({"top_k": 2**63}, "top_k", "[1, 2147483647]"),
        ({"min_p": 1.2}, "min_p", "0 <= min_p <= 1"),
        ({"seed": 2**64}, "seed", "18446744073709551615"),
        ({"seed": 1.5}, "seed", "None or an integer"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0 < value <= 100"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty", "<= 100"),
        ({"presence_penalty": 2.5}, "presence_penalty", "-2 <= value <= 2"),
        ({"presence_penalty": float("nan")}, "presence_penalty", "-2 <= value <= 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "-2 <= value <= 2"),
        ({"max_tokens": 0}, "max_tokens", "[1, 2147483647]"),
        ({"max_tokens": 2**70}, "max_tokens", "[1, 2147483647]"),
        ({"max_tokens": True}, "max_tokens", "[1, 2147483647]"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "[0, max_tokens=10]"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop": ["x"] * 33}, "stop", "at most 32"),
        ({"stop": "x" * 513}, "stop", "at most 512 characters"),
        ({"stop": 5}, "stop", "non-empty string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "each in [0, 2147483647]"),
        ({"stop_token_ids": [True]}, "stop_token_ids", "each in [0, 2147483647]"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids", "each in [0, 2147483647]"),
        ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
        # a lone surrogate is in no decoded text: the stop could never match (the server's JSON refuses it too)
        ({"stop": ["ok", "a\ud800"]}, "stop", "lone surrogate '\\ud800' at character 1"),
    ],
)
def test_sampling_params_validation_names_field_value_and_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert f"SamplingParams.{field}=" in msg
    assert repr(kwargs[field])[:60] in msg
    assert allowed in msg


def test_a_tiny_temperature_is_greedy_not_nan():
    """1e-40 would overflow logits / T to inf and the softmax to NaN: below 1e-5 is greedy (vLLM's rule)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    params = SamplingParams(temperature=1e-40)
    assert params.is_greedy
    assert sample(logits, [_row(params)])[0].token_id == 1


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    params = SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=3)
    assert 0 <= sample(logits, [_row(params)])[0].token_id < 4


def test_sampling_params_normalizes_stop():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams().stop == []
    assert SamplingParams(top_k=-1).top_k == -1
    assert math.isclose(SamplingParams(temperature=0).temperature, 0.0)


def test_logits_row_stats_refuses_what_it_cannot_read_naming_logits():
    import numpy as np

    from pagedrs._core import logits_row_stats

    with pytest.raises(ValueError, match="logits: must be a C-contiguous array"):
        logits_row_stats(np.zeros((3, 4), dtype=np.float32)[:, ::2])
    with pytest.raises(ValueError, match=r'"logits": has 0 values; need whole rows of 0 >= 1'):
        logits_row_stats(np.zeros((2, 0), dtype=np.float32))
    with pytest.raises(ValueError, match="threads is 0; allowed: 1 to 1024"):
        logits_row_stats(np.zeros((1, 5), dtype=np.float32), 0)
    with pytest.raises(TypeError, match="logits"):
        logits_row_stats(np.zeros((2, 3), dtype=np.float64))
    ids, lse = logits_row_stats(np.zeros((0, 5), dtype=np.float32))
    assert ids.shape == lse.shape == (0,)
    ids, lse = logits_row_stats(np.zeros((2, 5), dtype=np.float32), 2)
    assert ids.tolist() == [0, 0] and lse == pytest.approx([np.log(5.0)] * 2, rel=1e-6)
    from pagedrs._core import logits_greedy

    with pytest.raises(ValueError, match="logits: must be a C-contiguous array"):
        logits_greedy(np.zeros((3, 4), dtype=np.float32)[:, ::2])
    tokens, logprobs = logits_greedy(np.array([[0.0, 2.0, 2.0, -1.0]], dtype=np.float32))
    assert tokens == [1] and logprobs == pytest.approx([2.0 - np.log(1 + 2 * np.exp(2.0) + np.exp(-1.0))], rel=1e-6)


def test_generator_seeds_keep_every_bit_of_a_64_bit_seed_on_the_cpu():
    """torch's CPU generator keeps a seed's low 32 bits: manual_seed(2**32) draws what manual_seed(0) does,
    so a request seeded 2**32 repeated seed 0's samples. Seeds of 2**32 or more are mixed down to 32
    bits on the CPU; smaller ones, and every seed on CUDA (Philox keeps 64 bits), are used as they are."""
    from pagedrs.core.engine_core import generator_seed

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert torch.rand(4, generator=torch.Generator().manual_seed(2**32)).equal(
        torch.rand(4, generator=torch.Generator().manual_seed(0)))  # the trap itself
    assert [generator_seed(s, cpu) for s in (0, 5, 2**32 - 1)] == [0, 5, 2**32 - 1]
    assert generator_seed(2**40, cuda) == 2**40
    big = [2**32, 2**32 + 1, 2**32 + 5, 2**40, 2**62, 2**63, 2**64 - 1]
    mixed = [generator_seed(s, cpu) for s in big]
    assert all(0 <= m < 2**32 for m in mixed) and len(set(mixed)) == len(big)
    assert not {0, 1, 5} & set(mixed)  # none lands on the small seeds they used to alias
    streams = {tuple(torch.rand(8, generator=torch.Generator().manual_seed(m)).tolist()) for m in [0, 1, 5, *mixed]}
    assert len(streams) == len(big) + 3


def test_requests_seeded_2_to_the_32_apart_sample_differently(tiny_llama_dir):
    """End to end, through the engine: seed 0 and seed 2**32 (and n=2 samples of seed 2**32 - 1, whose second
    uses 2**32) used to give the same tokens; each seed still repeats itself."""
    from pagedrs import LLM

    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=128, skip_tokenizer_init=True)

    def tokens(seed: int, n: int = 1) -> list[list[int]]:
        params = SamplingParams(temperature=1.5, max_tokens=12, seed=seed, n=n, ignore_eos=True)
        return [list(c.token_ids) for c in llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs]

    zero, one = tokens(0), tokens(1)
    assert tokens(0) == zero and tokens(2**32) == tokens(2**32)
    assert tokens(2**32) != zero and tokens(2**32 + 1) != one and tokens(2**40) != zero
    assert tokens(2**32 - 1, n=2)[1] != zero
