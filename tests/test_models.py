"""The pagedrs model against transformers on the same weights: logits, greedy tokens, layout independence."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from paged_driver import BlockPool, PagedSeq, build_step, greedy_generate
from pagedrs.model_runner import ModelRunner
from pagedrs.models import load_model


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _hf_model(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32, **kwargs)
    return model.eval()


def _hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers ``generate`` one prompt at a time (no padding to blur the comparison), EOS disabled."""
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
        outs.append(out[0, len(p) :].tolist())
    return outs


def test_logits_match_transformers(tiny_model_dir):
    """Every position of a 3-sequence prefill, then a batched decode step: max |diff| <= 1e-4."""
    loaded = load_model(tiny_model_dir)
    hf = _hf_model(tiny_model_dir)
    runner = ModelRunner(loaded, num_gpu_blocks=16, num_cpu_blocks=0, block_size=4)
    prompts = _prompts(loaded.config.vocab_size, [5, 9, 13])
    pool = BlockPool(16, seed=1)
    seqs = [PagedSeq(list(p)) for p in prompts]
    step = build_step(seqs, [len(p) for p in prompts], 4, pool)
    with torch.inference_mode():
        meta = runner.build_metadata(step)
        hidden = loaded.model(
            torch.from_numpy(step.input_ids), torch.from_numpy(step.positions), runner.kv_cache, meta, runner.backend
        )
        ours = loaded.model.compute_logits(hidden)
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0].float()
            got = ours[step.query_start_loc[i] : step.query_start_loc[i + 1]]
            assert (got - ref).abs().max().item() <= 1e-4
    # decode: one more token per sequence through the batched decode path
    for s in seqs:
        s.num_computed = len(s.token_ids)
        s.token_ids.append(7)
    step = build_step(seqs, [1, 1, 1], 4, pool)
    got = runner.execute(step)
    with torch.inference_mode():
        for i, s in enumerate(seqs):
            ref = hf(torch.tensor([s.token_ids])).logits[0, -1].float()
            assert (got[i] - ref).abs().max().item() <= 1e-4


def test_greedy_matches_transformers_generate(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    prompts = _prompts(loaded.config.vocab_size, [3, 7, 12], seed=2)
    expected = _hf_greedy(_hf_model(tiny_model_dir), prompts, 8)
    runner = ModelRunner(loaded, num_gpu_blocks=32, num_cpu_blocks=0, block_size=4)
    assert greedy_generate(runner, prompts, 8) == expected


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("shuffle", [None, 7])
def test_layout_independence(tiny_llama_dir, block_size, shuffle):
    """Same tokens whatever the block size and whichever physical blocks hold the sequences."""
    loaded = load_model(tiny_llama_dir)
    prompts = _prompts(loaded.config.vocab_size, [3, 17, 40], seed=3)
    expected = _reference_tokens(tiny_llama_dir, prompts)
    runner = ModelRunner(loaded, num_gpu_blocks=200 // block_size + 8, num_cpu_blocks=0, block_size=block_size)
    assert greedy_generate(runner, prompts, 6, shuffle_seed=shuffle) == expected


@pytest.mark.parametrize("chunk_size", [1, 5, 16])
def test_chunked_prefill_matches_whole_prefill(tiny_llama_dir, chunk_size):
    """Prompts split over several steps, mixed with other sequences' decode tokens, give the same tokens."""
    loaded = load_model(tiny_llama_dir)
    prompts = _prompts(loaded.config.vocab_size, [3, 17, 40], seed=3)
    runner = ModelRunner(loaded, num_gpu_blocks=64, num_cpu_blocks=0, block_size=4)
    got = greedy_generate(runner, prompts, 6, chunk_size=chunk_size, shuffle_seed=11)
    assert got == _reference_tokens(tiny_llama_dir, prompts)


_REFERENCE: dict[tuple, list[list[int]]] = {}


def _reference_tokens(folder, prompts: list[list[int]]) -> list[list[int]]:
    key = (str(folder), tuple(map(tuple, prompts)))
    if key not in _REFERENCE:
        _REFERENCE[key] = _hf_greedy(_hf_model(folder), prompts, 6)
    return _REFERENCE[key]


def test_embedded_smollm2_greedy_matches_transformers_gguf(smollm2, hf_smollm2):
    """SmolLM2-135M from its Q4_1 GGUF: our dequantize + Q/K unpermute against transformers' own GGUF reader."""
    hf = hf_smollm2
    tok = smollm2.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea, there"]
    prompts = [tok.encode(t) for t in texts]
    expected = _hf_greedy(hf, prompts, 8)
    runner = ModelRunner(smollm2, num_gpu_blocks=64, num_cpu_blocks=0, block_size=16)
    assert greedy_generate(runner, prompts, 8, shuffle_seed=5) == expected
    assert tok.decode(expected[0]).strip().startswith("Paris")


def test_dtype_bfloat16_runs_and_stays_close(tiny_llama_dir):
    loaded32 = load_model(tiny_llama_dir)
    loaded16 = load_model(tiny_llama_dir, dtype="bfloat16")
    assert loaded16.dtype == torch.bfloat16
    step = build_step([PagedSeq(list(range(3, 12)))], [9], 4, BlockPool(8))
    r32 = ModelRunner(loaded32, num_gpu_blocks=8, num_cpu_blocks=0, block_size=4)
    r16 = ModelRunner(loaded16, num_gpu_blocks=8, num_cpu_blocks=0, block_size=4)
    assert r16.kv_cache.dtype == torch.bfloat16
    a, b = r32.execute(step), r16.execute(step)
    assert b.dtype == torch.float32
    assert np.corrcoef(a[0].numpy(), b[0].numpy())[0, 1] > 0.99


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "int8", "int4"])
def test_weight_formats_load_every_architecture_and_stay_close(tiny_model_dir, tmp_path, weight_dtype):
    """Tied and untied heads, q/k/v biases, GQA and MQA all land through the fused loaders in every format.

    The tiny models' random weights are far from a 4-bit grid, so for int4 both sides read the same
    checkpoint snapped to the int4 grid first: what remains is the kernels' bf16 arithmetic and the
    int8 LM head, and a wrong group, scale or shard would still show."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedrs.models.quant import INT4_GROUP_SIZE, cpu_has_fast_bf16, quantize_int4

    folder = tiny_model_dir
    if weight_dtype == "int4":
        folder = tmp_path / "snapped"
        shutil.copytree(tiny_model_dir, folder)
        state = load_file(str(folder / "model.safetensors"))
        for name, w in state.items():
            if "_proj.weight" in name:
                q, scale, minimum = quantize_int4(w.float(), INT4_GROUP_SIZE)
                groups = q.view(w.shape[0], -1, INT4_GROUP_SIZE) * scale[..., None] + minimum[..., None]
                state[name] = groups.view(w.shape).to(w.dtype)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    exact = load_model(folder, weight_dtype="float32")
    assert load_model(folder).weight_format.name == "float32"  # auto on an HF folder: the exact path
    other = load_model(folder, weight_dtype=weight_dtype)
    expected = "float32" if weight_dtype == "bfloat16" and not cpu_has_fast_bf16() else weight_dtype
    assert other.weight_format.name == expected and other.dtype == torch.float32
    step = build_step([PagedSeq(list(range(3, 40)))], [37], 4, BlockPool(16))
    a = ModelRunner(exact, num_gpu_blocks=16, num_cpu_blocks=0, block_size=4).execute(step)[0]
    b = ModelRunner(other, num_gpu_blocks=16, num_cpu_blocks=0, block_size=4).execute(step)[0]
    assert np.corrcoef(a.numpy(), b.numpy())[0, 1] > 0.99
