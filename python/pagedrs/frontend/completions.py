"""The ``CompletionOutput``s of one request's output, as its kind asks: everything so far
(CUMULATIVE, FINAL_ONLY) or only what is new (DELTA). Kept apart from the output processor's
token rules: these read a sample's state and mark what went out, nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedrs.outputs import CompletionOutput

if TYPE_CHECKING:
    from pagedrs.frontend.sample_text import SampleText


def visible_chars(s: SampleText, longest_hold: int) -> int:
    """Characters of the sample's text that may go out: all once it finished, else all but what
    may still start a stop string (never fewer than already went)."""
    hold = 0 if s.finish_reason is not None else longest_hold
    return max(len(s.text) - hold, s.sent_chars)


def cumulative_completions(samples: list[SampleText], longest_hold: int) -> list[CompletionOutput]:
    """Everything so far, and what is new since the previous output (one loop per request: a
    call per sample would cost a batch of 256 a tenth of the front end's step)."""
    outs = []
    for s in samples:
        visible = max(len(s.text) - (0 if s.finish_reason is not None else longest_hold), s.sent_chars)  # visible_chars
        text = s.text
        # positional, in CompletionOutput's field order: index, text, token_ids, delta_text,
        # delta_token_ids, finish_reason, stop_reason, logprobs (the sample's own growing list, not
        # a copy: a copy per step is quadratic in the output length; a consumer that keeps it past
        # the next step copies it), cumulative_logprob, score
        outs.append(CompletionOutput(
            s.index, text if visible == len(text) else text[:visible], list(s.token_ids),
            text[s.sent_chars : visible], s.token_ids[s.sent_tokens :], s.finish_reason, s.stop_reason,
            s.logprobs, s.cumulative_logprob, s.score,
        ))
        s.sent_tokens = len(s.token_ids)
        s.sent_chars = visible
    return outs


def delta_completions(samples: list[SampleText], longest_hold: int) -> list[CompletionOutput]:
    """Only what is new (vLLM's DELTA): ``text``/``token_ids`` are the deltas (the same objects as
    ``delta_text``/``delta_token_ids``), ``logprobs`` their entries, ``cumulative_logprob`` the
    running total; a sample that gained nothing, and whose finish (if any) went out, is left out."""
    outs = []
    for s in samples:
        visible = visible_chars(s, longest_hold)
        new_ids = s.token_ids[s.sent_tokens :]
        if not new_ids and visible == s.sent_chars and (s.finish_reason is None or s.finish_sent):
            continue
        text = s.text[s.sent_chars : visible]
        outs.append(CompletionOutput(  # positional, in the field order (see cumulative_completions)
            s.index, text, new_ids, text, new_ids, s.finish_reason, s.stop_reason,
            None if s.logprobs is None else s.logprobs[s.sent_tokens :], s.cumulative_logprob, s.score,
        ))
        s.sent_tokens = len(s.token_ids)
        s.sent_chars = visible
        s.finish_sent = s.finish_reason is not None
    return outs


def one_delta_completion(s: SampleText) -> CompletionOutput | None:
    """``delta_completions`` of a request's only sample while it runs, when no stop string can hold
    text back (``RequestState.one_delta``): its new tokens and text, None when it has none; without
    the general loop and calls (tests/test_output_processor.py compares the two)."""
    ids, text, start = s.token_ids, s.text, s.sent_tokens
    if len(ids) == start and len(text) == s.sent_chars:
        return None
    new_ids = ids[start:]
    new_text = text[s.sent_chars :]
    s.sent_tokens, s.sent_chars = len(ids), len(text)
    # positional, in the field order (see cumulative_completions); it runs: no finish, no stop reason
    return CompletionOutput(s.index, new_text, new_ids, new_text, new_ids, None, None,
                            None if s.logprobs is None else s.logprobs[start:], s.cumulative_logprob, s.score)
