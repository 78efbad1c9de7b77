"""One sample's text as its tokens come from the core: the token rules of the output processor
(frontend/output_processor.py), applied token by token:

* a sample the core ended by a stop token (EOS or ``stop_token_ids``): that token is in
  ``token_ids`` but not in the text, and held-back bytes are flushed;
* a stop string (a text rule: only text can tell which token completes it) ends the
  sample at that token: the text is cut at the string (or after it, with
  ``include_stop_str_in_output``), later tokens are dropped, and the caller tells the core
  (``take_tokens`` returns True when the core's sequence goes on);
* ended by ``length``: the last token is text, then held-back bytes are flushed;
* aborted or failed: no flush.

A sample nobody reads before its end keeps only its tokens and is decoded once, when it
finishes (``take_deferred``); beam search's hypotheses come whole (``take_hypothesis``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from pagedrs.beam_search import BeamSearchParams
from pagedrs.core.protocol import CoreSampleOutput
from pagedrs.sampling_params import SamplingParams
from pagedrs.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SampleText:
    """One sample's output as the front end builds it."""

    index: int
    detokenizer: Optional[IncrementalDetokenizer]  # None: beam search (its text is decoded once, at the end)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # visible text (a matched stop string cut off)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[list[dict[int, float]]] = None  # per token, when params.logprobs asked
    cumulative_logprob: Optional[float] = None
    score: Optional[float] = None  # beam search: the hypothesis' length-penalized score
    sent_tokens: int = 0  # tokens already reported
    sent_chars: int = 0  # characters of text already reported
    finish_sent: bool = False  # its finish was reported (DELTA: a finished sample is not repeated)
    deferred: bool = False  # its text is decoded once, when it ends (nobody reads it before)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def take_tokens(s: SampleText, c: CoreSampleOutput, params: SamplingParams, detokenize: bool) -> bool:
    """The core's new tokens of a sample whose text grows token by token (``detokenize``: it has
    text). Returns whether a stop string ended it while the core's sequence goes on (the caller
    tells the core with a ``FinishSample``)."""
    new_ids = c.new_token_ids
    if len(new_ids) == 1 and not detokenize and c.top_logprobs is None:
        # a decode step's one token with no text to make (skip_tokenizer_init, detokenize=False):
        # what the loop below does for it (no text: no flush, no stop string), without the loop
        take_plain_token(s, new_ids[0], c.logprobs[0], False)
        if c.finish_reason is not None:
            s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
        return False
    stopped_by_text = core_goes_on = False
    last = len(new_ids) - 1
    for i, token in enumerate(new_ids):
        reason = c.finish_reason if i == last else None
        s.token_ids.append(token)
        s.cumulative_logprob = (s.cumulative_logprob or 0.0) + c.logprobs[i]  # always: best_of ranks by it
        if c.top_logprobs is not None:
            if s.logprobs is None:
                s.logprobs = []
            s.logprobs.append(c.top_logprobs[i])  # in place: a copy per token would be quadratic
        if reason == "stop":  # a stop token: not part of the text
            if detokenize:
                s.text += detok(s).flush()
            break
        if detokenize:
            previous = len(s.text)
            s.text += detok(s).step([token])
            if params.stop and len(s.token_ids) > params.min_tokens and apply_stop_strings(s, params, previous):
                stopped_by_text = True
                core_goes_on = reason is None  # the core's sequence goes on: end it there too
                break
        if reason == "length" and detokenize:
            s.text += detok(s).flush()
    if not stopped_by_text and c.finish_reason is not None:
        s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
    return core_goes_on


def take_plain_token(s: SampleText, token: int, logprob: float, detokenize: bool) -> None:
    """One token that does not end the sample, of a sample no stop string can end and without top
    logprobs: what ``take_tokens`` does with it (its id, its logprob in the running sum, its text)."""
    s.token_ids.append(token)
    s.cumulative_logprob = (s.cumulative_logprob or 0.0) + logprob
    if detokenize:
        s.text += detok(s).step([token])


def take_deferred(s: SampleText, c: CoreSampleOutput) -> None:
    """Tokens and logprobs only; the text once, when the sample ends (the per-token path's
    text: a stop token is not in it, and an ending by stop or length flushes)."""
    n = len(c.new_token_ids)
    if n:
        s.token_ids.extend(c.new_token_ids)
        total = s.cumulative_logprob or 0.0
        for logprob in c.logprobs[:n]:  # one by one: the same float sum as the per-token path
            total += logprob
        s.cumulative_logprob = total
        if c.top_logprobs is not None:
            if s.logprobs is None:
                s.logprobs = []
            s.logprobs.extend(c.top_logprobs[:n])
    if c.finish_reason is None:
        return
    if c.finish_reason in ("stop", "length") and n:
        shown = s.token_ids[:-1] if c.finish_reason == "stop" else s.token_ids
        s.text = detok(s).finish_at_once(shown)
    else:  # the per-token path flushes only with the token that ends the sample
        replay_text(s)
    s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason


def take_hypothesis(s: SampleText, c: CoreSampleOutput, params: BeamSearchParams, tokenizer: Tokenizer) -> None:
    """A beam-search output (it comes once): a hypothesis, or a live beam of an ended search."""
    s.token_ids = list(c.new_token_ids)
    s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
    s.cumulative_logprob, s.score = c.cumulative_logprob, c.score
    if c.finish_reason in ("stop", "length"):  # a stop token is in token_ids, not in the text
        shown = s.token_ids[:-1] if c.finish_reason == "stop" else s.token_ids
        s.text = tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)


def detok(s: SampleText) -> IncrementalDetokenizer:
    """The sample's detokenizer (every sample of a SamplingParams request has one)."""
    assert s.detokenizer is not None
    return s.detokenizer


def replay_text(s: SampleText) -> None:
    """A deferred sample's text as the per-token path makes it without a flush (an abort, a failure,
    an ending that came without a token): each token stepped in turn. A detokenizer that fails
    leaves the text it made up to there (the per-token path would have failed at the same token)."""
    s.text = ""
    if s.detokenizer is None:
        return
    stepper = s.detokenizer.restarted()  # a decode at the end may have failed half-way through
    for token in s.token_ids:
        try:
            s.text += stepper.step([token])
        except Exception:  # noqa: BLE001 - the request is ending anyway; its error says why
            return


def apply_stop_strings(sample: SampleText, params: SamplingParams, previous: int) -> bool:
    """Finds a stop string that ends in the newest text; cuts the text at it."""
    stops: list[str] = params.stop  # type: ignore[assignment]  # normalized to a list by SamplingParams
    longest = max(len(s) for s in stops)
    search_from = max(0, previous - longest + 1)
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        at = sample.text.find(stop, search_from)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return False
    at, stop = best
    sample.text = sample.text[: at + len(stop)] if params.include_stop_str_in_output else sample.text[:at]
    sample.finish_reason, sample.stop_reason = "stop", stop
    return True
