"""Beam search: its parameters, its results, and one step of the search as transformers does it.

``BeamSearchParams`` and ``BeamSearchOutput`` have vLLM's names and fields
(``vllm.sampling_params.BeamSearchParams``, ``vllm.beam_search.BeamSearchOutput``): vLLM
moved beam search out of ``SamplingParams`` into its own class and ``LLM.beam_search``,
so code written for vLLM runs unchanged, and a beam request cannot carry sampling
settings (top_p, n, stop strings) that beam search would silently ignore. vLLM v0's
other shape, ``SamplingParams(use_beam_search=True, ...)``, is turned into one by
``BeamSearchParams.from_sampling_params`` (which is why the class also carries ``n``,
``stop_token_ids``, ``min_tokens`` and ``skip_special_tokens``), so that both run the
one search.

``beam_step`` is transformers 5's ``_beam_search`` loop body for one request, on the
same float32 tensors laid out the same way (so that ``torch.topk`` breaks ties the same
way): every live beam's log-probabilities plus its running score, the top
``(1 + #EOS ids) * k`` (at least ``2k``) candidates, the best ``k`` that do not stop
continue (stopped ones masked with -1e9), candidates among the first ``k`` that stop
join the finished hypotheses with the length penalty ``score / generated ** penalty``
(generated length counting the EOS), and the search ends by HF's three rules (no
possible improvement, every slot finished under ``early_stopping=True``, every
candidate stopped). The engine-side policy that runs it on the core's fork / append /
finish is ``pagedrs.core.continuation.BeamSearch``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import torch

from pagedrs.sampling_params import (
    EARLY_STOPPING,
    MAX_BEAM_WIDTH,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOKENS_LIMIT,
    SamplingParams,
    StructuredOutputsParams,
)

NEG = -1.0e9  # HF's mask for candidates that must not be picked


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"BeamSearchParams.{name}={value!r} is out of range: allowed {allowed}")


@dataclass
class BeamSearchParams:
    beam_width: int  # k: beams kept per step, and hypotheses returned
    max_tokens: int  # generated tokens at most (HF: max_new_tokens)
    ignore_eos: bool = False  # EOS neither stops a beam nor counts among the candidates
    temperature: float = 0.0  # > 0 divides the logits before the log-softmax; 0 = HF's beam search
    length_penalty: float = 1.0  # score = cumulative logprob / generated_length ** length_penalty
    early_stopping: Union[bool, Literal["never"]] = False  # HF's meanings of True, False and "never"
    # Beyond vLLM's BeamSearchParams, for SamplingParams(use_beam_search=True) (``from_sampling_params``):
    n: Optional[int] = None  # hypotheses returned, best first (HF's num_return_sequences); None = beam_width
    stop_token_ids: list[int] = field(default_factory=list)  # end a hypothesis as EOS does (HF: more eos_token_id)
    min_tokens: int = 0  # EOS and stop_token_ids get -inf until this many tokens (HF: min_new_tokens)
    skip_special_tokens: bool = True  # when decoding the hypotheses' text
    # a grammar every hypothesis follows (each beam has its own matcher); None: free text
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            _fail("beam_width", self.beam_width, f"an integer in [1, {MAX_BEAM_WIDTH}]")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            _fail("max_tokens", self.max_tokens, f"an integer in [1, {MAX_TOKENS_LIMIT}]")
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, "true or false")
        for name, low in (("temperature", 0.0), ("length_penalty", None)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or (low is not None and value < low) or abs(value) > 100:
                _fail(name, value, "a finite number >= 0 and <= 100" if low is not None else "a finite number in [-100, 100]")
        if self.early_stopping not in EARLY_STOPPING or not isinstance(self.early_stopping, (bool, str)):
            _fail("early_stopping", self.early_stopping, 'true, false or "never"')
        if self.n is not None and (isinstance(self.n, bool) or not isinstance(self.n, int)
                                   or not 1 <= self.n <= self.beam_width):
            _fail("n", self.n, f"None or an integer in [1, beam_width={self.beam_width}]")
        self.stop_token_ids = list(self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids
        ):
            _fail("stop_token_ids", self.stop_token_ids, f"at most {MAX_STOP_TOKEN_IDS} token ids in [0, {MAX_TOKEN_ID}]")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not (
            0 <= self.min_tokens <= self.max_tokens
        ):
            _fail("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.skip_special_tokens, bool):
            _fail("skip_special_tokens", self.skip_special_tokens, "true or false")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
        if self.structured_outputs is not None and self.ignore_eos:
            _fail("ignore_eos", self.ignore_eos, "false with structured_outputs (the grammar decides where a "
                  "hypothesis ends, and EOS ends it there: ignore_eos could not take effect)")
        if self.structured_outputs is not None and self.min_tokens:
            _fail("min_tokens", self.min_tokens, "0 with structured_outputs (the grammar decides where a hypothesis "
                  "may end; EOS is allowed exactly there)")

    @property
    def num_returned(self) -> int:
        return self.n or self.beam_width

    @classmethod
    def from_sampling_params(cls, params: SamplingParams) -> BeamSearchParams:
        """The search a ``SamplingParams(use_beam_search=True)`` asks for (validated by it already).

        Temperature is 0 here: SamplingParams allows only 0 and 1.0 with beam search,
        and both leave the log-probabilities as transformers' beam search uses them.
        """
        if not params.use_beam_search:
            raise ValueError("from_sampling_params needs SamplingParams(use_beam_search=True)")
        return cls(
            beam_width=params.beam_search_width, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
            length_penalty=params.length_penalty, early_stopping=params.early_stopping, n=params.n,
            stop_token_ids=list(params.stop_token_ids), min_tokens=params.min_tokens,
            skip_special_tokens=params.skip_special_tokens, structured_outputs=params.structured_outputs,
        )


@dataclass
class BeamSearchSequence:
    """One finished hypothesis."""

    tokens: list[int]  # prompt + generated
    token_ids: list[int]  # generated only (an EOS that ended it included)
    text: str  # the generated tokens decoded (special tokens skipped)
    cum_logprob: float  # sum of the generated tokens' log-probabilities
    score: float  # cum_logprob / len(token_ids) ** length_penalty: what ranks the hypotheses
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first; beam_width of them (none when the search failed)
    # set when the search ended with an error (NaN logits, ...): then ``sequences`` is empty, never
    # a partial search's beams passed off as its hypotheses
    error: Optional[str] = None


@dataclass
class Hypothesis:
    generated: list[int]
    score: float
    cum_logprob: float


@dataclass
class BeamState:
    """One request's search between steps (HF's per-batch-item tensors, k wide)."""

    running_scores: torch.Tensor  # float32 [k], best first; beams past the live ones hold -1e9
    finished: list[Optional[Hypothesis]]  # k slots, best first; None: an empty slot (score -1e9)
    finished_scores: torch.Tensor  # float32 [k]
    is_finished: torch.Tensor  # bool [k]
    improvement_possible: bool = True  # HF's is_early_stop_heuristic_unsatisfied (sticky)
    num_generated: int = 0  # HF's cur_len - prompt_len
    done: bool = False

    @classmethod
    def start(cls, k: int) -> BeamState:
        running = torch.zeros(k, dtype=torch.float32)
        running[1:] = NEG  # only the first beam is real at the start: no duplicate candidates
        return cls(running, [None] * k, torch.full((k,), NEG, dtype=torch.float32), torch.zeros(k, dtype=torch.bool))


@dataclass
class StepChoice:
    """What one step decided, in terms of the live beams' positions (0 = best)."""

    continuing: list[tuple[int, int]] = field(default_factory=list)  # (parent beam, token), new beams best first
    done: bool = False


def beam_step(
    state: BeamState,
    logprobs: torch.Tensor,
    generated: list[list[int]],
    params: BeamSearchParams,
    stop_token_ids: frozenset[int],
    max_generated: int,
) -> StepChoice:
    """Advances ``state`` by one token.

    ``logprobs``: float32 [live, V], the log-softmax of each live beam's logits, best
    beam first; ``generated[i]``: live beam i's generated tokens. ``stop_token_ids``: the
    tokens that end a hypothesis (HF's ``eos_token_id`` list: EOS unless ignored, plus
    the request's stop token ids). ``max_generated`` is HF's ``max_length - prompt_len``.
    """
    k = params.beam_width
    live, vocab = logprobs.shape
    if live < k:  # the first step: HF's other beams are copies of the first one, at -1e9
        logprobs = torch.cat([logprobs, logprobs[:1].expand(k - live, vocab)])
    eos = stop_token_ids
    beams_to_keep = max(2, 1 + len(eos)) * k
    accumulated = (logprobs + state.running_scores[:, None]).reshape(-1)
    topk_scores, topk_index = torch.topk(accumulated, k=beams_to_keep)
    parents = [p if p < live else 0 for p in (topk_index // vocab).tolist()]  # a copy of beam 0 is beam 0
    tokens = (topk_index % vocab).tolist()
    length = state.num_generated + 1
    stops = torch.tensor([t in eos or length >= max_generated for t in tokens], dtype=torch.bool)

    # the k best candidates that go on
    running = topk_scores + stops.to(torch.float32) * NEG
    order = torch.topk(running, k=k)[1]
    next_running = running[order]

    # candidates among the first k that stop join the finished hypotheses
    just_finished = stops & (torch.arange(beams_to_keep) < k)
    candidate_scores = topk_scores / (length**params.length_penalty)
    all_full = bool(state.is_finished.all()) and params.early_stopping is True
    candidate_scores += float(all_full) * NEG
    candidate_scores += float(not state.improvement_possible) * NEG
    candidate_scores += (~just_finished) * NEG
    merged_scores = torch.cat((state.finished_scores, candidate_scores))
    keep = torch.topk(merged_scores, k=k)[1].tolist()
    cum = topk_scores.tolist()
    merged: list[Optional[Hypothesis]] = list(state.finished)
    for j in range(beams_to_keep):
        merged.append(Hypothesis(generated[parents[j]] + [tokens[j]], 0.0, cum[j]) if bool(just_finished[j]) else None)
    state.finished_scores = merged_scores[keep]
    state.is_finished = torch.cat((state.is_finished, just_finished))[keep]
    state.finished = [merged[i] for i in keep]
    for hyp, score in zip(state.finished, state.finished_scores.tolist()):
        if hyp is not None:
            hyp.score = score

    state.running_scores = next_running
    state.num_generated = length
    best_length = max_generated if params.early_stopping == "never" and params.length_penalty > 0.0 else length
    best_possible = next_running[:1] / (best_length**params.length_penalty)
    worst_finished = torch.where(state.is_finished, torch.min(state.finished_scores), torch.tensor(NEG))
    state.improvement_possible = state.improvement_possible and bool((best_possible > worst_finished).any())
    open_beam = not (bool(state.is_finished.all()) and params.early_stopping is True)
    valid = not bool(stops.all())
    state.done = not (state.improvement_possible and open_beam and valid)
    order_list = order.tolist()
    return StepChoice([(parents[j], tokens[j]) for j in order_list], state.done)
