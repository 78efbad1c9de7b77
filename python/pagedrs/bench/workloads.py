"""Seeded synthetic workloads: ShareGPT-like long-tailed lengths, and a shared-prefix set.

Why synthetic: no dataset can be downloaded here, and a benchmark must be reproducible
from a seed. The shape follows ShareGPT as reported in the PagedAttention paper
(Kwon et al., SOSP'23, Fig. 11): mean input 161 tokens, mean output 338 tokens, both
long-tailed (a few conversations are many times the mean). We draw both lengths from
log-normal distributions with that output/input ratio, scaled down so that a 2-core CPU
finishes in minutes, and clip them to the benchmark's max_model_len:

    ============  ================  ================  ==============
    preset        prompt mean/sig   output mean/sig   max_model_len
    ============  ================  ================  ==============
    quick         32 / 0.9          64 / 0.8          512
    full          80 / 0.9          160 / 0.8         1024
    ============  ================  ================  ==============

``mean`` is the log-normal's mean before clipping, ``sig`` its sigma (shape): with
sigma 0.9 the 99th percentile is about 6x the median, the long tail that makes
reserving max_model_len per request wasteful. The realised means are reported with
every result (``Workload.summary``).

Prompt tokens are drawn uniformly from the upper seven eighths of the vocabulary (the
special tokens live at the bottom) and every request is sent with ``ignore_eos`` so that
each system generates exactly ``max_tokens`` tokens: the same work for everyone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class LengthDistribution:
    """A clipped log-normal length distribution, parameterised by its (unclipped) mean."""

    mean: float
    sigma: float
    minimum: int
    maximum: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.mean <= 0 or self.sigma < 0 or not 1 <= self.minimum <= self.maximum:
            raise ValueError(
                f"LengthDistribution needs mean > 0, sigma >= 0 and 1 <= minimum <= maximum; "
                f"got mean={self.mean}, sigma={self.sigma}, minimum={self.minimum}, "
                f"maximum={self.maximum}"
            )
        mu = math.log(self.mean) - self.sigma**2 / 2  # E[lognormal] = exp(mu + sigma^2/2)
        raw = rng.lognormal(mean=mu, sigma=self.sigma, size=n)
        return np.clip(np.rint(raw), self.minimum, self.maximum).astype(np.int64)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    num_requests: int
    prompt: LengthDistribution
    output: LengthDistribution
    max_model_len: int  # prompt + output of every request fits in it
    seed: int = 0


QUICK = WorkloadSpec(
    name="sharegpt-like-quick",
    num_requests=32,
    prompt=LengthDistribution(mean=32, sigma=0.9, minimum=4, maximum=384),
    output=LengthDistribution(mean=64, sigma=0.8, minimum=4, maximum=384),
    max_model_len=512,
)

FULL = WorkloadSpec(
    name="sharegpt-like-full",
    num_requests=64,
    prompt=LengthDistribution(mean=80, sigma=0.9, minimum=4, maximum=768),
    output=LengthDistribution(mean=160, sigma=0.8, minimum=4, maximum=768),
    max_model_len=1024,
)


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int  # generated exactly (ignore_eos)

    @property
    def total_len(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest]

    @property
    def max_total_len(self) -> int:
        return max(r.total_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def summary(self) -> dict[str, object]:
        prompts = np.array([len(r.prompt_token_ids) for r in self.requests])
        outputs = np.array([r.max_tokens for r in self.requests])
        return {
            "name": self.spec.name,
            "seed": self.spec.seed,
            "num_requests": len(self.requests),
            "max_model_len": self.spec.max_model_len,
            "prompt_len": _describe(prompts, self.spec.prompt),
            "output_len": _describe(outputs, self.spec.output),
            "num_prompt_tokens": int(prompts.sum()),
            "num_output_tokens": int(outputs.sum()),
        }


def _describe(values: np.ndarray, dist: LengthDistribution) -> dict[str, object]:
    return {
        "distribution": f"lognormal(mean={dist.mean}, sigma={dist.sigma}) clipped to "
        f"[{dist.minimum}, {dist.maximum}]",
        "mean": round(float(values.mean()), 1),
        "median": float(np.median(values)),
        "p90": float(np.percentile(values, 90)),
        "max": int(values.max()),
    }


def synthetic_workload(spec: WorkloadSpec, vocab_size: int) -> Workload:
    """Draw ``spec.num_requests`` requests; the same spec and vocab give the same requests."""
    if spec.num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {spec.num_requests}")
    if vocab_size < 16:
        raise ValueError(f"vocab_size must be >= 16, got {vocab_size}")
    rng = np.random.default_rng(spec.seed)
    prompt_lens = spec.prompt.sample(rng, spec.num_requests)
    output_lens = spec.output.sample(rng, spec.num_requests)
    low = vocab_size // 8
    requests = []
    for i, (p, o) in enumerate(zip(prompt_lens.tolist(), output_lens.tolist())):
        # Long tails must still fit: shorten the output first, keep at least one token.
        o = max(1, min(o, spec.max_model_len - p))
        p = min(p, spec.max_model_len - o)
        tokens = rng.integers(low, vocab_size, size=p).tolist()
        requests.append(BenchRequest(request_id=f"req-{i:04d}", prompt_token_ids=tokens, max_tokens=o))
    return Workload(spec=spec, requests=requests)


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> Sequence[int]: ...


# A neutral paragraph repeated to build a long system prompt of an exact token length.
_SYSTEM_TEXT = (
    "You are a careful assistant for a public library. Answer questions about opening "
    "hours, borrowing rules, membership, study rooms, printing, interlibrary loans and "
    "events. Be brief, be polite, cite the rule you rely on, and say when you do not know. "
    "Rule {n}: members may borrow up to {k} items for three weeks and renew them twice "
    "unless another member has reserved them. "
)

_QUESTIONS = [
    "When does the library open on {day}?",
    "Can I renew item number {n} online?",
    "How many books can a child member borrow at once if they are {n} years old?",
    "Is study room {n} free on {day} afternoon?",
    "What does printing {n} pages in colour cost?",
    "How long does an interlibrary loan from branch {n} take?",
    "Are there events for adults on {day} evening?",
    "I lost card {n}; what should I do?",
]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _encode(tokenizer: _Encoder, text: str) -> list[int]:
    # No BOS inside the prompt: the pieces are concatenated into one sequence.
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def shared_prefix_requests(
    tokenizer: _Encoder, num_requests: int, prefix_tokens: int, max_tokens: int, seed: int = 0
) -> tuple[list[int], list[BenchRequest]]:
    """``num_requests`` prompts = one system prompt of exactly ``prefix_tokens`` tokens + a short
    distinct question each. Returns (system prompt ids, requests)."""
    if prefix_tokens < 1 or num_requests < 1:
        raise ValueError(
            f"prefix_tokens and num_requests must be >= 1, got {prefix_tokens}, {num_requests}"
        )
    system: list[int] = []
    n = 0
    while len(system) < prefix_tokens:
        system += _encode(tokenizer, _SYSTEM_TEXT.format(n=n, k=5 + n % 7))
        n += 1
    system = system[:prefix_tokens]
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(num_requests):
        template = _QUESTIONS[i % len(_QUESTIONS)]
        question = template.format(n=int(rng.integers(1, 1000)), day=_DAYS[i % len(_DAYS)])
        ids = _encode(tokenizer, f" Question {i + 1}: {question} Answer:")  # the number keeps them distinct
        requests.append(
            BenchRequest(request_id=f"pfx-{i:04d}", prompt_token_ids=system + ids, max_tokens=max_tokens)
        )
    return system, requests
