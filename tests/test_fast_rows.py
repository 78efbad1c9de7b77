"""The core's fast rows (core/fast_rows.py) against the generic path: the same tokens,
log-probabilities, finish and stop reasons for every kind of row, in one mixed batch; a
failing batched draw falls back to the generic path; released sequences leave the table."""

from __future__ import annotations

import pytest
import torch

from pagedrs import SamplingParams
from pagedrs.core import fast_rows
from test_engine import make_engine, make_prompts


def _mixed_params(eos: int) -> list[SamplingParams]:
    """Plain rows of every ending (length, EOS, a stop token, max_model_len) beside rows the
    fast path must leave alone (logprobs, penalties, seeds, min_tokens, n > 1)."""
    return [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0),  # may stop at EOS
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[eos]),
        SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),  # ends at max_model_len
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, min_tokens=6),  # slow until 6 tokens, then fast
        SamplingParams(max_tokens=6, temperature=0.0, n=2, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True),  # sampled, but one token left
    ]


def _run(engine, prompts, params) -> dict:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
                                        for c in out.outputs]
        engine.scheduler.check_invariants()
    return done


def _eos_of(engine) -> int:
    return min(engine.loaded.tokenizer.eos_token_ids)


def test_fast_rows_equal_the_generic_path_in_a_mixed_batch(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir, max_model_len=48)
    prompts = make_prompts(engine, 10)
    params = _mixed_params(_eos_of(engine))
    calls = []
    real_draw = fast_rows.draw
    monkeypatch.setattr(fast_rows, "draw", lambda logits, fast, *rest: calls.append(len(fast.rows))
                        or real_draw(logits, fast, *rest))
    fast = _run(engine, prompts, params)
    assert calls and max(calls) >= 5, "the fast path took no rows"
    assert len(engine.core.fast_rows) == 0, "released sequences stayed in the fast rows' table"

    monkeypatch.setattr(fast_rows, "is_plain", lambda request, sample: False)
    generic = _run(make_engine(tiny_llama_dir, max_model_len=48), prompts, params)
    assert fast == generic
    reasons = {o[0][3] for o in fast.values()}
    assert "length" in reasons
    # the stop-token row really stopped on its token (the tiny model's greedy text reaches it or not: say which)
    stopped = fast["r2"][0]
    if stopped[3] == "stop":
        assert stopped[4] == _eos_of(engine) and stopped[0][-1] == _eos_of(engine)
    assert len(fast["r3"][0][0]) == 48 - len(prompts[3])  # max_model_len ended it


def test_a_failing_batched_draw_falls_back_to_the_generic_path(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    prompts = make_prompts(engine, 4)
    params = [SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)] * 4
    expected = _run(engine, prompts, params)

    def broken(logits, fast, *rest):
        raise RuntimeError("injected: the batched draw failed")

    monkeypatch.setattr(fast_rows, "draw", broken)
    assert _run(make_engine(tiny_llama_dir), prompts, params) == expected


def test_sampled_fast_rows_follow_their_settings(tiny_llama_dir):
    """top_k=1 and a tiny top_p leave one token: a sampled plain row then draws the greedy one."""
    engine = make_engine(tiny_llama_dir)
    prompts = make_prompts(engine, 3)
    greedy = _run(engine, prompts, [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3)
    narrowed = [SamplingParams(max_tokens=8, temperature=1.3, top_k=1, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=0.7, top_p=1e-6, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=1.0, min_p=0.999999, ignore_eos=True)]
    got = _run(make_engine(tiny_llama_dir), prompts, narrowed)
    for rid in greedy:
        assert got[rid][0][0] == greedy[rid][0][0]
        # the reported logprob is the raw model's, whatever the sampler's settings
        assert got[rid][0][1] == pytest.approx(greedy[rid][0][1], abs=1e-5)


def test_chosen_logprobs_are_the_token_less_the_rows_logsumexp():
    """On the CPU: ``x[t] - logsumexp(x)`` with the Rust log-sum-exp, exactly; within float32
    rounding of torch's log_softmax entry (what the CPU reported before) and of float64."""
    from pagedrs.sampling import chosen_logprobs, cpu_logits_stats

    x = torch.randn(6, 300) * 4
    t = torch.tensor([0, 5, 299, 17, 17, 100])
    chosen, full = chosen_logprobs(x, t)
    stats = cpu_logits_stats(x)
    assert full is None and stats is not None
    assert (stats[0] == x.argmax(-1).numpy()).all()
    assert torch.equal(chosen, x.gather(1, t[:, None])[:, 0] - torch.from_numpy(stats[1]))
    assert torch.allclose(chosen, torch.log_softmax(x, -1).gather(1, t[:, None])[:, 0], atol=2e-5, rtol=0)
    want = torch.log_softmax(x.double(), -1).gather(1, t[:, None])[:, 0]
    assert (chosen.double() - want).abs().max() <= 2e-5
    # rows that are not float32 on the CPU take torch's logsumexp
    chosen64, _ = chosen_logprobs(x.double(), t)
    assert chosen64.dtype == torch.float64 and (chosen64 - want).abs().max() <= 1e-12


@pytest.mark.parametrize("case", ["random", "ties", "-inf", "nan", "one row", "whole vocab equal"])
def test_greedy_rows_on_the_cpu_equal_the_torch_draw_bit_for_bit(case):
    """The NumPy path of all-greedy CPU rows: the tokens of ``sampling.draw`` and the float32
    log-probabilities of ``sampling.chosen_logprobs``, exactly (first maximal index, NaN maximal)."""
    from pagedrs.sampling import chosen_logprobs, draw

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1 if case == "one row" else 9, 257, generator=gen) * 5
    if case == "ties":
        x[:, 3] = x[:, 100] = x.max() + 1  # first maximal index wins
    elif case == "-inf":
        x[:, ::2] = float("-inf")
    elif case == "nan":
        x[2, 40] = float("nan")
    elif case == "whole vocab equal":
        x[:] = 0.25
    tokens, logprobs = fast_rows._greedy_on_cpu(x)
    n = x.shape[0]
    want = draw(x, [True] * n, [1.0] * n, [0.0] * n, [0] * n, [1.0] * n)
    chosen, _ = chosen_logprobs(x, want)
    assert tokens == want.tolist()
    assert torch.equal(torch.tensor(logprobs, dtype=torch.float32), chosen) or case == "nan"
    if case == "nan":  # NaN compares unequal to itself: equal elsewhere, NaN where torch has NaN
        got = torch.tensor(logprobs, dtype=torch.float32)
        assert torch.equal(got.isnan(), chosen.isnan()) and torch.equal(got[~got.isnan()], chosen[~chosen.isnan()])


def test_a_steady_batch_reuses_its_split_until_a_sequence_ends(tiny_llama_dir):
    """The split of an all-fast batch is remembered: the same sequences get the same FastStep back;
    a released sequence (forget) or a row that is not fast (min_tokens) makes it be split again."""
    engine = make_engine(tiny_llama_dir)
    prompts = make_prompts(engine, 3)
    for i, p in enumerate(prompts):
        min_tokens = 5 if i == 2 else 0
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, min_tokens=min_tokens))
    engine.step()  # the prefill: every sequence has its first token
    table = engine.core.fast_rows
    seq_ids = sorted(engine.core.sequences)
    fast, slow = table.split(seq_ids, [True] * 3)
    assert len(fast.rows) == 2 and slow == [2], "min_tokens keeps the third row slow"
    again, _ = table.split(seq_ids, [True] * 3)
    assert again is not fast, "a split with a slow row is not remembered"
    first, slow = table.split(seq_ids[:2], [True, True])
    assert slow == [] and table.split(seq_ids[:2], [True, True])[0] is first
    assert table.split(seq_ids[:2], [True, False])[0] is not first, "other rows to sample: split again"
    table.split(seq_ids[:2], [True, True])
    table.forget(seq_ids[1])
    after, _ = table.split(seq_ids[:1], [True])
    assert [r.sample.seq_id for r in after.rows] == seq_ids[:1]
    while engine.has_unfinished():
        engine.step()
