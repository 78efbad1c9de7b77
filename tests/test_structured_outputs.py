"""Structured outputs in the engine: exact against transformers under the same llguidance mask,
valid when sampled, fork- and preemption-safe, compiled once per schema, refused when bad."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.core.structured.grammar import grammar_text
from pagedrs.sampling_params import MAX_SCHEMA_DEPTH, MAX_STRUCTURED_SPEC_BYTES, StructuredOutputsParams

# objects, an array with maxItems, an enum, required fields, strings with maxLength, bounded numbers
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                           "score": {"type": "number", "minimum": -1, "maximum": 1}},
            "required": ["zip", "score"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON),
    "regex": StructuredOutputsParams(regex=r"(cat|dog)-[0-9]{2,4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe", "Überraschung"]),
    "grammar": StructuredOutputsParams(grammar='start: "(" num (" + " num)* ")"\nnum: /[1-9][0-9]?/'),
}


def make_engine(model_dir, **kw) -> Engine:
    args = dict(model=str(model_dir), block_size=4, num_gpu_blocks=128, swap_space_gb=0.001, max_model_len=256)
    args.update(kw)
    return Engine(EngineArgs(**args))


def run(engine: Engine, prompts, params: SamplingParams) -> dict[str, list]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished()
    return done


def prompts_for(engine: Engine, count: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.loaded.config.vocab_size
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (3 + (5 * i) % 11,), generator=g).tolist() for i in range(count)]


# ---- the referee: transformers' generate with llguidance's mask as a logits processor ------------


class LLGuidanceMask(LogitsProcessor):
    """Masks with a matcher of its own, fed the tokens generate() appended; the bitmask comes
    from llguidance's torch helpers and is unpacked here independently of pagedrs."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, prompt_len: int) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        assert not self.matcher.is_error(), self.matcher.get_error()
        self.prompt_len = prompt_len
        self.consumed = 0
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for token in input_ids[0, self.prompt_len + self.consumed:].tolist():
            assert self.matcher.consume_token(token), self.matcher.get_error()
            self.consumed += 1
        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        bits = (self.bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[: scores.shape[1]].bool()
        return scores.masked_fill(~allowed[None, :], float("-inf"))


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ll_tokenizer(tiny_llama_dir, hf_model):
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tiny_llama_dir), local_files_only=True)
    return llguidance.hf.from_tokenizer(hf_tok, n_vocab=hf_model.config.vocab_size)


def hf_constrained(model, tokenizer, constraint: StructuredOutputsParams, prompt: list[int], max_new: int) -> list[int]:
    mask = LLGuidanceMask(tokenizer, grammar_text(constraint), len(prompt))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, num_beams=1,
                             logits_processor=LogitsProcessorList([mask]), eos_token_id=model.config.eos_token_id,
                             pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


# the answers to the json schema are long enough (30 to 60 tokens) to outgrow a small pool
MAX_NEW = 150  # fits some greedy answers to PERSON on the tiny llama, not all: both endings are checked
CASES = [(kind, setting) for kind in sorted(CONSTRAINTS) for setting in ("plain", "prefix_cached", "n3")]
CASES += [("json", "recompute_preemption"), ("json", "swap_preemption")]


@pytest.mark.parametrize("kind, setting", CASES)
def test_greedy_equals_transformers_under_the_same_mask(tiny_llama_dir, hf_model, ll_tokenizer, kind, setting):
    constraint = CONSTRAINTS[kind]
    kw: dict = {}
    if setting.endswith("preemption"):  # 48 pages of 4 tokens for 6 requests of up to 163 tokens
        kw = dict(num_gpu_blocks=48, preemption_mode=setting.split("_")[0], enable_prefix_caching=False, watermark=0.0,
                  admission_policy="prompt_only", swap_space_gb=0.01)
    engine = make_engine(tiny_llama_dir, **kw)
    prompts = prompts_for(engine, 6, seed=3, shared=8 if setting == "prefix_cached" else 0)
    if setting == "prefix_cached":
        prompts = prompts + prompts  # the second half runs on the first half's cached pages
    n = 3 if setting == "n3" else 1
    done = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, n=n, structured_outputs=constraint))
    eos = hf_model.config.eos_token_id
    reasons = set()
    for i, prompt in enumerate(prompts):
        expected = hf_constrained(hf_model, ll_tokenizer, constraint, prompt, MAX_NEW)
        for sample in done[f"r{i}"]:
            assert sample.token_ids == expected, f"r{i} sample {sample.index} ({kind}, {setting})"
            assert sample.finish_reason == ("stop" if expected[-1] == eos else "length")
            reasons.add(sample.finish_reason)
    assert "stop" in reasons
    stats = engine.stats()
    if setting == "prefix_cached":
        assert stats["prefix_hits"] > 0
    if setting == "recompute_preemption":
        assert stats["num_recompute_preemptions"] > 0, "the pool must be too small for every request at once"
    if setting == "swap_preemption":
        assert stats["num_swap_preemptions"] > 0 and stats["swap_in_blocks"] == stats["swap_out_blocks"] > 0
    assert engine.core.grammars.num_compiles == 1  # every request, every sample: one compile


# ---- validity of sampled answers --------------------------------------------------------------


def test_sampled_json_answers_all_stop_and_validate(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=64, num_gpu_blocks=2048, block_size=16)
    prompts = prompts_for(engine, 25, seed=7)
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=200, structured_outputs=CONSTRAINTS["json"])
    done = run(engine, prompts, params)
    answers = [s for outputs in done.values() for s in outputs]
    assert len(answers) == 100
    for s in answers:
        assert s.finish_reason == "stop", s.text
        jsonschema.validate(json.loads(s.text), PERSON)
    assert len({s.text for s in answers}) > 50  # sampled, and the four samples of a prompt differ


@pytest.mark.parametrize("kind", ["regex", "choice", "grammar"])
def test_sampled_regex_choice_and_grammar_answers_all_match(tiny_llama_dir, kind):
    import re

    engine = make_engine(tiny_llama_dir)
    done = run(engine, prompts_for(engine, 10, seed=5), SamplingParams(temperature=1.0, seed=1, n=5, max_tokens=80,
                                                                         structured_outputs=CONSTRAINTS[kind]))
    answers = [s for outputs in done.values() for s in outputs]
    assert len(answers) == 50
    pattern = {"regex": r"(cat|dog)-[0-9]{2,4}", "choice": "yes|no|maybe|Überraschung",
               "grammar": r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)"}[kind]
    for s in answers:
        assert s.finish_reason == "stop", s.text
        assert re.fullmatch(pattern, s.text), s.text
    assert len({s.text for s in answers}) > 1


@pytest.mark.parametrize("constraint, text", [
    (StructuredOutputsParams(choice=["<|im_start|>"]), "<|im_start|>"),
    (StructuredOutputsParams(regex=r"a<\|im_end\|>b"), "a<|im_end|>b"),
    (StructuredOutputsParams(json={"type": "string", "const": "x<|endoftext|>"}), '"x<|endoftext|>"'),
], ids=["choice", "regex", "json"])
def test_a_literal_spelling_a_special_token_is_generated_as_text(tiny_llama_dir, constraint, text):
    """llguidance tokenized the forced text "<|im_start|>" to the special token, allowed it, then refused it
    once sampled: a 500 ("the grammar refused token 1, which its mask allowed"). The text is now spelled
    in ordinary tokens (``core/structured/text_tokenizer.py``)."""
    engine = make_engine(tiny_llama_dir)
    special = engine.tokenizer.special_token_ids
    done = run(engine, prompts_for(engine, 2), SamplingParams(temperature=0.0, max_tokens=40, skip_special_tokens=False,
                                                              structured_outputs=constraint))
    for outputs in done.values():
        s = outputs[0]
        assert (s.finish_reason, s.text) == ("stop", text)
        assert special.isdisjoint(s.token_ids[:-1])  # the last: EOS


def test_max_tokens_ends_an_unfinished_answer_with_length(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    done = run(engine, prompts_for(engine, 2), SamplingParams(temperature=0.0, max_tokens=3,
                                                              structured_outputs=CONSTRAINTS["json"]))
    for outputs in done.values():
        assert outputs[0].finish_reason == "length" and outputs[0].text.startswith("{")


# ---- compiled once --------------------------------------------------------------------------------


def test_the_second_request_with_the_same_schema_compiles_nothing(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    grammars = engine.core.grammars
    for i, schema in enumerate([PERSON, json.dumps(PERSON), json.dumps(PERSON, indent=2)]):  # one schema, three texts
        engine.add_request(f"s{i}", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema)))
        assert grammars.num_compiles == 1, f"request {i} compiled again"
    engine.add_request("other", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=CONSTRAINTS["regex"]))
    assert grammars.num_compiles == 2 and len(grammars) == 2
    # the properties in another order is another schema: the answer's keys come in the schema's order
    reordered = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    engine.add_request("reordered", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=reordered)))
    assert grammars.num_compiles == 3
    run(engine, [], SamplingParams())
    assert grammars.num_compiles == 3


def test_the_cache_keeps_the_most_recent_grammars(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    grammars = engine.core.grammars
    grammars.capacity = 2
    for i, pattern in enumerate(["a+", "b+", "a+", "c+", "b+"]):
        engine.add_request(f"p{i}", [5, 6], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex=pattern)))
    # a+ b+ (a+ hit) c+ evicts b+; b+ compiles again
    assert grammars.num_compiles == 4 and len(grammars) == 2
    run(engine, [], SamplingParams())


# ---- the grammar state ----------------------------------------------------------------------------


def test_grammar_state_clone_rollback_accepting_and_stopped(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    tok = engine.tokenizer
    state = engine.core.grammars.new_state(StructuredOutputsParams(choice=["cat", "catalog"]))
    ids = tok.encode("cat", add_special_tokens=False)
    for t in ids:
        assert state.consume(t)
    assert state.is_accepting and not state.is_stopped  # "cat" is an answer, "catalog" goes on
    fork = state.clone()
    rest = tok.encode("alog", add_special_tokens=False)
    assert fork.validate_tokens(rest) == len(rest)
    for t in rest:
        assert fork.consume(t)
    assert fork.is_stopped and fork.is_accepting
    assert not state.is_stopped and state.num_consumed == len(ids)  # the original did not move
    fork.rollback(len(rest))
    assert not fork.is_stopped and fork.num_consumed == len(ids)
    with pytest.raises(ValueError, match="only"):
        fork.rollback(len(ids) + 1)
    bad = tok.encode("dog", add_special_tokens=False)[0]
    assert state.validate_tokens([bad]) == 0
    assert not state.consume(bad) and state.error


# ---- refused up front -----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of json, regex, choice, grammar, json_object=True; got none"),
    ({"json": PERSON, "regex": "a"}, "got json, regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"json": "{not json"}, "structured_outputs.json.*not JSON"),
    ({"json": "[1, 2]"}, "structured_outputs.json.*JSON object"),
    ({"json": json.dumps({"type": "object", "description": "x" * MAX_STRUCTURED_SPEC_BYTES})}, "at most 65536 bytes"),
    ({"json": {"type": "object", "description": "x" * MAX_STRUCTURED_SPEC_BYTES}}, "at most 65536 bytes"),
    ({"json": "[" * 10_000 + "]" * 10_000}, "nesting depth at most"),
    ({"json": "{\"a\":" * 10_000 + "1" + "}" * 10_000}, "nesting depth at most"),
])
def test_structured_outputs_params_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_a_deep_schema_dict_is_refused_without_recursion():
    schema: dict = {"type": "integer"}
    for _ in range(10_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match=f"nesting depth at most {MAX_SCHEMA_DEPTH}"):
        StructuredOutputsParams(json=schema)


def test_sampling_params_refuse_structured_outputs_with_min_tokens():
    SamplingParams(use_beam_search=True, n=2, temperature=0.0, structured_outputs=CONSTRAINTS["regex"])  # allowed
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=CONSTRAINTS["regex"])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


@pytest.mark.parametrize("stop", [{"stop": ['"']}, {"stop": ":"}, {"stop_token_ids": [4]}])
def test_a_stop_with_structured_outputs_is_refused(stop):
    """A stop ends an answer only before the grammar has matched it (then EOS alone is allowed): a JSON
    schema with stop '"' answered '{' with finish_reason "stop", as if complete (six of six samples)."""
    name = next(iter(stop))
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}=.*allowed empty with structured_outputs"):
        SamplingParams(**stop, structured_outputs=CONSTRAINTS["json"])
    SamplingParams(stop=[], stop_token_ids=[], structured_outputs=CONSTRAINTS["json"])  # empty: allowed


@pytest.mark.parametrize("constraint, match", [
    (StructuredOutputsParams(json={"type": "objectx"}), "(?s)structured_outputs.json does not compile: .*objectx"),
    (StructuredOutputsParams(regex="(?<=a)b"), "(?s)structured_outputs.regex does not compile: .*look-around"),
    (StructuredOutputsParams(grammar="start: foo"), "(?s)structured_outputs.grammar does not compile: .*foo"),
])
def test_the_engine_refuses_what_does_not_compile_before_the_core_sees_it(tiny_llama_dir, constraint, match):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", [5, 6, 7], SamplingParams(structured_outputs=constraint))
    assert not engine.has_unfinished() and engine.core.grammars.num_compiles == 0
    done = run(engine, [[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs=CONSTRAINTS["regex"]))
    assert done["r0"][0].token_ids  # the engine goes on


def test_abort_frees_the_grammar_state_and_pages(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, n=2, structured_outputs=CONSTRAINTS["json"]))
    engine.step()
    samples = list(engine.core.requests["a"].samples)
    assert len(samples) == 2 and all(s.grammar is not None for s in samples)
    assert samples[0].grammar is not samples[1].grammar
    engine.abort("a")
    engine.step()
    assert all(s.grammar is None for s in samples)
    assert not engine.has_unfinished()


# ---- the other tiny models and SmolLM2 --------------------------------------------------------------


def test_greedy_equals_transformers_on_every_tiny_model(tiny_model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    tokenizer = llguidance.hf.from_tokenizer(hf_tok, n_vocab=hf.config.vocab_size)
    engine = make_engine(tiny_model_dir)
    prompts = prompts_for(engine, 4, seed=9)
    for kind in ("json", "grammar"):
        done = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, structured_outputs=CONSTRAINTS[kind]))
        for i, prompt in enumerate(prompts):
            assert done[f"r{i}"][0].token_ids == hf_constrained(hf, tokenizer, CONSTRAINTS[kind], prompt, MAX_NEW), (kind, i)


def test_smollm2_greedy_json_equals_transformers(hf_smollm2):
    """A real tokenizer (49152 tokens, byte-level BPE with merges) and a model that writes sensible JSON."""
    engine = Engine(EngineArgs(model="smollm2-135m", weight_dtype="float32", block_size=16, num_gpu_blocks=64,
                               max_model_len=512))
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999}},
              "required": ["city", "country", "population"], "additionalProperties": False}
    constraint = StructuredOutputsParams(json=schema)
    questions = ["Name a large city, as JSON.", "Which city is the capital of France? Answer in JSON."]
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    done = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=60, n=2, structured_outputs=constraint))
    tokenizer = llguidance.hf.from_tokenizer(engine.tokenizer.hf, n_vocab=hf_smollm2.config.vocab_size)
    for i, prompt in enumerate(prompts):
        expected = hf_constrained(hf_smollm2, tokenizer, constraint, prompt, 60)
        for sample in done[f"r{i}"]:
            assert sample.token_ids == expected
            assert sample.finish_reason == "stop", sample.text
            jsonschema.validate(json.loads(sample.text), schema)


@pytest.mark.parametrize("error, kind", [
    ("Parser Error: Current row has 8007 items; max is 2000", "GrammarLimitError"),
    ("too many states: 500001", "GrammarLimitError"),
    ("lexer fuel exhausted", "GrammarLimitError"),
    ("unexpected token", "RuntimeError"),
])
def test_a_grammar_that_outgrows_its_parser_limits_is_the_requests_error(error, kind):
    """A schema of thousands of properties compiles, then llguidance refuses a token its own mask allowed
    because a parser limit ran out ("Current row has 8007 items; max is 2000"): the request's grammar is
    too large, a GrammarLimitError (a 400, REQUEST_CAUSED), not a RuntimeError (a 500, our bug). A refusal
    that names no limit stays a RuntimeError: that would be a bug here."""
    from types import SimpleNamespace

    from pagedrs.core.request import Sample, TokenRule, record_token
    from pagedrs.errors import REQUEST_CAUSED, GrammarLimitError

    class Refusing:
        def __init__(self) -> None:
            self.error = ""

        def consume(self, token: int) -> bool:
            self.error = error
            return False

    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    request = SimpleNamespace(params=params, token_rule=lambda eos, limit: TokenRule.of(params, 3, eos, limit))
    sample = Sample(seq_id=0, index=0, generator=None, grammar=Refusing())  # type: ignore[arg-type]
    with pytest.raises(Exception) as caught:
        record_token(sample, 7, -0.5, None, request, frozenset({1}), 256)  # type: ignore[arg-type]
    assert type(caught.value).__name__ == kind
    assert isinstance(caught.value, REQUEST_CAUSED) == (kind == "GrammarLimitError")
    if kind == "GrammarLimitError":
        assert isinstance(caught.value, GrammarLimitError) and "structured_outputs" in str(caught.value)
