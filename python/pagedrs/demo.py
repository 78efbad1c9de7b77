"""`pagedrs demo`: the embedded SmolLM2 answers a batch of chats sharing one system prompt.

One answer streams to the terminal while the others run in the same batches; then
every answer and a report of what the paged KV cache did: throughput, pages used,
KV utilization and waste, prefix-cache hits and the memory that sharing saved.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

SYSTEM_PROMPT = (
    "You are a concise, friendly assistant for a public library. Answer in one or two short "
    "sentences. Be accurate, avoid speculation, and say so when you do not know something. "
    "Library hours are 9am to 6pm on weekdays and 10am to 4pm on Saturdays; it is closed on Sundays. "
    "Members may borrow up to ten books for three weeks and renew them twice online."
)

QUESTIONS = [
    "What is the capital of France?",
    "How many books can I borrow at once?",
    "Is the library open on Sunday?",
    "Give me a tip for learning to cook.",
    "What is photosynthesis, briefly?",
    "Can I renew my books online?",
    "Suggest a name for a black cat.",
    "Why is the sky blue?",
]


def run_demo(
    max_tokens: int = 48, num_questions: int = len(QUESTIONS), out: TextIO | None = None, cpu_threads: int | None = None,
    tensor_parallel_size: int = 1,
) -> dict:
    # sys.stdout now, not when this module was imported (a default bound at import kept a stale stream)
    out = out if out is not None else sys.stdout
    from pagedrs import Engine, EngineArgs, SamplingParams

    engine = Engine(EngineArgs(model="smollm2-135m", num_gpu_blocks=256, max_num_batched_tokens=1024,
                               cpu_threads=cpu_threads, tensor_parallel_size=tensor_parallel_size))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    questions = QUESTIONS[:num_questions]
    for i, q in enumerate(questions):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        engine.add_request(f"q{i}", {"prompt_token_ids": engine.tokenizer.apply_chat_template(messages)}, params)

    print(f"pagedrs demo — {engine.model_name}, {len(questions)} chats sharing one system prompt\n", file=out)
    print(f"> {questions[0]}\n", file=out, flush=True)
    answers: dict[str, str] = {}
    peak_used, live, reserved = 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "q0":
                print(o.outputs[0].delta_text, end="", file=out, flush=True)
            if o.finished:
                answers[o.request_id] = o.outputs[0].text
        step_stats = engine.stats()
        peak_used = max(peak_used, step_stats["num_used_gpu_blocks"])
        live += step_stats["kv_live_slots"]
        reserved += step_stats["kv_reserved_slots"]
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    print("\n", file=out)
    for i, q in enumerate(questions):
        print(f"[{i}] {q}\n    {answers[f'q{i}'].strip()}", file=out)

    block_bytes = stats["kv_bytes_per_block"]
    report = {
        "requests": len(questions),
        "generated_tokens": stats["num_generated_tokens"],
        "tokens_per_s": stats["num_generated_tokens"] / elapsed,
        "elapsed_s": elapsed,
        "peak_pages_used": peak_used,
        "num_gpu_blocks": stats["num_gpu_blocks"],
        "prefix_hit_rate": stats["prefix_hit_rate"],
        "prefix_hits": stats["prefix_hits"],
        "shared_bytes_saved": stats["prefix_hits"] * block_bytes,
        "preemptions": stats["num_preemptions"],
        # live token slots / slots in pages held by live requests, summed over steps
        "kv_utilization": live / reserved if reserved else 1.0,
    }
    print(
        f"\nreport: {report['generated_tokens']} tokens in {elapsed:.1f}s = {report['tokens_per_s']:.1f} tok/s | "
        f"peak pages {peak_used}/{stats['num_gpu_blocks']} | KV utilization {100 * report['kv_utilization']:.1f}% "
        f"(waste {100 * (1 - report['kv_utilization']):.1f}%) | prefix hits {stats['prefix_hits']} blocks "
        f"({100 * stats['prefix_hit_rate']:.0f}% of lookups), sharing saved {report['shared_bytes_saved'] / 2**20:.1f} MiB | "
        f"preemptions {stats['num_preemptions']}",
        file=out,
    )
    engine.shutdown()
    return report
