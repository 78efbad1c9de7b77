"""What a request asks of the sampler and of the engine's stopping rules, validated up front.

Every field is checked in ``__post_init__`` so that a bad value fails at
``add_request`` time with a message naming the field, the value and the allowed
range, before anything runs. Ranges follow vLLM and the OpenAI API.

Two of vLLM v0's request shapes live here too. ``best_of``: draw ``best_of`` samples and
return the ``n`` with the highest cumulative log-probability. ``use_beam_search``: beam
search of width ``beam_width`` (default ``best_of``, else ``n``), returning its best ``n``
hypotheses; the engine runs it as ``BeamSearchParams`` (``pagedrs.beam_search``), and
settings beam search would silently ignore (top-p, top-k, min-p, seed, penalties, a
sampling temperature, stop strings, logprobs) are refused here, as vLLM v0 refused them.

A request's grammar constraint, ``StructuredOutputsParams``, and its bounds are
``structured_params``'s (re-exported here).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal, Optional, TypeGuard

from pagedrs.structured_params import (  # noqa: F401  (re-exported: their home before structured_params.py)
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_STRUCTURED_SPEC_BYTES,
    STRUCTURED_KINDS,
    StructuredOutputsParams,
    json_depth,
)

# Bounds that keep every value inside the tensor or core type it ends up in, and a
# hostile request from costing more than its share (see README, "Limits and safety").
MAX_N = 1024  # samples per prompt, absolute; EngineArgs.max_n (default 128) is the serving limit
MAX_TOP_K = 2**31 - 1  # int32; larger values are clamped to the vocabulary when sampling anyway
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID = 2**31 - 1
MAX_LOGIT_BIAS = 4096  # entries in logit_bias (OpenAI documents no bound; each costs a little every step)
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
MAX_ALLOWED_TOKEN_IDS = 2**18  # entries in allowed_token_ids: more than any vocabulary served today
MAX_TOKENS_LIMIT = 2**31 - 1  # the context length caps generation far below this
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-40
# overflows to inf and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top alternatives per generated token (OpenAI's top_logprobs bound)
MAX_PROMPT_LOGPROBS = 20  # top alternatives per prompt token (vLLM's max_logprobs default)
MAX_BEAM_WIDTH = 256  # the core forks up to k beams per step; this keeps one request's share bounded
EARLY_STOPPING = (True, False, "never")  # transformers' meanings


class RequestOutputKind(enum.IntEnum):
    """Which RequestOutputs a request gets (vLLM's names and values).

    Building a cumulative output per request per step costs the front end a copy of every
    token list and a text decode per token, for consumers that often read only the end:

    * ``CUMULATIVE``: every step, everything so far (``text``, ``token_ids``, ``logprobs``) plus
      the deltas; the default for direct engine users.
    * ``DELTA``: every step, only what is new: ``CompletionOutput.text`` and ``token_ids`` are the
      delta (equal to ``delta_text``/``delta_token_ids``), ``logprobs`` the new tokens' entries,
      ``cumulative_logprob`` the running total; a sample appears only when it gained something or
      finished (a finished sample is not repeated), ``prompt_logprobs`` in the first output only.
      For streaming.
    * ``FINAL_ONLY``: nothing until the request ends (finished, aborted or failed); then one output
      equal to CUMULATIVE's last in text, tokens and logprobs. ``LLM.generate`` uses it.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


OUTPUT_KINDS = ", ".join(f"{k.name} ({k.value})" for k in RequestOutputKind)


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is out of range: allowed {allowed}")


def _short(value: object) -> object:
    """A value as an error message shows it: long reprs cut (a hostile request's values may be huge)."""
    text = repr(value)
    return value if len(text) <= 80 else _Shown(text[:77] + "...")


class _Shown(str):
    """Text shown as it is by ``repr`` (a cut repr in an error message)."""

    def __repr__(self) -> str:
        return str(self)


def _conflict(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"SamplingParams.{name}={value!r} is not allowed with use_beam_search=True: {allowed}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (NaN and infinities are never a valid setting)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return math.isfinite(value) if isinstance(value, float) else abs(value) < 2**1023


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
    # False: the engine makes no text (outputs carry token ids, text ""), as in vLLM. The
    # served path uses it: its API process makes the text, so the core only runs the model.
    detokenize: bool = True
    best_of: int | None = None  # None = n; > n: draw best_of, return the n of highest cumulative logprob
    use_beam_search: bool = False
    beam_width: int | None = None  # beam search only; None = best_of, else n
    length_penalty: float = 1.0  # beam search only: score = cumulative logprob / length ** length_penalty
    early_stopping: bool | Literal["never"] = False  # beam search only: transformers' meanings
    # a grammar the output must follow (JSON schema, regex, choice, grammar); None: free text
    structured_outputs: Optional[StructuredOutputsParams] = None
    # None = off; k: every prompt token after the first gets its logprob plus the top-k alternatives
    # (RequestOutput.prompt_logprobs, first entry None). Such a request bypasses the prefix cache.
    prompt_logprobs: int | None = None
    # which RequestOutputs the request gets (RequestOutputKind); a plain int 0-2 is taken as one.
    # Last field: a field added at the end travels through the multiprocess codec unchanged.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # token id -> a number added to its logit before every draw (OpenAI's logit_bias: -100 in
    # effect bans a token, 100 all but forces it); before the penalties, as in vLLM. The reported
    # logprobs stay the model's (raw logits). {} means none.
    logit_bias: Optional[dict[int, float]] = None
    # vLLM's: only these token ids can be drawn (every other logit is -inf before sampling);
    # None: any token. Checked against the model's vocabulary when the request is added.
    allowed_token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            _fail("n", self.n, f"1 <= n <= {MAX_N} (and at most the engine's EngineArgs.max_n, 128 by default)")
        if not _is_number(self.temperature) or self.temperature < 0:
            _fail("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "0 < top_p <= 1")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)) or self.top_k > MAX_TOP_K:
            _fail("top_k", self.top_k, f"an integer in [1, {MAX_TOP_K}], or 0 / -1 to disable")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "0 <= min_p <= 1")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            _fail("seed", self.seed, f"None or an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            _fail("repetition_penalty", self.repetition_penalty, "0 < value <= 100 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                _fail(name, value, "-2 <= value <= 2")
        self.stop = self._normalize_stop(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) and self.stop_token_ids is not None:
            _fail("stop_token_ids", self.stop_token_ids, "a list of token ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            _is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids
        ):
            _fail("stop_token_ids", self.stop_token_ids,
                  f"at most {MAX_STOP_TOKEN_IDS} token ids, each in [0, {MAX_TOKEN_ID}]")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            _fail("max_tokens", self.max_tokens, f"an integer in [1, {MAX_TOKENS_LIMIT}]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _fail("logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS
        ):
            _fail("prompt_logprobs", self.prompt_logprobs, f"None or an integer in [0, {MAX_PROMPT_LOGPROBS}]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "use_beam_search",
                     "detokenize"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "true or false")
        if self.stop and not self.detokenize:
            _fail("detokenize", self.detokenize, f"true when stop strings are set (stop={self.stop!r} needs the text)")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_N):
            _fail("best_of", self.best_of, f"None or an integer in [n={self.n}, {MAX_N}]")
        self.output_kind = self._normalize_output_kind(self.output_kind)
        self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        self.allowed_token_ids = self._normalize_allowed_token_ids(self.allowed_token_ids)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _fail("structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
        if self.structured_outputs is not None and self.ignore_eos:
            _fail("ignore_eos", self.ignore_eos, "false with structured_outputs (the grammar decides where the answer "
                  "ends, and EOS ends it there: ignore_eos could not take effect)")
        if self.structured_outputs is not None and self.min_tokens:
            _fail("min_tokens", self.min_tokens, "0 with structured_outputs (the grammar decides where the answer "
                  "may end; EOS is allowed exactly there)")
        if self.structured_outputs is not None:
            # a stop string or token can only end an answer before the grammar has matched it (once it has, EOS
            # alone is allowed): the cut text ('{"name"') came back with finish_reason "stop", as if complete
            for name in ("stop", "stop_token_ids"):
                if getattr(self, name):
                    _fail(name, getattr(self, name), "empty with structured_outputs (the grammar decides where the "
                          "answer ends; a stop would cut it before it matches the constraint)")
        if self.use_beam_search:
            self._check_beam_search()
        else:
            self._check_no_beam_fields()

    def _check_beam_search(self) -> None:
        """vLLM v0's rules: beam search is deterministic, so no sampling setting may be set."""
        if self.beam_width is not None and (not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH):
            _fail("beam_width", self.beam_width, f"None or an integer in [1, {MAX_BEAM_WIDTH}]")
        if self.beam_width is not None and self.best_of is not None and self.beam_width != self.best_of:
            _conflict("best_of", self.best_of, f"it is the beam width, and beam_width={self.beam_width} differs; "
                      "set one of them")
        width = self.beam_search_width
        if width > MAX_BEAM_WIDTH:  # beam_width is checked above: the width is best_of or n
            name = "best_of" if self.best_of is not None else "n"
            _fail(name, width, f"at most {MAX_BEAM_WIDTH} with use_beam_search=True (the largest beam width)")
        if self.n > width:
            _fail("n", self.n, f"n <= beam_width={width}: the best n of the beam_width hypotheses are returned")
        if not _is_number(self.length_penalty) or abs(self.length_penalty) > 100:
            _fail("length_penalty", self.length_penalty, "a finite number in [-100, 100]")
        if self.early_stopping not in EARLY_STOPPING or not isinstance(self.early_stopping, (bool, str)):
            _fail("early_stopping", self.early_stopping, 'true, false or "never"')
        # Temperature 1.0 is the default and leaves the log-probabilities unchanged, so it
        # means what 0 (vLLM v0's rule) means: transformers' beam search. Others would scale.
        if not (self.is_greedy or self.temperature == 1.0):
            _conflict("temperature", self.temperature, "allowed 0 (greedy) or the default 1.0; "
                      "use BeamSearchParams(temperature=...) to search a scaled distribution")
        defaults = {"top_p": 1.0, "min_p": 0.0, "seed": None, "repetition_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "allowed_token_ids": None}
        for name, default in defaults.items():
            if getattr(self, name) != default:
                _conflict(name, getattr(self, name), f"allowed only {default!r} (beam search does not sample)")
        if self.logprobs is not None:
            _conflict("logprobs", self.logprobs, "allowed only None (a hypothesis reports its cumulative_logprob "
                      "and score, not per-token logprobs)")
        if self.prompt_logprobs is not None:
            _conflict("prompt_logprobs", self.prompt_logprobs, "allowed only None (not implemented with beam search; "
                      "run the prompt once with SamplingParams(prompt_logprobs=k, max_tokens=1) instead)")
        if self.top_k not in (0, -1):
            _conflict("top_k", self.top_k, "allowed only 0 or -1 (beam search does not sample)")
        if self.stop:
            _conflict("stop", self.stop, "stop strings are not supported with beam search (transformers' beam "
                      "search has no per-beam stop strings); use stop_token_ids")

    def _check_no_beam_fields(self) -> None:
        """Beam-search settings without beam search would be silently ignored: refuse them."""
        for name, default in (("beam_width", None), ("length_penalty", 1.0), ("early_stopping", False)):
            value = getattr(self, name)
            if value != default:
                raise ValueError(
                    f"SamplingParams.{name}={value!r} is only used with use_beam_search=True: leave it "
                    f"at {default!r} or set use_beam_search=True"
                )

    @property
    def beam_search_width(self) -> int:
        """The beam width of a beam search request: beam_width, else best_of, else n (vLLM v0)."""
        return self.beam_width or self.best_of or self.n

    @staticmethod
    def _normalize_output_kind(kind: object) -> RequestOutputKind:
        """A RequestOutputKind, or its int value (what the codec and JSON carry); never a bool (True
        would silently be DELTA) or a name (vLLM takes the enum only)."""
        if isinstance(kind, RequestOutputKind):
            return kind
        if _is_int(kind) and kind in RequestOutputKind._value2member_map_:
            return RequestOutputKind(kind)
        _fail("output_kind", kind, f"a RequestOutputKind: {OUTPUT_KINDS}")
        raise AssertionError("unreachable: _fail raises")

    @staticmethod
    def _normalize_logit_bias(bias: object) -> Optional[dict[int, float]]:
        """None (also for {}), or a dict of token ids to finite biases in [-100, 100]: each entry
        checked, the first bad one named (never the whole dict: it may hold thousands)."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            _fail("logit_bias", _short(bias), "None or a dict of token ids to biases")
        assert isinstance(bias, dict)
        if len(bias) > MAX_LOGIT_BIAS:
            _fail("logit_bias", _Shown(f"<{len(bias)} entries>"), f"at most {MAX_LOGIT_BIAS} entries")
        out: dict[int, float] = {}
        for token, value in bias.items():
            if not _is_int(token) or not 0 <= token <= MAX_TOKEN_ID:
                _fail("logit_bias", {_short(token): _short(value)},
                      f"token ids (ints) in [0, {MAX_TOKEN_ID}] as keys")
            if not _is_number(value) or abs(value) > MAX_LOGIT_BIAS_VALUE:
                _fail("logit_bias", {token: _short(value)},
                      f"finite numbers in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}] as biases")
            out[int(token)] = float(value)
        return out or None

    @staticmethod
    def _normalize_allowed_token_ids(ids: object) -> Optional[list[int]]:
        """None, or a non-empty list of token ids (an empty one would leave nothing to draw)."""
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)):
            _fail("allowed_token_ids", _short(ids), "None or a non-empty list of token ids")
        assert isinstance(ids, (list, tuple))
        if not 1 <= len(ids) <= MAX_ALLOWED_TOKEN_IDS:
            _fail("allowed_token_ids", _Shown(f"<{len(ids)} entries>"),
                  f"None or a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids (none would leave nothing to draw)")
        for token in ids:
            if not _is_int(token) or not 0 <= token <= MAX_TOKEN_ID:
                _fail("allowed_token_ids", _Shown(f"[..., {_short(token)!r}, ...]"), f"token ids (ints) in [0, {MAX_TOKEN_ID}]")
        return [int(t) for t in ids]

    @staticmethod
    def _normalize_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        if not isinstance(stop, (str, list, tuple)):
            _fail("stop", stop, "a non-empty string, a list of non-empty strings, or None")
        stops = [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stops
        ):
            _fail("stop", stop, f"at most {MAX_STOP_STRINGS} non-empty strings of at most "
                  f"{MAX_STOP_STRING_CHARS} characters each, or None")
        for s in stops:  # a lone surrogate is in no decoded text: such a stop could never match
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as exc:
                _fail("stop", stop, f"valid Unicode strings (a lone surrogate {s[exc.start]!r} at character "
                      f"{exc.start} of {s!r} can never appear in decoded text)")
        return stops

    @property
    def is_greedy(self) -> bool:
        """Temperatures below GREEDY_TEMPERATURE (vLLM's rule) are greedy: argmax, no draw."""
        return self.temperature < GREEDY_TEMPERATURE
