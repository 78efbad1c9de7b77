"""xgrammar, the optional second grammar engine: greedy output equals transformers' ``generate`` with
xgrammar's own logits processor on the same compiled grammar, sampled answers validate, the state
forks and rolls back, and a bad constraint is a ValueError naming the field. Skipped when xgrammar
is not installed (it is optional: pip install xgrammar)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

xgr = pytest.importorskip("xgrammar")
import xgrammar.contrib.hf  # noqa: E402

from pagedrs import BeamSearchParams, EngineArgs, SamplingParams  # noqa: E402
from pagedrs.sampling_params import StructuredOutputsParams  # noqa: E402
from test_structured_outputs import CONSTRAINTS, PERSON, hf_model, make_engine, prompts_for, run  # noqa: E402, F401

# xgrammar 0.2.9 lets a JSON string of the tiny byte-level tokenizer hold raw control characters and
# bytes that are not UTF-8 (so maxLength fails in characters): this schema has no free strings
NO_STRINGS = {"type": "object", "properties": {
    "role": {"enum": ["admin", "user", "guest"]}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    "score": {"type": "number", "minimum": -1, "maximum": 1}},
    "required": ["role", "age", "flags", "score"], "additionalProperties": False}
PATTERNS = {"regex": r"(cat|dog)-[0-9]{2,4}", "choice": "yes|no|maybe|Überraschung",
            "grammar": r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)"}


def referee_grammar(compiler, constraint: StructuredOutputsParams):
    """The same constraint compiled by xgrammar itself, as pagedrs gives it (compact JSON)."""
    if constraint.json is not None:
        return compiler.compile_json_schema(json.dumps(constraint.json), any_whitespace=False, separators=(",", ":"))
    if constraint.regex is not None:
        return compiler.compile_regex(constraint.regex)
    if constraint.choice is not None:
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice))
    return compiler.compile_lark(constraint.grammar)


@pytest.fixture(scope="module")
def xgr_compiler(tiny_llama_dir, hf_model):  # noqa: F811
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_llama_dir), local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf_model.config.vocab_size,
                                              stop_token_ids=[hf_model.config.eos_token_id])
    return xgr.GrammarCompiler(info)


def hf_xgrammar(model, compiler, constraint, prompt, max_new) -> list[int]:
    processor = xgrammar.contrib.hf.LogitsProcessor(referee_grammar(compiler, constraint))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, num_beams=1, logits_processor=[processor],
                             eos_token_id=model.config.eos_token_id, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_greedy_equals_transformers_with_xgrammars_processor(tiny_llama_dir, hf_model, xgr_compiler, kind):  # noqa: F811
    constraint = CONSTRAINTS[kind]
    engine = make_engine(tiny_llama_dir, structured_outputs_backend="xgrammar")
    prompts = prompts_for(engine, 4, seed=3)
    done = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=150, n=2, structured_outputs=constraint))
    eos = hf_model.config.eos_token_id
    stops = 0
    for i, prompt in enumerate(prompts):
        expected = hf_xgrammar(hf_model, xgr_compiler, constraint, prompt, 150)
        for sample in done[f"r{i}"]:
            assert sample.token_ids == expected, f"r{i} sample {sample.index} ({kind})"
            assert sample.finish_reason == ("stop" if expected[-1] == eos else "length")
            stops += sample.finish_reason == "stop"
    assert stops and engine.core.grammars.num_compiles == 1


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
def test_sampled_answers_stop_and_validate(tiny_llama_dir, kind):
    engine = make_engine(tiny_llama_dir, structured_outputs_backend="xgrammar", num_gpu_blocks=1024)
    constraint = StructuredOutputsParams(json=NO_STRINGS) if kind == "json" else CONSTRAINTS[kind]
    done = run(engine, prompts_for(engine, 5, seed=7),
               SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=200, structured_outputs=constraint))
    answers = [s for outputs in done.values() for s in outputs]
    assert len(answers) == 20
    for s in answers:
        assert s.finish_reason == "stop", s.text
        if kind == "json":
            jsonschema.validate(json.loads(s.text), NO_STRINGS)
        else:
            assert re.fullmatch(PATTERNS[kind], s.text), s.text


def test_beams_under_xgrammar_follow_the_grammar(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, structured_outputs_backend="xgrammar")
    params = BeamSearchParams(beam_width=3, max_tokens=12, structured_outputs=CONSTRAINTS["regex"])
    done = run(engine, prompts_for(engine, 2, seed=4), params)
    stopped = [s for outputs in done.values() for s in outputs if s.finish_reason == "stop"]
    assert stopped and all(re.fullmatch(PATTERNS["regex"], s.text) for s in stopped)


def test_the_state_forks_rolls_back_and_fails_like_llguidances(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, structured_outputs_backend="xgrammar")
    tok = engine.tokenizer
    state = engine.core.grammars.new_state(StructuredOutputsParams(choice=["cat", "catalog"]))
    ids = tok.encode("cat", add_special_tokens=False)
    assert state.validate_tokens(ids) == len(ids) and state.num_consumed == 0
    for t in ids:
        assert state.consume(t)
    assert state.is_accepting and not state.is_stopped
    fork = state.clone()
    rest = tok.encode("alog", add_special_tokens=False)
    for t in rest:
        assert fork.consume(t)
    assert fork.is_stopped and state.num_consumed == len(ids)
    fork.rollback(len(rest))
    assert not fork.is_stopped and fork.num_consumed == len(ids)
    bad = tok.encode("dog", add_special_tokens=False)[0]
    assert not state.consume(bad) and state.error
    from pagedrs.core.structured.mask import bias_of, grammar_bitmask

    allowed = torch.isfinite(bias_of(grammar_bitmask([state]))[0]).nonzero().flatten().tolist()
    assert allowed == sorted(engine.core.eos_token_ids)  # a failed matcher allows only EOS


def test_bad_constraints_and_backends_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="structured_outputs_backend.*allowed"):
        EngineArgs(model=str(tiny_llama_dir), structured_outputs_backend="outlines")
    engine = make_engine(tiny_llama_dir, structured_outputs_backend="xgrammar")
    with pytest.raises(ValueError, match="structured_outputs.json does not compile"):
        engine.add_request("bad", [5, 6, 7], SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objectx"})))
    assert not engine.has_unfinished()
