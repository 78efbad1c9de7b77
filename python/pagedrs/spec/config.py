"""``EngineArgs.speculative_config``, validated at startup (vLLM's shape).

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": m, "prompt_lookup_max": M}``
or ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}`` (a local Hugging Face
folder or GGUF file, like ``EngineArgs.model``; its vocabulary is checked against the target's
when it loads, spec/draft_runner.py). Every field is checked here, before anything is loaded, and an error names the field, its
value and what is allowed: nothing starts half-way.

``disable_by_batch_size`` (vLLM's name): no speculation while more sequences than this run.
Left out, it defaults by device: on the CPU to ``CPU_DISABLE_BY_BATCH_SIZE`` (2), the measured
crossover (SmolLM2-135M float32, 1 thread, k = 4: 1.3x at batch 1, 0.99-1.12x at batch 2,
0.87-0.94x from batch 3 up: a verify row costs about as much as a batch row once the forward
is compute-bound, and prompt lookup rarely accepts more than 1-2 drafts of 4); elsewhere to
None, vLLM's default (on a GPU the extra rows are nearly free until the batch is large; not
measured here). An explicit None means never off, on any device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")  # implemented
NOT_YET = ("eagle", "eagle3", "medusa", "mtp")  # vLLM names refused by name
MAX_SPECULATIVE_TOKENS = 16
CPU_DISABLE_BY_BATCH_SIZE = 2  # the measured crossover on the CPU (see the module docs)
_COMMON = ("method", "num_speculative_tokens", "min_acceptance_rate", "disable_by_batch_size")
_FIELDS = {"ngram": (*_COMMON, "prompt_lookup_min", "prompt_lookup_max"), "draft_model": (*_COMMON, "model")}
_ALL_FIELDS = tuple(dict.fromkeys(f for fields in _FIELDS.values() for f in fields))


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts per decode, 1..16
    prompt_lookup_min: int  # shortest suffix n-gram matched (ngram)
    prompt_lookup_max: int  # longest suffix n-gram matched, tried first
    # adaptive rule: a sequence whose acceptance EMA falls below this stops proposing for a while
    min_acceptance_rate: float = 0.2
    # vLLM's name: no speculation while more sequences than this run (None: at any batch size);
    # parse() defaults it by device (see the module docs)
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's folder or GGUF file (None for ngram)

    @classmethod
    def parse(cls, raw: Any, device: str = "cpu") -> SpeculativeConfig:
        """``raw`` checked; ``device`` (EngineArgs.device) picks ``disable_by_batch_size``'s default."""
        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config is {raw!r}; it must be a dict such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}, or None')
        unknown = sorted(set(raw) - set(_ALL_FIELDS))
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; allowed: {list(_ALL_FIELDS)}")
        method = raw.get("method")
        if method in NOT_YET:
            raise ValueError(f"speculative_config.method is {method!r}: not implemented yet in pagedrs; "
                             f"allowed: {list(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method is {method!r}; allowed: {list(METHODS)}")
        other = sorted(set(raw) - set(_FIELDS[method]))
        if other:
            raise ValueError(f"speculative_config has field(s) {other}, which method {method!r} does not take; "
                             f"allowed: {list(_FIELDS[method])}")
        model = _draft_model(raw) if method == "draft_model" else None
        k = _int(raw, "num_speculative_tokens", None)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens is {k}; it must be in 1..{MAX_SPECULATIVE_TOKENS}")
        hi = _int(raw, "prompt_lookup_max", k)
        lo = _int(raw, "prompt_lookup_min", min(hi, 1) if "prompt_lookup_max" in raw else 1)
        if lo < 1:
            raise ValueError(f"speculative_config.prompt_lookup_min is {lo}; it must be >= 1")
        if hi < lo:
            raise ValueError(f"speculative_config.prompt_lookup_max is {hi}, below prompt_lookup_min = {lo}; "
                             "it must be >= prompt_lookup_min")
        rate = raw.get("min_acceptance_rate", 0.2)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"speculative_config.min_acceptance_rate is {rate!r}; it must be a number in [0, 1] "
                             "(NaN is refused)")
        batch = raw.get("disable_by_batch_size", CPU_DISABLE_BY_BATCH_SIZE if device == "cpu" else None)
        if batch is not None:
            batch = _int(raw, "disable_by_batch_size", batch)
            if batch < 1:
                raise ValueError(f"speculative_config.disable_by_batch_size is {batch}; it must be >= 1 or None")
        return cls(str(method), k, lo, hi, float(rate), batch, model)


def _draft_model(raw: Mapping[str, Any]) -> str:
    """The draft's path, as given (whether it loads, and has the target's vocabulary, is checked
    when the executor loads it: spec/draft_runner.py)."""
    if "model" not in raw:
        raise ValueError("speculative_config.model is missing; method 'draft_model' needs the draft's local "
                         "Hugging Face folder or GGUF file (a model of the target's vocabulary)")
    model = raw["model"]
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"speculative_config.model is {model!r}; it must be a non-empty path to a local Hugging "
                         "Face folder or GGUF file")
    if "\0" in model:
        raise ValueError(f"speculative_config.model is {model!r}; a path cannot hold a NUL byte (\\x00)")
    return model


def _int(raw: Mapping[str, Any], name: str, default: int | None) -> int:
    if name not in raw:
        if default is None:
            raise ValueError(f"speculative_config.{name} is missing; it is required (an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS})")
        return default
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{name} is {value!r}; it must be an integer (not a float, NaN, string or bool)")
    return value
