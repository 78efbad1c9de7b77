"""`pagedrs chat`: an interactive terminal chat (readline history; Ctrl-C stops the answer).

A conversation outlives any one turn's trouble: a history grown past ``max_model_len`` loses its
oldest turns (said once each time), a message too long on its own or a turn the engine refuses
is said and left out, and the session goes on. Before, each of these ended the session with a
traceback and the conversation was lost.
"""

from __future__ import annotations

import sys
from typing import Any


def run_chat(engine_kwargs: dict, max_tokens: int = 256, temperature: float = 0.0) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    from pagedrs import LLM, SamplingParams

    try:  # before the model loads: a bad value exits 2 naming it, as the engine flags do
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    except ValueError as exc:
        print(f"pagedrs chat: error: {exc}", file=sys.stderr)
        return 2
    try:  # what only the loaded model can check (max_model_len past its context): exit 2 naming it, no traceback
        llm = LLM(**engine_kwargs)
    except (ValueError, OSError) as exc:
        print(f"pagedrs chat: cannot start the engine: {exc}", file=sys.stderr)
        return 2
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
        try:
            prompt = fitted_prompt(llm, history)
        except ValueError as exc:  # a line that is not valid text (an undecodable byte from the terminal)
            print(f"[your message was refused: {exc}]")
            prompt = None
        if prompt is None:
            history.pop()
            continue
        answer = _answer(llm, prompt, params)
        if answer is None:  # refused or failed: the turn is left out of the history
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})


def fitted_prompt(llm: Any, history: list[dict[str, str]]) -> dict[str, list[int]] | None:
    """The chat template's ids of ``history``, its oldest turns dropped (in place) until the prompt leaves
    room for one new token within ``max_model_len``; None (said) when the newest message alone does not."""
    limit = llm.engine.max_model_len - 1
    dropped = 0
    while True:
        ids = llm.engine.tokenizer.apply_chat_template(history)
        if len(ids) <= limit:
            break
        if len(history) == 1:
            print(f"[your message is {len(ids)} tokens with the chat template; max_model_len is "
                  f"{llm.engine.max_model_len}: send a shorter one]")
            return None
        del history[:2]  # the oldest user turn and the answer to it
        dropped += 1
    if dropped:
        print(f"[the conversation outgrew max_model_len {llm.engine.max_model_len}: the oldest {dropped} "
              f"turn(s) were dropped]")
    return {"prompt_token_ids": list(ids)}


def _answer(llm: Any, prompt: dict[str, list[int]], params: Any) -> str | None:
    """Streams one answer; its text, or None when the engine refused or ended the turn (said)."""
    answer: list[str] = []
    print("bot> ", end="", flush=True)
    stream = llm.stream(prompt, params)
    try:
        for delta in stream:
            answer.append(delta)
            print(delta, end="", flush=True)
    except KeyboardInterrupt:
        stream.close()  # aborts the request and frees its pages
        print(" [stopped]", end="")
    except (ValueError, RuntimeError) as exc:  # this turn only: the session goes on
        print(f"\n[this turn failed: {exc}]")
        return None
    print(file=sys.stdout)
    return "".join(answer)
