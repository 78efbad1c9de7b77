"""The engine: requests in, incremental outputs out, one scheduler step at a time.

    add_request ──► Scheduler (Rust) ──► StepPlan ──► ModelRunner ──► logits ──► sample
                        ▲                                                          │
                        └───────── append_tokens / fork / finish ◄── stop checks ◄─┘

The engine never decides anything about memory; it turns text into token ids,
runs what the scheduler planned, and turns sampled tokens back into text.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Optional, Union

import numpy as np
import torch

from pagedrs._core import Scheduler
from pagedrs.engine_args import EngineArgs
from pagedrs.memory import plan_kv_memory
from pagedrs.model_runner import ModelRunner
from pagedrs.models import load_model
from pagedrs.outputs import RequestOutput
from pagedrs.request import Request, SampleState, record_token
from pagedrs.sampling import SamplingRow, sample
from pagedrs.sampling_params import SamplingParams
from pagedrs.step_input import StepInput
from pagedrs.tokenizer import IncrementalDetokenizer

PromptType = Union[str, list[int], dict[str, Any]]


class Engine:
    def __init__(self, args: Optional[EngineArgs] = None, **kwargs: Any) -> None:
        args = args if args is not None else EngineArgs(**kwargs)
        self.args = args
        torch.manual_seed(args.seed)
        self.device = torch.device(args.device)
        if self.device.type == "cpu":
            torch.set_num_threads(args.cpu_threads or 1)
        self.loaded = load_model(args.model, dtype=args.dtype, device=self.device, weight_dtype=args.weight_dtype)
        self.tokenizer = self.loaded.tokenizer
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids)
        self.model_name = self.loaded.name
        config = self.loaded.config
        self.max_model_len = args.max_model_len or config.max_position_embeddings
        num_parameters = sum(p.numel() for p in self.loaded.model.parameters())
        self.kv_plan = plan_kv_memory(
            bytes_per_token=config.kv_bytes_per_token(args.dtype),
            block_size=args.block_size,
            num_parameters=num_parameters,
            device=self.device,
            num_gpu_blocks=args.num_gpu_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            swap_space_gb=args.swap_space_gb if args.kv_layout == "paged" else 0.0,
        )
        plan = self.kv_plan
        self.scheduler = Scheduler(
            plan.num_gpu_blocks,
            args.block_size,
            num_cpu_blocks=plan.num_cpu_blocks,
            enable_prefix_caching=args.enable_prefix_caching and args.kv_layout == "paged",
            kv_layout=args.kv_layout,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            preemption_mode=args.preemption_mode if args.kv_layout == "paged" else "recompute",
            # A contiguous reservation never grows, so holding pages back only costs it a sequence.
            watermark_blocks=int(args.watermark * plan.num_gpu_blocks) if args.kv_layout == "paged" else 0,
            aging_steps=args.aging_steps,
            swap_cost_per_block=plan.swap_cost_per_block,
            recompute_cost_per_token=plan.recompute_cost_per_token,
            host_cache_evicted=args.host_cache_evicted,
        )
        self.runner = ModelRunner(
            self.loaded,
            num_gpu_blocks=plan.num_gpu_blocks,
            num_cpu_blocks=plan.num_cpu_blocks,
            block_size=args.block_size,
        )
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, tuple[Request, SampleState]] = {}
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._num_generated = 0
        self._peak_running = 0

    @classmethod
    def from_args(cls, **kwargs: Any) -> "Engine":
        return cls(EngineArgs(**kwargs))

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        priority: int = 0,
    ) -> None:
        """Validates and queues a request; raises ValueError with nothing changed."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {request_id!r}: params must be SamplingParams, not {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id is {request_id!r}; it must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already exists; request ids must be unique among unfinished requests")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority is {priority!r}; it must be an int")
        text, token_ids = self._tokenize_prompt(request_id, prompt)
        reserve = self._reserve_tokens(len(token_ids), params)
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        if not self.scheduler.fits_in_pool(longest, reserve):
            raise ValueError(
                f"request {request_id!r} needs up to {max(longest, reserve)} tokens of KV cache "
                f"(prompt {len(token_ids)} + max_tokens {params.max_tokens}); the pool holds "
                f"{self.kv_plan.num_gpu_blocks} blocks x {self.args.block_size} tokens"
            )
        seq_id = next(self._seq_ids)
        arrival = next(self._arrivals)
        self.scheduler.add_sequence(seq_id, np.asarray(token_ids, dtype=np.uint32), priority, arrival, reserve)
        first = self._new_sample(seq_id, 0, token_ids, params)
        request = Request(request_id, text, token_ids, params, priority, arrival, [first])
        self._requests[request_id] = request
        self._by_seq[seq_id] = (request, first)

    def _tokenize_prompt(self, request_id: str, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"request {request_id!r}: a dict prompt needs 'prompt_token_ids' or 'prompt'; got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            text, token_ids = None, [int(t) for t in prompt]
            vocab = self.loaded.config.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"request {request_id!r}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        else:
            raise ValueError(f"request {request_id!r}: prompt must be a str, a list of token ids or a dict; got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; at least 1 token is needed")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}"
            )
        return text, token_ids

    def _reserve_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        if self.args.kv_layout != "contiguous":
            return 0
        if self.args.contiguous_reserve == "request":
            return min(prompt_len + params.max_tokens, self.max_model_len)
        return self.max_model_len

    def _new_sample(self, seq_id: int, index: int, prompt_ids: list[int], params: SamplingParams) -> SampleState:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
        return SampleState(seq_id=seq_id, index=index, detokenizer=detok, generator=generator)

    def abort(self, request_id: str) -> bool:
        """Ends a request now and frees its pages; its final output comes with the next step."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._end_request(request, "abort")
        self._pending_outputs.append(request.to_output())
        return True

    def _end_request(self, request: Request, reason: str) -> None:
        for s in request.samples:
            if not s.finished:
                s.finish_reason = reason
            self._release(s.seq_id)
        while len(request.samples) < request.params.n:  # samples never forked
            request.samples.append(
                SampleState(seq_id=-1, index=len(request.samples), detokenizer=request.samples[0].detokenizer,
                            generator=None, finish_reason=reason)
            )
        request.finished_time = time.monotonic()

    def _release(self, seq_id: int) -> None:
        if self._by_seq.pop(seq_id, None) is not None and self.scheduler.contains(seq_id):
            self.scheduler.finish(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs)

    def num_unfinished(self) -> int:
        return len(self._requests)

    # ---- one step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns an output for every request that progressed."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self._requests:
            return outputs
        plan = self.scheduler.schedule()
        self._peak_running = max(self._peak_running, self.scheduler.num_running)
        step = StepInput(
            input_ids=plan.input_ids,
            positions=plan.positions,
            slot_mapping=plan.slot_mapping,
            query_start_loc=plan.query_start_loc,
            seq_lens=plan.seq_lens,
            block_tables=plan.block_tables,
            swap_out=plan.swap_out,
            swap_in=plan.swap_in,
            copies=plan.copies,
        )
        logits = self.runner.execute(step)
        seq_ids = plan.seq_ids.tolist()
        do_sample = plan.do_sample.tolist()
        rows_logits, rows, owners = [], [], []
        touched: dict[str, Request] = {}
        for i, (seq_id, sampled) in enumerate(zip(seq_ids, do_sample)):
            if not sampled or seq_id not in self._by_seq:
                continue
            request, state = self._by_seq[seq_id]
            # n > 1: the prompt's logits give every sample its first token.
            fan_out = request.params.n if (request.params.n > 1 and not request.forked) else 1
            try:
                samples = [state] + [self._fork_sample(request, state, k) for k in range(1, fan_out)]
            except Exception as exc:  # e.g. the contiguous layout has no room for a child's region
                self._fail(request, exc, touched)
                continue
            request.forked = request.forked or fan_out > 1
            for owner in samples:
                rows_logits.append(i)
                rows.append(SamplingRow(request.params, owner.generator, request.prompt_token_ids, owner.token_ids, self._eos_ids))
                owners.append((request, owner))
        if rows:
            results = sample(logits[rows_logits], rows)
            self._apply_samples(owners, results, touched)
        for request in touched.values():
            outputs.append(request.to_output())
            if request.finished:
                self._requests.pop(request.request_id, None)
        return outputs

    def _fork_sample(self, request: Request, parent: SampleState, index: int) -> SampleState:
        seq_id = next(self._seq_ids)
        self.scheduler.fork(parent.seq_id, seq_id)
        child = self._new_sample(seq_id, index, request.prompt_token_ids, request.params)
        request.samples.append(child)
        self._by_seq[seq_id] = (request, child)
        return child

    def _fail(self, request: Request, exc: Exception, touched: dict[str, Request]) -> None:
        """Ends one request with finish_reason "error"; the engine and other requests go on."""
        request.error = f"{type(exc).__name__}: {exc}"
        self._end_request(request, "error")
        touched[request.request_id] = request

    def _apply_samples(self, owners, results, touched: dict[str, Request]) -> None:
        now = time.monotonic()
        cont_ids, cont_tokens = [], []
        for (request, state), result in zip(owners, results):
            touched[request.request_id] = request
            if request.first_token_time is None:
                request.first_token_time = now
            if request.error is not None:
                continue  # a sibling sample already failed the request
            try:
                record_token(state, result.token_id, result.logprob, result.top_logprobs, request, self.tokenizer, self.max_model_len)
            except Exception as exc:  # one request's failure must not take the engine down
                self._fail(request, exc, touched)
                continue
            self._num_generated += 1
            if state.finished:
                self._release(state.seq_id)
                if request.finished:
                    request.finished_time = now
            else:
                cont_ids.append(state.seq_id)
                cont_tokens.append(result.token_id)
        if cont_ids:
            self.scheduler.append_tokens(np.asarray(cont_ids, dtype=np.uint64), np.asarray(cont_tokens, dtype=np.uint32))

    # ---- reporting ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        s = dict(self.scheduler.stats())
        reserved, live = s.pop("reserved_slots"), s.pop("live_slots")
        utilization = live / reserved if reserved else 1.0
        s.update(
            num_cpu_blocks=self.kv_plan.num_cpu_blocks,
            kv_layout=self.args.kv_layout,
            block_size=self.args.block_size,
            kv_reserved_slots=reserved,
            kv_live_slots=live,
            kv_utilization=utilization,
            kv_waste_pct=100.0 * (1.0 - utilization),
            prefix_hit_rate=(s["prefix_hits"] / s["prefix_queries"]) if s["prefix_queries"] else 0.0,
            num_generated_tokens=self._num_generated,
            peak_running=self._peak_running,
            kv_bytes_per_block=self.kv_plan.bytes_per_block,
        )
        return s
