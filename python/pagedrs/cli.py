"""The `pagedrs` command: generate, chat, kv-size, demo, bench, serve."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="preset name, HF folder or .gguf file")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    _add_cpu_threads(p)


def _add_cpu_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads on the CPU (default: $PAGEDRS_CPU_THREADS, else 1 for offline commands)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, device=args.device, dtype=args.dtype, num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size,
                cpu_threads=args.cpu_threads)


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedrs import LLM, SamplingParams

    llm = LLM(**_engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    prompt = {"prompt_token_ids": llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])} if args.chat else args.prompt
    if args.stream:
        for delta in llm.stream(prompt, params):
            print(delta, end="", flush=True)
        print()
    else:
        print(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from pagedrs.chat_repl import run_chat

    return run_chat(_engine_kwargs(args), max_tokens=args.max_tokens, temperature=args.temperature)


def _cmd_kv_size(args: argparse.Namespace) -> int:
    from pagedrs.kv_size import kv_size

    try:
        result = kv_size(args.model, args.tokens, args.seqs, args.dtype)
    except (ValueError, KeyError) as exc:
        print(f"pagedrs kv-size: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        gb = 1e9
        print(f"{args.model} ({args.dtype}): {result['bytes_per_token']:,} bytes/token, "
              f"{result['bytes_per_sequence'] / gb:.2f} GB per {args.tokens}-token sequence, "
              f"{result['total_bytes'] / gb:.1f} GB for {args.seqs} sequences")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from pagedrs.demo import QUESTIONS, run_demo

    run_demo(max_tokens=args.max_tokens, num_questions=args.num_questions or len(QUESTIONS), cpu_threads=args.cpu_threads)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedrs", description="LLM inference on a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt")
    g.add_argument("prompt")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stream", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_engine_args(c)
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.set_defaults(func=_cmd_chat)

    k = sub.add_parser("kv-size", help="KV-cache memory per token, sequence and batch")
    k.add_argument("--model", required=True, help="preset (llama-3.1-70b, ...) or config.json path")
    k.add_argument("--tokens", type=int, required=True)
    k.add_argument("--seqs", type=int, default=1)
    k.add_argument("--dtype", default="float16")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_kv_size)

    d = sub.add_parser("demo", help="the embedded model answers chats sharing a system prompt")
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--num-questions", type=int, default=None)
    _add_cpu_threads(d)
    d.set_defaults(func=_cmd_demo)

    # bench and serve parse their own flags.
    sub.add_parser("bench", help="benchmarks (see `pagedrs bench --help`)", add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server", add_help=False)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from pagedrs.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "serve":
        from pagedrs.server import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
