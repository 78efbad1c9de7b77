"""Beam search under a grammar: exactly transformers' ``generate(num_beams=k)`` with the same
llguidance mask as a logits processor (which transformers applies to the log-softmax), each
beam with its own matcher, under preemption too, and nothing leaks."""

from __future__ import annotations

import re

import llguidance
import llguidance.torch
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pagedrs import BeamSearchParams, SamplingParams
from pagedrs.core.structured.grammar import grammar_text
from pagedrs.sampling_params import StructuredOutputsParams
from test_beam_search import hf_beam_search, make_llm
from test_engine_hardening import run_to_end
from test_structured_outputs import CONSTRAINTS, hf_model, ll_tokenizer  # noqa: F401 - fixtures

torch.set_num_threads(1)

PROMPTS = [[5, 9, 40, 41, 42], [100, 101, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3]]
# an enum, a bounded integer, an array with maxItems of bounded strings: the tiny llama's beams
# complete it in about 50 tokens (its 300 tokens are mostly single bytes)
SMALL = {"type": "object", "properties": {"role": {"enum": ["admin", "user", "guest"]},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                   "maxItems": 2}},
         "required": ["role", "age", "tags"], "additionalProperties": False}
BEAM_CONSTRAINTS = {**CONSTRAINTS, "json": StructuredOutputsParams(json=SMALL)}


class BeamGrammarMask(LogitsProcessor):
    """The referee's mask for every beam row: the matcher of a row is found by its generated
    tokens (a prefix seen before is a clone of its parent's matcher fed one more token), so it
    follows transformers' reordering of the beams without knowing about it. A token the
    grammar refuses (only a beam already at -inf carries one) leaves its matcher in llguidance's
    error state, whose mask allows only EOS: the engine relies on the same."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, prompt_len: int) -> None:
        root = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        assert not root.is_error(), root.get_error()
        self.by_prefix: dict[tuple[int, ...], llguidance.LLMatcher] = {(): root}
        self.prompt_len = prompt_len
        self.vocab_size = tokenizer.vocab_size

    def matcher(self, generated: tuple[int, ...]) -> llguidance.LLMatcher:
        start = len(generated)
        while generated[:start] not in self.by_prefix:
            start -= 1
        for end in range(start + 1, len(generated) + 1):
            child = self.by_prefix[generated[: end - 1]].deep_copy()
            child.consume_token(generated[end - 1])
            self.by_prefix[generated[:end]] = child
        return self.by_prefix[generated]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        bitmask = llguidance.torch.allocate_token_bitmask(input_ids.shape[0], self.vocab_size)
        for i, row in enumerate(input_ids[:, self.prompt_len:].tolist()):
            llguidance.torch.fill_next_token_bitmask(self.matcher(tuple(row)), bitmask, i)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(input_ids.shape[0], -1)[:, : scores.shape[1]].bool()
        return scores.masked_fill(~allowed, float("-inf"))


def hf_constrained_beams(model, tokenizer, constraint, prompt, params: BeamSearchParams, eos):
    mask = BeamGrammarMask(tokenizer, grammar_text(constraint), len(prompt))
    with torch.inference_mode():
        return hf_beam_search(model, prompt, params, eos, logits_processor=LogitsProcessorList([mask]))


def assert_equal_to_hf(outputs, model, tokenizer, constraint, params, eos, prompts=PROMPTS) -> None:
    """``outputs[i]``: prompt i's hypotheses, best first (``.token_ids``, ``.score``)."""
    for prompt, hypotheses in zip(prompts, outputs):
        sequences, scores = hf_constrained_beams(model, tokenizer, constraint, prompt, params, eos)
        assert [prompt + h.token_ids for h in hypotheses] == sequences
        assert [h.score for h in hypotheses] == pytest.approx(scores, abs=1e-4, rel=1e-4)


CASES = [("json", 2, 64), ("json", 4, 64), ("regex", 4, 12), ("choice", 4, 12), ("grammar", 3, 16)]


@pytest.mark.parametrize("kind, k, max_tokens", CASES)
def test_beams_under_a_grammar_equal_transformers_with_the_same_mask(tiny_llama_dir, hf_model, ll_tokenizer,  # noqa: F811
                                                                     kind, k, max_tokens):
    constraint = BEAM_CONSTRAINTS[kind]
    llm = make_llm(tiny_llama_dir)
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, structured_outputs=constraint)
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    eos = llm.engine.tokenizer.eos_token_ids
    assert_equal_to_hf([r.sequences for r in results], hf_model, ll_tokenizer, constraint, params, eos)
    stopped = [s for r in results for s in r.sequences if s.finish_reason == "stop"]
    assert stopped, "some hypotheses must complete their grammar"
    pattern = {"regex": r"(cat|dog)-[0-9]{2,4}", "choice": "yes|no|maybe|Überraschung",
               "grammar": r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", "json": r"\{.*\}"}[kind]
    for s in stopped:
        assert s.token_ids[-1] in eos and re.fullmatch(pattern, s.text), s.text
    assert llm.engine.core.grammars.num_compiles == 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beams_under_a_grammar_and_preemption_equal_transformers(tiny_llama_dir, hf_model, ll_tokenizer, mode):  # noqa: F811
    """Beams preempted apart keep their own matchers (and a fork of a waiting or swapped parent
    clones the parent's); the results are still transformers'."""
    constraint = BEAM_CONSTRAINTS["json"]
    llm = make_llm(tiny_llama_dir, num_gpu_blocks=76, preemption_mode=mode, swap_space_gb=0.01,
                   max_num_batched_tokens=64, admission_policy="prompt_only", watermark=0.0)
    engine = llm.engine
    params = BeamSearchParams(beam_width=4, max_tokens=64, structured_outputs=constraint)
    prompts = PROMPTS + [list(range(20, 32)), list(range(50, 56)), [7, 7, 7, 8]]
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    done = run_to_end(engine)  # checks the invariants after every step
    assert engine.stats()["num_preemptions"] > 0, "the pool must be too small for every beam at once"
    assert not any(out.error for out in done.values())
    assert_equal_to_hf([done[f"b{i}"].outputs for i in range(len(prompts))], hf_model, ll_tokenizer, constraint,
                       params, engine.tokenizer.eos_token_ids, prompts)


def test_every_live_beam_owns_its_matcher_and_release_drops_it(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    engine = llm.engine
    params = BeamSearchParams(beam_width=4, max_tokens=30, structured_outputs=BEAM_CONSTRAINTS["json"])
    engine.add_request("b", {"prompt_token_ids": PROMPTS[0]}, params)
    seen = []
    for _ in range(6):
        engine.step()
        beams = list(engine.core.requests["b"].samples)
        matchers = [b.grammar for b in beams]
        assert all(m is not None for m in matchers) and len({id(m) for m in matchers}) == len(beams)
        for b in beams:  # each matcher has consumed exactly its beam's tokens
            assert b.grammar.num_consumed == len(b.token_ids)
        seen += beams
    assert len(beams) == 4
    engine.abort("b")
    engine.step()
    assert all(b.grammar is None for b in seen)


def test_use_beam_search_takes_structured_outputs_and_refuses_min_tokens(tiny_llama_dir, hf_model, ll_tokenizer):  # noqa: F811
    """vLLM v0's shape runs the same constrained search; the texts are the hypotheses' answers."""
    llm = make_llm(tiny_llama_dir)
    constraint = CONSTRAINTS["regex"]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=12, temperature=0.0,
                                       structured_outputs=constraint))
    params = BeamSearchParams(beam_width=3, n=2, max_tokens=12, structured_outputs=constraint)
    eos = llm.engine.tokenizer.eos_token_ids
    assert_equal_to_hf([o.outputs for o in outs], hf_model, ll_tokenizer, constraint, params, eos)
    assert all(re.fullmatch(r"(cat|dog)-[0-9]{2,4}", c.text) for o in outs for c in o.outputs if c.finish_reason == "stop")
    with pytest.raises(ValueError, match="min_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=8, min_tokens=2, structured_outputs=constraint)
    with pytest.raises(ValueError, match="structured_outputs"):
        BeamSearchParams(beam_width=2, max_tokens=8, structured_outputs={"regex": "a"})  # type: ignore[arg-type]


def test_a_grammar_complete_beam_ends_with_stop(tiny_llama_dir):
    """The grammar forces EOS where it is complete: that ends the hypothesis with "stop" before
    max_tokens, as it ends a sampled answer."""
    llm = make_llm(tiny_llama_dir)
    params = BeamSearchParams(beam_width=2, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    results = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for r in results:
        assert {s.text for s in r.sequences} <= {"yes", "no"} and all(s.finish_reason == "stop" for s in r.sequences)


@pytest.mark.parametrize("make", [
    lambda so: BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True, structured_outputs=so),
    lambda so: SamplingParams(max_tokens=8, ignore_eos=True, structured_outputs=so),
])
def test_ignore_eos_beside_a_grammar_is_refused_by_name(make):
    """It could not take effect (the grammar ends the answer with EOS where it is complete), and a field
    accepted but ignored is a wrong answer with a 200: refused, as min_tokens is."""
    with pytest.raises(ValueError, match=r"\.ignore_eos=True is out of range: allowed false with structured_outputs"):
        make(StructuredOutputsParams(choice=["yes", "no"]))
