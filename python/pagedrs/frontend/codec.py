"""The wire codec of the multiprocess client, generated from the types of core/protocol.py.

A dataclass value is encoded as the tuple of its fields in field order, each field encoded
by its annotated type, recursively; ``marshal`` then turns the tuple into bytes (plain
values only: no code ever runs on decode). A message is ``(tag, fields)`` with the tag the
message type's index in ``MESSAGES``. So a field added to a protocol type travels without
anything else changing, and a type's decoder is built from its annotations, once. An enum
(``RequestOutputKind``) travels as its value (``marshal`` refuses an int subclass) and is
rebuilt from it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import marshal
import types
import typing
from collections.abc import Callable
from typing import Any, Optional, Union

from pagedrs.core import protocol as p

Encoder = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Ready:
    """The core process started: what the front end needs to know about it."""

    pid: int
    tokenizer_folder: typing.Optional[str]  # None: skip_tokenizer_init
    eos_token_ids: list[int]
    vocab_size: int
    max_model_len: int
    model_name: str
    stats: p.EngineStats


@dataclasses.dataclass(frozen=True)
class Added:
    request_id: str


@dataclasses.dataclass(frozen=True)
class AddRefused:
    """The core refused an add the front end had validated (an id still in use, a request the KV pool can
    never hold): a ValueError, or a ``FieldError`` naming ``param`` where the core's refusal named one (the
    server's 400 reports it; without it a pool-fit refusal was a 400 with ``param`` null in this client)."""

    request_id: str
    message: str
    param: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class CoreFailed:
    """The core could not start, or failed for good: an EngineCoreError, or EngineCoreDeadError once it ran."""

    message: str


@dataclasses.dataclass(frozen=True)
class Stop:
    pass


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    outputs: p.CoreOutputs
    step_seconds: float  # time in EngineCore.step, over the core's life
    busy_seconds: float  # wall time of the core's loop turns that had work


# Every message type, front end -> core and back; the index is the tag on the wire.
MESSAGES: tuple[type, ...] = (p.Add, p.Abort, p.FinishSample, Stop, Ready, Added, AddRefused, CoreFailed, StepOutputs,
                              p.ResetPrefixCache, p.CacheReset, p.PinPrefix, p.Pinned, p.Unpin, p.Unpinned,
                              p.ListPins, p.PinList)
_TAGS = {cls: i for i, cls in enumerate(MESSAGES)}


def encode(message: Any) -> bytes:
    kind: Any = type(message)
    return marshal.dumps((_TAGS[kind], _encoder(kind)(message)))


def decode(raw: bytes) -> Any:
    tag, fields = marshal.loads(raw)
    return _decoder(MESSAGES[tag])(fields)


def _plain(value: Any) -> Any:
    return value


@functools.cache
def _encoder(tp: Any) -> Encoder:
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        parts = [(f.name, _encoder(hints[f.name])) for f in dataclasses.fields(tp)]
        return lambda v: tuple(enc(getattr(v, name)) for name, enc in parts)
    if _is_enum(tp):
        return _enum_value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if all(not _structured(a) for a in options):
            return _plain
        if len(options) == 1:  # Optional[X] of a structured X
            enc = _encoder(options[0])
            return lambda v: None if v is None else enc(v)
        # a union of dataclasses (SamplingParams | BeamSearchParams): (which, fields)
        index = {cls: i for i, cls in enumerate(options)}
        encs = [_encoder(a) for a in options]
        return lambda v: None if v is None else (index[type(v)], encs[index[type(v)]](v))
    if origin is list and _structured(args[0]):
        enc = _encoder(args[0])
        return lambda v: [enc(x) for x in v]
    return _plain  # ints, floats, strings, bools, lists and dicts of them


@functools.cache
def _decoder(tp: Any) -> Encoder:
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = [(f.name, f.init, _decoder(hints[f.name])) for f in dataclasses.fields(tp)]
        cls: Any = tp

        def build(t: Any) -> Any:
            values = [(name, init, dec(x)) for (name, init, dec), x in zip(fields, t)]
            value = cls(**{name: v for name, init, v in values if init})
            for name, init, v in values:
                if not init:
                    object.__setattr__(value, name, v)
            return value

        return build
    if _is_enum(tp):
        return tp  # type: ignore[no-any-return]  # the member of that value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if all(not _structured(a) for a in options):
            return _plain
        if len(options) == 1:
            dec = _decoder(options[0])
            return lambda v: None if v is None else dec(v)
        decs = [_decoder(a) for a in options]
        return lambda v: None if v is None else decs[v[0]](v[1])
    if origin is list and _structured(args[0]):
        dec = _decoder(args[0])
        return lambda v: [dec(x) for x in v]
    return _plain


def _is_enum(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, enum.Enum)


def _enum_value(value: Any) -> Any:
    return value.value


def _structured(tp: Any) -> bool:
    """Whether values of ``tp`` need encoding (a dataclass or an enum somewhere inside)."""
    if dataclasses.is_dataclass(tp) or _is_enum(tp):
        return True
    return any(_structured(a) for a in typing.get_args(tp) if a is not type(None))
