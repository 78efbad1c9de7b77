"""The model gaps a new user hits (issue 16): tokenizer-less folders, Llama 3 GGUF, sliding window."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from conftest import make_tiny_model

from pagedrs import LLM, SamplingParams
from pagedrs.tokenizer import TOKENIZER_FILES

ENGINE_KW = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks=256, max_num_batched_tokens=64)


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(folder: Path | str, prompts: list[list[int]], max_new_tokens: int, **load_kw) -> list[list[int]]:
    """transformers ``generate``, one prompt at a time, EOS disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32, **load_kw)
    model.eval().generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


# ---- a folder without tokenizer files ----------------------------------------------------


@pytest.fixture(scope="module")
def bare_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    """The tiny Llama with config + safetensors only."""
    folder = tmp_path_factory.mktemp("bare-llama")
    for f in tiny_llama_dir.iterdir():
        if f.name not in TOKENIZER_FILES and f.name != "special_tokens_map.json" and f.name != "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    assert not any((folder / n).exists() for n in TOKENIZER_FILES)
    return folder


def test_folder_without_tokenizer_names_the_option(bare_dir: Path) -> None:
    with pytest.raises(ValueError, match="has no tokenizer files.*skip_tokenizer_init=True"):
        LLM(model=str(bare_dir), **ENGINE_KW)


def test_skip_tokenizer_init_generates_the_same_token_ids(bare_dir: Path, tiny_llama_dir: Path) -> None:
    full = LLM(model=str(tiny_llama_dir), **ENGINE_KW)
    bare = LLM(model=str(bare_dir), skip_tokenizer_init=True, **ENGINE_KW)
    prompts = [{"prompt_token_ids": p} for p in _prompts(full.engine.loaded.config.vocab_size, [5, 11, 3])]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = full.generate(prompts, params, use_tqdm=False)
    got = bare.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) > 0 and o.outputs[0].text == "" for o in got)
    assert all(o.outputs[0].text != "" for o in want)  # the comparison's texts are not trivially empty
    # EOS comes from the config: a sample that hits it stops as with a tokenizer
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]


def test_skip_tokenizer_init_refuses_text_chat_and_stop_strings(bare_dir: Path) -> None:
    llm = LLM(model=str(bare_dir), skip_tokenizer_init=True, **ENGINE_KW)
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer.*skip_tokenizer_init"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="a chat conversation needs a tokenizer.*skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer.*stop_token_ids"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_server_without_tokenizer_takes_token_ids_and_refuses_text(bare_dir: Path) -> None:
    pytest.importorskip("fastapi")
    from server_fakes import live_server

    kw = dict(ENGINE_KW, skip_tokenizer_init=True)
    with live_server(bare_dir, kw, "bare") as live:
        base = live.url.rstrip("/") + "/v1"
        ok = httpx.post(f"{base}/completions", json={"model": "bare", "prompt": [5, 6, 7], "max_tokens": 4,
                                                     "temperature": 0.0}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == ""
        assert ok.json()["usage"]["completion_tokens"] == 4
        text = httpx.post(f"{base}/completions", json={"model": "bare", "prompt": "hello", "max_tokens": 4}, timeout=60)
        assert text.status_code == 400, text.text
        assert "skip_tokenizer_init" in text.json()["error"]["message"]
        chat = httpx.post(f"{base}/chat/completions", json={"model": "bare", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert chat.status_code == 400, chat.text
        assert "skip_tokenizer_init" in chat.json()["error"]["message"]
