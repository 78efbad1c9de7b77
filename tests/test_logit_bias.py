"""``logit_bias`` (OpenAI) and ``allowed_token_ids`` (vLLM): what they do to the draw, against transformers
with the same bias added to its logits; that the reported logprobs stay the model's; that a biased row
beside plain ones, with asynchronous scheduling, with speculation and through the core process's codec
gives the same tokens; and every bad value refused by name (engine and server).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedrs import SamplingParams
from pagedrs.core import protocol as p
from pagedrs.errors import FieldError
from pagedrs.frontend import codec
from test_engine import make_engine, make_prompts

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def hf_biased_greedy(model, prompt: list[int], n: int, bias: dict[int, float] | None = None,
                     allowed: list[int] | None = None) -> tuple[list[int], list[float]]:
    """The referee: transformers' logits, the bias added (every token outside ``allowed`` at -inf),
    argmax; with each chosen token's log-probability under the model's own (raw) logits."""
    ids, logprobs = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            raw = model(torch.tensor([ids])).logits[0, -1].float()
            x = raw.clone()
            if allowed is not None:
                keep = torch.zeros_like(x, dtype=torch.bool)
                keep[allowed] = True
                x[~keep] = float("-inf")
            for t, b in (bias or {}).items():
                x[t] += b
            token = int(torch.argmax(x))
            ids.append(token)
            logprobs.append(float(torch.log_softmax(raw, -1)[token]))
    return ids[len(prompt):], logprobs


def run(engine, prompts, params_of) -> dict[str, tuple[list[int], list[float]]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params_of(i))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                assert out.error is None, out.error
                done[out.request_id] = (list(c.token_ids), [lp[t] for lp, t in zip(c.logprobs or [], c.token_ids)])
        engine.check_invariants()
    return done


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def test_greedy_with_biases_and_allowed_ids_equals_transformers_beside_plain_rows(tiny_llama_dir, hf_model):
    """Six requests in one batch: plain, a ban (-100 on the token greedy picks first), a push (+5 on a
    token it would not pick), allowed ids only, both together, and logprobs asked (the raw model's)."""
    engine = make_engine(tiny_llama_dir)
    prompts = make_prompts(engine, 6, seed=3)
    first = {i: hf_biased_greedy(hf_model, prompts[i], 1)[0][0] for i in range(6)}
    vocab = engine.loaded.config.vocab_size
    settings = [
        {},
        {"bias": {first[1]: -100.0}},
        {"bias": {(first[2] + 7) % vocab: 5.0, (first[2] + 11) % vocab: -2.5}},
        {"allowed": [3, 17, 42, 99, first[3]]},
        {"bias": {17: 3.0, first[4]: -100.0}, "allowed": [17, 42, first[4], (first[4] + 1) % vocab]},
        {"bias": {first[5]: -100.0}},
    ]

    def params_of(i: int) -> SamplingParams:
        s = settings[i]
        return _greedy(logit_bias=s.get("bias"), allowed_token_ids=s.get("allowed"), logprobs=0 if i == 5 else None)

    done = run(engine, prompts, params_of)
    for i, prompt in enumerate(prompts):
        want, want_logprobs = hf_biased_greedy(hf_model, prompt, MAX_TOKENS, settings[i].get("bias"),
                                               settings[i].get("allowed"))
        assert done[f"r{i}"][0] == want, f"request {i}: {settings[i]}"
        if "allowed" in settings[i]:
            assert set(want) <= set(settings[i]["allowed"])
        if i == 5:  # the model's log-probability of the token the bias chose, not the biased one's
            assert done["r5"][1] == pytest.approx(want_logprobs, abs=1e-4)
    assert done["r1"][0][0] != first[1] and done["r0"][0][0] == first[0]


def test_sampled_rows_draw_only_allowed_ids_and_seeds_repeat(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompts = make_prompts(engine, 3, seed=5)
    allowed = [5, 6, 7, 200, 201]

    def params_of(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=1.5, seed=40 + i, ignore_eos=True, allowed_token_ids=allowed,
                              logit_bias={200: 4.0, 5: -100.0})

    once = run(engine, prompts, params_of)
    again = run(make_engine(tiny_llama_dir), prompts, params_of)
    assert once == again, "a seed draws the same tokens"
    tokens = [t for toks, _ in once.values() for t in toks]
    assert set(tokens) <= {6, 7, 200, 201}, "only allowed ids, never the banned one"
    assert tokens.count(200) > len(tokens) // 3, "the +4 bias shows in the draws"


@pytest.mark.parametrize("mode", ["async", "ngram speculation", "core process codec"])
def test_the_same_tokens_with_async_scheduling_speculation_and_the_codec(tiny_llama_dir, mode):
    engine = make_engine(tiny_llama_dir)
    prompts = [p * 3 for p in make_prompts(engine, 4, seed=9)]  # repeats, so prompt lookup finds drafts
    vocab = engine.loaded.config.vocab_size

    def params_of(i: int) -> SamplingParams:
        bias = {prompts[i][-1]: 2.0, (prompts[i][0] + 1) % vocab: -100.0}
        if i % 2:
            return _greedy(logit_bias=bias)
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=i, ignore_eos=True, logit_bias=bias,
                              allowed_token_ids=sorted(set(prompts[i]) | {1, 2}))

    want = run(engine, prompts, params_of)
    if mode == "core process codec":  # what the front end sends the core in its own process
        for i, prompt in enumerate(prompts):
            message = p.Add(p.CoreRequest(f"r{i}", prompt, params_of(i), 0, None, None))
            assert codec.decode(codec.encode(message)) == message
        return
    kw = {"async_scheduling": True} if mode == "async" else {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                               "disable_by_batch_size": None}}
    other = make_engine(tiny_llama_dir, **kw)
    assert run(other, prompts, params_of) == want
    if mode != "async":
        assert other.stats()["spec_proposed"] > 0, "speculation ran"


@pytest.mark.parametrize(("kw", "field", "message"), [
    ({"logit_bias": {5: math.nan}}, "logit_bias", "finite numbers in [-100, 100]"),
    ({"logit_bias": {5: 100.5}}, "logit_bias", "finite numbers in [-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", "token ids (ints)"),
    ({"logit_bias": {True: 1.0}}, "logit_bias", "token ids (ints)"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "token ids (ints)"),
    ({"logit_bias": [5]}, "logit_bias", "a dict of token ids to biases"),
    ({"logit_bias": {i: 1.0 for i in range(4097)}}, "logit_bias", "at most 4096 entries"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "none would leave nothing to draw"),
    ({"allowed_token_ids": [3, 2**40]}, "allowed_token_ids", "token ids (ints)"),
    ({"allowed_token_ids": "3"}, "allowed_token_ids", "a non-empty list"),
    ({"use_beam_search": True, "logit_bias": {3: 1.0}}, "logit_bias", "beam search does not sample"),
])
def test_bad_values_are_refused_naming_the_field(kw, field, message):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=") as info:
        SamplingParams(**kw)
    assert message in str(info.value)
    assert len(str(info.value)) < 400, "a huge value is not echoed whole"


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids", "stop_token_ids"])
def test_ids_outside_the_vocabulary_are_refused_when_added_and_nothing_else_stops(tiny_llama_dir, field):
    engine = make_engine(tiny_llama_dir)
    vocab = engine.loaded.config.vocab_size
    bad = {field: {vocab: 1.0} if field == "logit_bias" else [1, vocab]}  # a stop id never drawn stops nothing
    engine.add_request("ok", [5, 6, 7], _greedy())
    with pytest.raises(FieldError, match=rf"{field} has token id {vocab}, outside the vocabulary \[0, {vocab}\)") as info:
        engine.add_request("bad", [5, 6, 7], _greedy(**bad))
    assert info.value.param == field
    done = run(engine, [], lambda i: _greedy())  # steps the engine until "ok" ends
    assert list(done) == ["ok"] and len(done["ok"][0]) == MAX_TOKENS and engine.num_unfinished() == 0


def test_a_row_with_nothing_left_to_draw_ends_alone_with_an_error_naming_the_field(tiny_llama_dir):
    """allowed_token_ids = {EOS} with min_tokens = 2: min_tokens masks EOS, so nothing is left. That
    request ends with an error naming allowed_token_ids (never token 0, which nobody allowed); the
    others run to their end and every page comes back."""
    engine = make_engine(tiny_llama_dir)
    eos = sorted(engine.core.eos_token_ids)[0]
    engine.add_request("stuck", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2,
                                                          allowed_token_ids=[eos]))
    engine.add_request("ok", [5, 6, 8], _greedy())
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert "allowed_token_ids: every allowed token is masked" in str(outs["stuck"].error)
    # the field travels beside the text, for a server's 400 ``param`` (it was null)
    assert (outs["stuck"].error_by_request, outs["stuck"].error_param) == (True, "allowed_token_ids")
    assert outs["ok"].error is None and len(outs["ok"].outputs[0].token_ids) == MAX_TOKENS
    stats = engine.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
