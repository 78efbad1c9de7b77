"""Structured outputs with speculative decoding: grammar rows speculate, each verify round's draw
masked by the matcher after the drafts accepted so far; greedy output equals the run without
speculation token for token and stays valid; a draft the grammar refuses is never accepted."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.core import spec_step
from pagedrs.core.structured.state import LLGuidanceState
from pagedrs.sampling_params import StructuredOutputsParams

K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "disable_by_batch_size": None}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,4}"
CONSTRAINTS = {"json": StructuredOutputsParams(json=PERSON), "regex": StructuredOutputsParams(regex=REGEX)}
MAX_NEW = 60


def make_engine(model_dir, spec, **kw) -> Engine:
    return Engine(EngineArgs(model=str(model_dir), block_size=4, num_gpu_blocks=128, max_model_len=256,
                             speculative_config=spec, **kw))


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    unit = torch.randint(3, vocab, (5,), generator=g).tolist()
    return [unit * 3, torch.randint(3, vocab, (7,), generator=g).tolist(), torch.randint(3, vocab, (12,), generator=g).tolist()]


def run(engine: Engine, prompts, kind: str) -> dict[str, tuple[list[int], str, str]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, structured_outputs=CONSTRAINTS[kind])
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                done[out.request_id] = (list(o.token_ids), o.text, o.finish_reason)
        engine.scheduler.check_invariants()
    return done


def check_valid(kind: str, text: str, reason: str) -> None:
    if reason != "stop":  # max_tokens cut an unfinished answer
        return
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    else:
        assert re.fullmatch(REGEX, text), text


def oracle(monkeypatch, prompts, references, vocab: int) -> None:
    """Proposes the plain run's next K tokens with draft number L % (K + 1) changed (the changed
    one may or may not be a token the grammar allows): every cut, every step."""

    def propose_(tokens, k, lo, hi):
        t = tokens.tolist()
        for prompt, ref in zip(prompts, references):
            if t[: len(prompt)] == prompt:
                drafts = list(ref[len(t) - len(prompt): len(t) - len(prompt) + k])
                cut = len(t) % (k + 1)
                if cut < len(drafts):
                    drafts[cut] = (drafts[cut] + 1) % vocab
                return np.asarray(drafts, dtype=np.uint32)
        return np.zeros(0, dtype=np.uint32)

    monkeypatch.setattr(spec_step, "propose", propose_)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
@pytest.mark.parametrize("proposer", ["oracle", "ngram"])
def test_greedy_structured_output_with_speculation_equals_without(tiny_llama_dir, monkeypatch, kind, proposer):
    plain = make_engine(tiny_llama_dir, None)
    vocab = plain.loaded.config.vocab_size
    prompts = prompts_for(vocab)
    want = run(plain, prompts, kind)
    if proposer == "oracle":
        oracle(monkeypatch, prompts, [want[f"r{i}"][0] for i in range(len(prompts))], vocab)
    engine = make_engine(tiny_llama_dir, SPEC)
    got = run(engine, prompts, kind)
    assert got == want
    for _, text, reason in got.values():
        check_valid(kind, text, reason)
    assert "stop" in {reason for _, _, reason in got.values()}
    stats = engine.stats()
    if proposer == "oracle":  # grammar rows did speculate (a spoiled draft the grammar refuses is cut
        assert stats["spec_accepted"] > 0, stats  # before it is verified: proposed may equal accepted)


@pytest.mark.parametrize("precut", [True, False])
def test_a_draft_the_grammar_refuses_is_rejected(tiny_llama_dir, monkeypatch, precut):
    """'q' never fits (cat|dog)-[0-9]{2,4}. With the proposal cut to what the grammar accepts,
    it is never even verified; with the cut disabled it is verified and always rejected (the
    masked draw can never equal it), and the output is the same."""
    import transformers

    q = transformers.AutoTokenizer.from_pretrained(str(tiny_llama_dir)).convert_tokens_to_ids("q")
    plain = make_engine(tiny_llama_dir, None)
    prompts = prompts_for(plain.loaded.config.vocab_size)
    want = run(plain, prompts, "regex")
    monkeypatch.setattr(spec_step, "propose", lambda tokens, k, lo, hi: np.full(k, q, dtype=np.uint32))
    if not precut:
        monkeypatch.setattr(LLGuidanceState, "validate_tokens", lambda self, token_ids: len(token_ids))
    engine = make_engine(tiny_llama_dir, SPEC)
    got = run(engine, prompts, "regex")
    assert got == want
    for _, text, reason in got.values():
        check_valid("regex", text, reason)
    stats = engine.stats()
    assert stats["spec_accepted"] == 0
    assert (stats["spec_proposed"] == 0) if precut else (stats["spec_proposed"] > 0), stats


def test_nine_grammar_rows_use_the_planned_masks_in_round_zero_and_stay_exact(tiny_llama_dir, monkeypatch):
    """At 8 or more constrained rows the masks are computed during the forward (core/step.py
    MIN_OVERLAPPED_ROWS): round 0 of a speculative step uses them, later rounds compute their own."""
    from pagedrs.core import step as step_module

    plain = make_engine(tiny_llama_dir, None)
    vocab = plain.loaded.config.vocab_size
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, vocab, (4 + i,), generator=g).tolist() for i in range(9)]
    want = run(plain, prompts, "json")
    oracle(monkeypatch, prompts, [want[f"r{i}"][0] for i in range(len(prompts))], vocab)
    planned = []
    real = step_module.start_masks
    monkeypatch.setattr(step_module, "start_masks", lambda core, step: planned.append(real(core, step)) or planned[-1])
    engine = make_engine(tiny_llama_dir, SPEC)
    assert run(engine, prompts, "json") == want
    assert any(m is not None for m in planned)
    assert engine.stats()["spec_accepted"] > 0


def test_the_xgrammar_backend_speculates_the_same(tiny_llama_dir, monkeypatch):
    """xgrammar's matcher cuts proposals (validate_tokens: accept, then roll back) and masks each round too."""
    pytest.importorskip("xgrammar")
    plain = make_engine(tiny_llama_dir, None, structured_outputs_backend="xgrammar")
    vocab = plain.loaded.config.vocab_size
    prompts = prompts_for(vocab)
    want = run(plain, prompts, "json")
    oracle(monkeypatch, prompts, [want[f"r{i}"][0] for i in range(len(prompts))], vocab)
    engine = make_engine(tiny_llama_dir, SPEC, structured_outputs_backend="xgrammar")
    got = run(engine, prompts, "json")
    assert got == want
    for _, text, reason in got.values():
        check_valid("json", text, reason)
    assert engine.stats()["spec_accepted"] > 0
