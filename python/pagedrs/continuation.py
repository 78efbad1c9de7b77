"""Continuation policies: what a request does with the tokens drawn for its samples.

After each step the engine asks the request's policy two things:

- ``forks(request, sample)``: before drawing from a sample's logits row, which new
  samples (by index) fork from it in the core — pages shared, copy-on-write later;
- ``on_sampled(request, sample, result)``: after the draw, ``APPEND`` (the token joins
  the sequence in the core) or ``FINISH`` (the sample's sequence is freed).

The engine carries out those decisions on the core's fork / append / finish and never
branches on the kind of request. ``IndependentSamples`` is the policy of plain sampling
with ``n`` samples (forks at the first token, then each sample runs alone); beam search
is a second policy on the same primitives.
"""

from __future__ import annotations

from typing import Literal, Protocol

from pagedrs.request import Request, Sample, record_token
from pagedrs.sampling import SampleResult
from pagedrs.tokenizer import Tokenizer

Action = Literal["append", "finish"]
APPEND: Action = "append"
FINISH: Action = "finish"


class ContinuationPolicy(Protocol):
    def forks(self, request: Request, sample: Sample) -> list[int]:
        """Indices of the samples to fork from ``sample`` before this step's draw."""
        ...

    def on_sampled(self, request: Request, sample: Sample, result: SampleResult) -> Action:
        """Records the drawn token and says whether the sample goes on."""
        ...


class IndependentSamples:
    """``n`` independent samples: the prompt's logits give every sample its first token.

    The first row that samples forks ``n - 1`` children (they share every prompt page);
    afterwards each sample appends until its stop rule (EOS, stop token or string,
    max_tokens, the context length) finishes it.
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def forks(self, request: Request, sample: Sample) -> list[int]:
        if request.params.n == 1 or request.forked:
            return []
        return list(range(1, request.params.n))

    def on_sampled(self, request: Request, sample: Sample, result: SampleResult) -> Action:
        record_token(sample, result.token_id, result.logprob, result.top_logprobs, request, self.tokenizer,
                     self.max_model_len)
        return FINISH if sample.finished else APPEND
