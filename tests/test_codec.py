"""The multiprocess client's wire codec (frontend/codec.py) round-trips every protocol type,
and is generated from the types: a value survives with every field, nested ones included."""

from __future__ import annotations

import dataclasses

import pytest

from pagedrs import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedrs.core import protocol as p
from pagedrs.frontend import codec
from pagedrs.stats import EngineStats


def _stats() -> EngineStats:
    values = {f.name: (1.5 if f.type in (float, "float") else "paged" if f.type in (str, "str") else 7)
              for f in dataclasses.fields(EngineStats)}
    return EngineStats(**values)


def _outputs() -> p.CoreOutputs:
    metrics = p.RequestMetrics(1.0, 2.0, first_scheduled_time=3.0, num_steps_queued=1, first_token_time=4.0,
                               num_prefill_steps=2, finished_time=None)
    samples = [
        p.CoreSampleOutput(0, [5, 6], [-0.5, -1.25], [{5: -0.5, 9: -2.0}, {6: -1.25}], None, None),
        p.CoreSampleOutput(1, [7], [-0.1], None, "stop", 7),
        p.CoreSampleOutput(2, [1, 2, 3], [], None, "length", None, cumulative_logprob=-3.5, score=-1.75),
    ]
    return p.CoreOutputs([p.CoreOutput("r", samples, True, metrics, "ValueError: x", 16,
                                       {"device": 8, "host": 4, "disk": 4}),
                          p.CoreTokenRows(["s", "t"], [3, 4], [-0.5, -1.0]),  # steady rows, between two outputs
                          p.CoreOutput("s", [], False, None)], _stats())


MESSAGES = [
    p.Add(p.CoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=3, stop=["x", "yz"], seed=3, logprobs=2, n=2,
                                                       best_of=3, stop_token_ids=[4]), -5, 12.5, "salt")),
    p.Add(p.CoreRequest("c", [1], SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY), 0, None, None)),
    p.Add(p.CoreRequest("b", [9], BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.5), 0, None, None)),
    p.Abort("a"),
    p.FinishSample("a", 1, "stop", "yz"),
    codec.Stop(),
    codec.Ready(pid=12, tokenizer_folder=None, eos_token_ids=[0, 2], vocab_size=100, max_model_len=64,
                model_name="tiny", stats=_stats()),
    codec.Added("a"),
    codec.AddRefused("a", "request 'a' already exists"),
    codec.CoreFailed("RuntimeError: gone"),
    codec.StepOutputs(_outputs(), 1.25, 2.5),
    p.ResetPrefixCache(),
    p.CacheReset(3, 2, 1),
    p.CacheReset(0, 0, 0, refused="cannot reset the prefix cache while 1 request(s) are in the engine"),
    p.PinPrefix([1, 2, 3, 4], 30.0, "salt"),
    p.PinPrefix([5], None, None),
    p.Pinned(p.PinState("pin-0", 16, 4, 30.0, 29.5)),
    p.Pinned(None, "the pin needs 3 more device pages", "cap"),
    p.Unpin("pin-0"),
    p.Unpinned("pin-0", False),
    p.ListPins(),
    p.PinList([p.PinState("pin-0", 16, 4, None, None), p.PinState("pin-1", 8, 2, 5.0, 1.25)]),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message) -> None:
    assert codec.decode(codec.encode(message)) == message


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == set(codec.MESSAGES)


def test_a_field_added_to_a_protocol_type_crosses_without_any_codec_change() -> None:
    @dataclasses.dataclass
    class Grown(p.CoreSampleOutput):
        draft_token_ids: list[int] = dataclasses.field(default_factory=list)  # e.g. speculative decoding

    value = Grown(0, [1], [-0.5], draft_token_ids=[3, 4])
    assert codec._decoder(Grown)(codec._encoder(Grown)(value)) == value


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_an_output_kind_crosses_as_its_member_not_a_plain_int(kind: RequestOutputKind) -> None:
    """marshal refuses an int subclass: the enum travels as its value and comes back as the member."""
    message = p.Add(p.CoreRequest("a", [1], SamplingParams(output_kind=kind), 0, None, None))
    raw = codec.encode(message)
    decoded = codec.decode(raw)
    assert decoded == message
    assert type(decoded.request.params.output_kind) is RequestOutputKind
    assert decoded.request.params.output_kind is kind


def test_an_optional_enum_field_crosses_too() -> None:
    @dataclasses.dataclass
    class WithKind:
        kind: RequestOutputKind | None = None

    for value in (WithKind(), WithKind(RequestOutputKind.DELTA)):
        assert codec._decoder(WithKind)(codec._encoder(WithKind)(value)) == value
