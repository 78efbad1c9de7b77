"""`LLM`: the offline, batch-at-once face of the engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from typing import Any, Optional, Union

from pagedrs.beam_search import NEG, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedrs.core.protocol import CacheReset
from pagedrs.engine import Engine, PromptType
from pagedrs.engine_args import EngineArgs
from pagedrs.outputs import RequestOutput
from pagedrs.sampling_params import RequestOutputKind, SamplingParams

Messages = list[dict[str, str]]


class LLM:
    """``with LLM(...) as llm:`` shuts the engine down at the end of the block; so does garbage
    collection or interpreter exit (tensor-parallel workers stop, the process group goes)."""

    def __init__(self, model: Optional[str] = "smollm2-135m", **kwargs: Any) -> None:
        self.engine = Engine(EngineArgs(model=model, **kwargs))
        self._ids = 0

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """``Engine.shutdown``: aborts what is left, releases the workers, the disk tier and the KV pools."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> CacheReset:
        """Forgets every cached prefix page on the device, host and disk tiers (vLLM's
        ``LLM.reset_prefix_cache``, which its CPU tier once survived: vLLM issue 57727). Returns
        the pages each tier dropped; raises ``PrefixCacheBusyError`` while requests run."""
        return self.engine.reset_prefix_cache()

    def pin_prefix(self, prompt_or_messages: Union[PromptType, Messages], ttl_s: Optional[float] = None,
                   cache_salt: Optional[str] = None) -> str:
        """Prefills a prompt (a system prompt, or chat messages) and keeps its pages on the device
        until ``unpin`` or ``ttl_s`` seconds: every later request that starts with it hits them,
        however full the cache gets (``Engine.pin``). Returns the pin id. ValueError for a bad
        prompt or TTL, PinCapError past ``max_pinned_fraction`` of the pool."""
        return self.engine.pin_prefix(prompt_or_messages, ttl_s, cache_salt)

    def unpin(self, pin_id: str) -> None:
        """Releases a pin (``Engine.unpin``); UnknownPinError (a KeyError) when it is not live."""
        self.engine.unpin(pin_id)

    def _next_id(self) -> str:
        self._ids += 1
        return f"llm-{self._ids}"

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        params: Union[SamplingParams, BeamSearchParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order.

        All prompts are queued before the first step, so prompts that share a prefix
        (a system prompt) share its pages, stored once. With
        ``SamplingParams(use_beam_search=True, beam_width=k)`` (or BeamSearchParams) a
        prompt's ``outputs`` are its best ``n`` hypotheses, best first.

        Every request is submitted with ``output_kind=RequestOutputKind.FINAL_ONLY``, as vLLM's
        ``LLM.generate`` does, whatever the caller's params say (they are copied, never changed):
        only the final outputs are returned, and FINAL_ONLY's final output has the text, token ids
        and logprobs CUMULATIVE's has, without an output per request per step to build (a DELTA
        final output would hold only the last step's tokens). Its ``delta_text`` and
        ``delta_token_ids`` are therefore the whole output. For outputs as they are generated,
        use ``stream`` or ``Engine.step``.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text, a dict, or token ids
        prompt_list: list[Any] = list(prompts)
        if params is None or isinstance(params, (SamplingParams, BeamSearchParams)):
            params_list = [params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"params has {len(params_list)} entries but there are {len(prompt_list)} prompts; they must match")
        params_list = _final_only(params_list)
        ids = []
        try:
            for prompt, p in zip(prompt_list, params_list):
                request_id = self._next_id()
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # leave nothing half-queued behind; their pages are freed now
                self.engine.abort(request_id)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``); hypotheses best first.

        The search runs inside the engine beside other requests, its beams sharing pages. A search
        that failed (the model's logits were NaN, ...) has no sequences and its ``error`` set.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam_search needs BeamSearchParams, not {type(params).__name__}")
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [
            BeamSearchOutput([], error=out.error) if out.error is not None else BeamSearchOutput([
                BeamSearchSequence(
                    tokens=list(out.prompt_token_ids) + list(c.token_ids), token_ids=list(c.token_ids), text=c.text,
                    # None only for a hypothesis slot never filled (or an aborted search): HF's -1e9
                    cum_logprob=c.cumulative_logprob if c.cumulative_logprob is not None else 0.0,
                    score=c.score if c.score is not None else NEG,
                    finish_reason=c.finish_reason or "length",
                )
                for c in out.outputs
            ])
            for out in outs
        ]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            wanted = set(ids)
            while len(finished) < len(ids) and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: Union[Messages, Sequence[Messages]],
        params: Union[SamplingParams, BeamSearchParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them."""
        conversations: list[Any] = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.engine.tokenizer.apply_chat_template(c)} for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def stream(self, prompt: PromptType, params: Optional[SamplingParams] = None) -> Generator[str, None, None]:
        """Yields the text of one prompt's first sample as it is generated. A request the engine ends with an
        error (NaN logits, a grammar that dead-ends) raises it after the text already yielded: a ValueError
        when the request's own input caused it (``RequestOutput.error_by_request``), else a RuntimeError;
        before, the stream just stopped, and a cut-short answer read as a whole one."""
        request_id = self._next_id()
        self.engine.add_request(request_id, prompt, params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    if out.outputs and out.outputs[0].delta_text:
                        yield out.outputs[0].delta_text
                    if out.finished:
                        if out.error is not None:
                            raise (ValueError if out.error_by_request else RuntimeError)(
                                f"request {request_id!r} failed: {out.error}")
                        return
        finally:
            self.engine.abort(request_id)  # a no-op when it finished; frees pages when the caller stops early


def _final_only(
    params_list: Sequence[Union[SamplingParams, BeamSearchParams, None]],
) -> list[Union[SamplingParams, BeamSearchParams]]:
    """The params with ``output_kind=FINAL_ONLY``: copies (one per distinct object, so a batch
    that shares one SamplingParams makes one copy), never the caller's object changed.
    BeamSearchParams pass as they are (a search only ever has a final output)."""
    copies: dict[int, SamplingParams] = {}
    out: list[Union[SamplingParams, BeamSearchParams]] = []
    for params in params_list:
        if isinstance(params, BeamSearchParams):
            out.append(params)
            continue
        if params is None:
            out.append(SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
            continue
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            out.append(params)
            continue
        copy = copies.get(id(params))
        if copy is None:
            copy = copies[id(params)] = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        out.append(copy)
    return out
