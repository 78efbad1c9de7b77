"""Text made in the API process from the token ids the engine core streams.

The core runs a request with ``detokenize=False`` when nothing in the core needs its text
(no stop strings, no beam search or best_of, whose final texts the core's policies build),
and this module turns the token-id deltas back into the same text the core would have
made: the same ``IncrementalDetokenizer``, fed one token at a time, with the core's
rules for where an output ends (``request.record_token``):

* finished by ``stop`` with a stop token id or EOS (``stop_reason`` not a string): the
  last token is not part of the text, and held-back bytes are flushed;
* finished by ``length``: the last token is text, then held-back bytes are flushed;
* aborted or failed: no flush (the core does not flush either).

Requests with stop strings keep their text in the core: a stop string must end the
sample at the exact token that completes it, and only text can tell which one that is.
"""

from __future__ import annotations

from typing import Any, Optional

from pagedrs.sampling_params import SamplingParams
from pagedrs.tokenizer import IncrementalDetokenizer, Tokenizer


def text_made_here(params: Any, tokenizer: Tokenizer) -> bool:
    """Whether the API side can make this request's text (then the core need not)."""
    if getattr(tokenizer, "hf", None) is None:  # skip_tokenizer_init: there is no text at all
        return False
    if not isinstance(params, SamplingParams) or not params.detokenize:
        return False
    if params.stop or params.use_beam_search:
        return False
    return params.best_of is None or params.best_of == params.n


class RequestText:
    """The text state of one request's samples, keyed by sample index."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._samples: dict[int, IncrementalDetokenizer] = {}

    def delta(
        self, prompt_token_ids: list[int], index: int, new_token_ids: list[int], finish_reason: Optional[str],
        stop_reason: Any,
    ) -> str:
        """The text that ``new_token_ids`` add to sample ``index`` (see the module docs)."""
        detok = self._samples.get(index)
        if detok is None:
            detok = self._samples[index] = IncrementalDetokenizer(self._tokenizer, prompt_token_ids, self._skip)
        ends_on_stop_token = finish_reason == "stop" and not isinstance(stop_reason, str)
        text_ids = new_token_ids[:-1] if ends_on_stop_token and new_token_ids else new_token_ids
        text = "".join(detok.step([token]) for token in text_ids)
        if finish_reason in ("stop", "length"):
            text += detok.flush()
        return text
