"""Grammars that match nothing, or stop matching mid-answer: refused, never a 200 with an answer
that matches nothing (llguidance's failed matcher allows EOS alone, which looked like a clean stop)."""

from __future__ import annotations

import pytest

from engine_runs import drain
from pagedrs import Engine, EngineArgs, SamplingParams
from pagedrs.sampling_params import StructuredOutputsParams

SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
# a well-formed start ('{"x":') whose only property's schema matches nothing
DEAD_END = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
            "additionalProperties": False, "$defs": {"a": {"$ref": "#/$defs/a"}}}


def make_engine(model_dir) -> Engine:
    return Engine(EngineArgs(model=str(model_dir), block_size=4, num_gpu_blocks=128, swap_space_gb=0.001,
                             max_model_len=256))


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(json=SELF_REF),
    StructuredOutputsParams(json={"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}),
    StructuredOutputsParams(grammar="start: a\na: a"),
])
def test_a_grammar_that_matches_nothing_is_refused_when_added(tiny_llama_dir, constraint):
    engine = make_engine(tiny_llama_dir)
    free = engine.stats()["num_free_gpu_blocks"]
    with pytest.raises(ValueError, match=rf"structured_outputs\.{constraint.kind} accepts no output"):
        engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=constraint))
    assert not engine.has_unfinished() and engine.stats()["num_free_gpu_blocks"] == free
    assert engine.core.grammars.num_compiles == 0  # the front end's check refused it
    with pytest.raises(ValueError, match=rf"structured_outputs\.{constraint.kind} accepts no output"):
        engine.core.grammars.new_state(constraint)  # and so does a core driven directly
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=4))
    assert drain(engine)["good"].outputs[0].token_ids  # the engine goes on


def test_an_answer_whose_grammar_fails_midway_ends_in_an_error_not_a_stop(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    free = engine.stats()["num_free_gpu_blocks"]
    engine.add_request("dead", [5, 6, 7], SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=DEAD_END)))
    engine.add_request("plain", [8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    done = drain(engine)
    dead = done["dead"]
    assert dead.error is not None and "no token can continue" in dead.error, dead
    assert dead.outputs[0].finish_reason == "error"
    assert len(done["plain"].outputs[0].token_ids) == 6  # the other request is untouched
    assert engine.stats()["num_free_gpu_blocks"] == free


def test_a_stream_whose_request_fails_raises_after_its_text(tiny_llama_dir):
    """``LLM.stream`` stopped quietly when the engine ended the request with an error, so a cut-short
    answer read as a whole one; now the error is raised after the text already given (a ValueError here:
    the request's own grammar dead-ends), and the engine serves on."""
    from pagedrs import LLM

    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=128, swap_space_gb=0.001, max_model_len=256)
    pieces = []
    with pytest.raises(ValueError, match=r"failed: GrammarDeadEnd: .*no token can continue"):
        for piece in llm.stream([5, 6, 7], SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(
                json=DEAD_END))):
            pieces.append(piece)
    assert "".join(pieces).startswith('{"x":')
    assert "".join(llm.stream([8, 9], SamplingParams(max_tokens=3, ignore_eos=True)))  # serves on
    stats = llm.engine.stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
