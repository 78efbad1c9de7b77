"""`pagedrs chat`: an interactive terminal chat (readline history; Ctrl-C stops the answer)."""

from __future__ import annotations

import sys


def run_chat(engine_kwargs: dict, max_tokens: int = 256, temperature: float = 0.0) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    from pagedrs import LLM, SamplingParams

    try:  # what only the loaded model can check (max_model_len past its context): exit 2 naming it, no traceback
        llm = LLM(**engine_kwargs)
    except (ValueError, OSError) as exc:
        print(f"pagedrs chat: cannot start the engine: {exc}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    history: list[dict[str, str]] = []
    print("pagedrs chat — empty line or Ctrl-D to quit, Ctrl-C stops the current answer")
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            return 0
        history.append({"role": "user", "content": line})
        prompt = {"prompt_token_ids": llm.engine.tokenizer.apply_chat_template(history)}
        answer = []
        print("bot> ", end="", flush=True)
        stream = llm.stream(prompt, params)
        try:
            for delta in stream:
                answer.append(delta)
                print(delta, end="", flush=True)
        except KeyboardInterrupt:
            stream.close()  # aborts the request and frees its pages
            print(" [stopped]", end="")
        print(file=sys.stdout)
        history.append({"role": "assistant", "content": "".join(answer)})
