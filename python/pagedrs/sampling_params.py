"""What a request asks of the sampler and of the engine's stopping rules, validated up front.

Every field is checked in ``__post_init__`` so that a bad value fails at
``add_request`` time with a message naming the field, the value and the allowed
range, before anything runs. Ranges follow vLLM and the OpenAI API.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is out of range: allowed {allowed}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt (the core's fork shares the prompt pages)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: reproducible whatever the batch holds
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None  # normalized to a list; enforced by the engine
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens exist
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k = sampled token's logprob plus top-k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            _fail("n", self.n, "an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "0 < top_p <= 1")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            _fail("top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "0 <= min_p <= 1")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "an integer or None")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "> 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                _fail(name, value, "-2 <= value <= 2")
        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            _fail("logprobs", self.logprobs, "None or an integer in [0, 20]")

    @staticmethod
    def _normalize_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in stops):
            _fail("stop", stop, "a non-empty string, a list of non-empty strings, or None")
        return stops

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
