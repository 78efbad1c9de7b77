"""The Hugging Face transformers baseline: static padded batches through ``model.generate``.

This is how people batch with transformers: take the requests in arrival order in
groups of B, left-pad the prompts to the longest in the group, and generate until the
longest output of the group is done; a short request's slot idles until then. B is as
large as the shared KV byte budget allows for the worst case of the workload (longest
prompt + longest output), since a static batch must fit whatever lands in it.

EOS is disabled (``eos_token_id`` unset) so every row runs to its length, like
``ignore_eos`` on the engines; only each request's own ``max_tokens`` count as output.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pagedrs.bench.engine_runner import progress
from pagedrs.bench.metrics import Timeline, summarize
from pagedrs.bench.workloads import BenchRequest


def load_hf_model(folder: Path, dtype: str) -> Any:
    """The same weights the engine loads (``model_spec.resolve_model``), as a transformers model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), local_files_only=True)
    model.eval()
    return model


def static_batch_size(budget_slots: int, requests: list[BenchRequest]) -> int:
    """Largest B with B * (longest prompt + longest output) <= budget_slots (at least 1)."""
    worst = max(len(r.prompt_token_ids) for r in requests) + max(r.max_tokens for r in requests)
    return max(1, budget_slots // worst)


class _StepRecorder:
    """A logits processor that only records when each decode step happened and how long
    the padded sequences were: the cache holds ``batch * cur_len`` slots at that point."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.points: list[tuple[float, int]] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.points.append((time.perf_counter() - self.start, int(input_ids.shape[1])))
        return scores


def run_hf(model: Any, requests: list[BenchRequest], batch_size: int, bytes_per_token: int) -> dict[str, Any]:
    import torch
    from transformers import LogitsProcessorList

    pad_id = 0
    t_list: list[float] = []
    running: list[int] = []
    reserved: list[int] = []
    live: list[int] = []
    outputs = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for b0 in range(0, len(requests), batch_size):
            batch = requests[b0 : b0 + batch_size]
            plen = [len(r.prompt_token_ids) for r in batch]
            pmax = max(plen)
            ids = torch.full((len(batch), pmax), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), pmax), dtype=torch.long)
            for i, r in enumerate(batch):  # left padding: every row ends at the same column
                ids[i, pmax - plen[i] :] = torch.tensor(r.prompt_token_ids)
                mask[i, pmax - plen[i] :] = 1
            new = max(r.max_tokens for r in batch)
            rec = _StepRecorder(start)
            model.generate(
                input_ids=ids.to(model.device),  # (benches/gpu_e2e.py runs the model on a GPU)
                attention_mask=mask.to(model.device),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([rec]),
            )
            for t, cur_len in rec.points:
                generated = cur_len - pmax  # tokens already in the cache beyond the prompt
                t_list.append(t)
                running.append(len(batch))
                reserved.append(len(batch) * cur_len)
                live.append(sum(p + min(generated, r.max_tokens) for p, r in zip(plen, batch)))
            outputs += sum(r.max_tokens for r in batch)
            progress(f"transformers: {b0 + len(batch)}/{len(requests)} finished after {time.perf_counter() - start:.0f} s")
    wall = time.perf_counter() - start
    result = summarize(
        wall_s=wall,
        num_requests=len(requests),
        num_output_tokens=outputs,
        num_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        timeline=Timeline(t_list, running, reserved, live),
        bytes_per_token=bytes_per_token,
    )
    result["batch_size"] = batch_size
    return result
