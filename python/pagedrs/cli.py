"""The `pagedrs` command: generate, chat, kv-size, demo, bench, serve, serve-ray."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from pagedrs.cli_args import add_engine_args, engine_kwargs
from pagedrs.engine_args import KV_CACHE_DTYPES

_OFFLINE_THREADS_HELP = "torch threads on the CPU (default: $PAGEDRS_CPU_THREADS, else 1 for offline commands)"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p.add_argument_group("engine"), cpu_threads_help=_OFFLINE_THREADS_HELP)


def _add_cpu_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu-threads", type=int, default=None, help=_OFFLINE_THREADS_HELP)


def _checked_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as EngineArgs fields, checked before anything loads: a bad value exits 2 naming
    the field, the value and what is allowed, instead of a traceback."""
    from pagedrs.engine_args import EngineArgs

    kwargs = engine_kwargs(args)
    try:
        EngineArgs(**kwargs)
    except ValueError as exc:
        print(f"pagedrs {args.command}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return kwargs


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedrs import LLM, SamplingParams

    try:  # before the model loads: a bad value exits 2 naming it, as the engine flags do
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
    except ValueError as exc:
        print(f"pagedrs {args.command}: error: {exc}", file=sys.stderr)
        return 2
    try:  # what only the loaded model can check (max_model_len past its context): exit 2 naming it, no traceback
        llm = LLM(**_checked_engine_kwargs(args))
    except (ValueError, OSError) as exc:
        print(f"pagedrs {args.command}: cannot start the engine: {exc}", file=sys.stderr)
        return 2
    try:  # the request's own faults (an empty or too long prompt, a pool it can never fit) exit 2 naming them
        prompt = ({"prompt_token_ids": llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])}
                  if args.chat else args.prompt)
        if args.stream:
            for delta in llm.stream(prompt, params):
                print(delta, end="", flush=True)
            print()
            return 0
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    except ValueError as exc:
        print(f"\npagedrs {args.command}: error: {exc}" if args.stream else f"pagedrs {args.command}: error: {exc}",
              file=sys.stderr)
        return 2
    except RuntimeError as exc:  # the engine's or the model's fault (NaN logits): said, never printed as an answer
        print(f"\npagedrs {args.command}: the request failed: {exc}", file=sys.stderr)
        return 1
    if out.error is not None:
        print(f"pagedrs {args.command}: the request failed: {out.error}", file=sys.stderr)
        return 2 if out.error_by_request else 1
    print(out.outputs[0].text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from pagedrs.chat_repl import run_chat

    return run_chat(_checked_engine_kwargs(args), max_tokens=args.max_tokens, temperature=args.temperature)


def _cmd_kv_size(args: argparse.Namespace) -> int:
    from pagedrs.kv_size import kv_size, tp_layout

    try:
        if args.draft_model is not None and args.tensor_parallel_size is not None:
            raise ValueError("--draft-model with --tensor-parallel-size: not supported (a draft model runs with "
                             "tensor_parallel_size=1); give one of them")
        result: dict[str, Any] = dict(kv_size(args.model, args.tokens, args.seqs, args.dtype, args.kv_cache_dtype,
                                              draft_model=args.draft_model))
        if args.tensor_parallel_size is not None:
            result["tensor_parallel"] = tp_layout(
                args.model, args.tokens, args.seqs, args.dtype, args.tensor_parallel_size, args.device_memory_gb,
                args.memory_utilization, args.block_size, args.max_model_len, args.kv_cache_dtype)
    except (ValueError, KeyError) as exc:
        print(f"pagedrs kv-size: error: {exc}", file=sys.stderr)
        return 2
    if args.tensor_parallel_size is not None and not args.json:
        t = result["tensor_parallel"]
        gb = 1e9
        print(f"{args.model} ({args.dtype}) on {t['tensor_parallel_size']} devices of {args.device_memory_gb:g} GB "
              f"(using {args.memory_utilization:.0%}): weights {t['weights_bytes_per_device'] / gb:.1f} GB per device, "
              f"KV {t['kv_bytes_per_token_per_device']:,} bytes/token per device, "
              f"{t['kv_budget_bytes_per_device'] / gb:.1f} GB of KV per device = {t['token_slots']:,} tokens; "
              f"{args.tokens}-token sequences admitted: paged {t['sequences_paged']}, "
              f"contiguous (max_model_len {args.max_model_len}) {t['sequences_contiguous']}; "
              f"{args.seqs} sequences want {t['kv_bytes_wanted'] / gb:.0f} GB of KV, the devices hold "
              f"{t['kv_bytes_available'] / gb:.0f} GB")
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        gb = 1e9
        kv = f", KV {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
        if args.draft_model is not None:
            kv += f", draft {args.draft_model} included: {result['draft_bytes_per_token']:,} bytes/token of it"
        print(f"{args.model} ({args.dtype}{kv}): {result['bytes_per_token']:,} bytes/token, "
              f"{result['bytes_per_sequence'] / gb:.2f} GB per {args.tokens}-token sequence, "
              f"{result['total_bytes'] / gb:.1f} GB for {args.seqs} sequences")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from pagedrs.demo import QUESTIONS, run_demo

    run_demo(max_tokens=args.max_tokens, num_questions=args.num_questions or len(QUESTIONS), cpu_threads=args.cpu_threads,
             tensor_parallel_size=args.tensor_parallel_size)
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    from pagedrs.models.gguf_cache import cache_root
    from pagedrs.models.gguf_cache_admin import MemoUnreadableError, entries, memo_problem, prune, report

    root = cache_root()
    if root.exists() and not root.is_dir():  # listed as "(empty)" before: a typo in $PAGEDRS_CACHE_DIR went unseen
        print(f"pagedrs cache: error: the cache folder {str(root)!r} ($PAGEDRS_CACHE_DIR) is not a directory",
              file=sys.stderr)
        return 2
    problem = memo_problem()
    if problem is not None:
        print(f"pagedrs cache: warning: {problem}: no folder's GGUF file is known", file=sys.stderr)
    if args.prune or args.drop_dense or args.orphans:
        try:
            pruned = prune(drop_dense=args.drop_dense, orphans=args.orphans)
        except MemoUnreadableError as e:
            print(f"pagedrs cache: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"pagedrs cache: {e}", file=sys.stderr)
            return 1
        for path in pruned.removed:
            print(f"removed {path}")
        print(f"freed {pruned.freed_bytes / 2**20:.1f} MiB; {pruned.memo_entries_dropped} hash-memo entries of files "
              "gone or changed dropped")
    print(report(entries()))
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
    k.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="pages in the model dtype (auto), in bfloat16 (2 bytes an element) or in 8 bits (fp8*: 1 byte)")
    k.add_argument("--draft-model", default=None,
                   help="a speculative draft (preset or config.json): every page holds its layers too")
    k.add_argument("--json", action="store_true")
    k.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="also print weights and KV per device and the sequences each layout admits")
    k.add_argument("--device-memory-gb", type=float, default=80.0, help="memory of one device (default: an 80 GB A100)")
    k.add_argument("--memory-utilization", type=float, default=0.9)
    k.add_argument("--block-size", type=int, default=16)
    k.add_argument("--max-model-len", type=int, default=8192, help="what the contiguous layout reserves per sequence")
    k.set_defaults(func=_cmd_kv_size)

    d = sub.add_parser("demo", help="the embedded model answers chats sharing a system prompt")
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--num-questions", type=int, default=None)
    _add_cpu_threads(d)
    d.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks of tensor parallelism")
    d.set_defaults(func=_cmd_demo)

    ca = sub.add_parser("cache", help="what the GGUF cache holds ($PAGEDRS_CACHE_DIR); --prune removes what this "
                                      "version never reads")
    ca.add_argument("--prune", action="store_true",
                    help="remove folders of older cache formats, stale staging folders and hash-memo entries of files "
                         "gone or changed")
    ca.add_argument("--drop-dense", action="store_true",
                    help="also remove the float32 copies (model.safetensors) dense loads wrote; the next one writes "
                         "its own again")
    ca.add_argument("--orphans", action="store_true",
                    help="also remove the folders of GGUF files no longer where they were (a load converts again)")
    ca.set_defaults(func=_cmd_cache)

    # bench and serve parse their own flags.
    sub.add_parser("bench", help="benchmarks (see `pagedrs bench --help`)", add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server", add_help=False)
    sub.add_parser("serve-ray", help="the server as data-parallel replicas on Ray Serve", add_help=False)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from pagedrs.bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "serve":
        from pagedrs.server import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "serve-ray":
        from pagedrs.ray.cli import main as serve_ray_main

        return serve_ray_main(argv[1:])
    args = build_parser().parse_args(argv)
    from pagedrs.kv_tiers.errors import DiskTierError

    try:
        return args.func(args)
    except DiskTierError as exc:  # a disk tier asked for and not given: a startup error, like a bad flag
        print(f"pagedrs {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
