"""Quality of the weight-only formats on the embedded SmolLM2, against its float32 (transformers-exact) path.

Two measures, both deterministic:

- greedy agreement: the float32 model writes 32 greedy tokens after each prompt; the
  quantized model reads the same text (teacher forcing) and we count the positions where
  its own greedy choice is the float32 one (free-running generations part for good after
  one different token, which would measure one near-tie, not the format); the first miss
  per prompt is printed with -s;
- perplexity of a fixed English paragraph, relative to float32.

Bounds (issue 12): int8 agreement >= 90% and perplexity within 2%; int4 perplexity within
10%, and (our own guard, measured 97.4% on the 24 prompts) agreement >= 95%. Both formats quantize the output
head to int8 (an int4 head measured 88% agreement). The embedded GGUF is Q4_1: its float32 weights
already sit on a 4-bit grid, which int4 (group 32) re-quantizes almost exactly.

gguf (the file's own Q4_1 / Q8_0 blocks through the Rust GEMV, activations int8 per block of 32, the
layers in one Rust call: models/cpu_decode.py), on the 24 prompts below (768 positions): 747 = 97.3%
agreement and perplexity -0.07%, against int4's 748 = 97.4% and +0.27% (issue 30: within one point
and 0.3%). On the first 6 prompts alone (192 positions) it was 187 vs 190: the set was too small to
tell the formats apart, so it grew. The bound here guards 96% (a point under int4's measure).
"""

from __future__ import annotations

import pytest
import torch

from paged_driver import BlockPool, PagedSeq, build_step, greedy_generate
from pagedrs.model_runner import ModelRunner
from pagedrs.models import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there",
    "The three laws of thermodynamics state that",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The best way to learn a new language is",
    "import numpy as np\n\ndef mean(xs):",
    "Dear hiring manager, I am writing to apply for",
    "The French Revolution began in 1789 because",
    "Water boils at 100 degrees Celsius, but at high altitude",
    "Here is a recipe for banana bread. Ingredients:",
    "The mitochondria is often called the powerhouse of the cell because",
    "In the year 2050, cities will",
    "SELECT name, age FROM users WHERE",
    "The main difference between a virus and a bacterium is",
    "My favourite book is about a young wizard who",
    "To solve the equation 2x + 3 = 11, we first",
    "The stock market fell sharply today after",
    "A haiku about autumn leaves:",
    "The Pythagorean theorem states that",
    "When I was a child, my grandmother used to",
    "The rules of chess say that a knight moves",
    "Climate change affects the oceans by",
]
NEW_TOKENS = 32
TEXT = (
    "The library opened early on Saturday mornings, and the old librarian liked to arrive before anyone else. "
    "She would unlock the heavy front door, switch on the lamps one by one, and walk slowly between the shelves, "
    "straightening books that had been pushed too far back. Most visitors came for the newspapers or to use the "
    "computers, but a few children always headed straight for the corner with the picture books. Over the years "
    "she had learned which stories they loved most, and she kept those close to the low table by the window, "
    "where the light was best in the afternoon."
)


def _all_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [T, vocab] at every position of one sequence, in one prefill step."""
    block_size = 16
    blocks = -(-len(token_ids) // block_size) + 1
    runner = ModelRunner(loaded, num_gpu_blocks=blocks, num_cpu_blocks=0, block_size=block_size)
    step = build_step([PagedSeq(list(token_ids))], [len(token_ids)], block_size, BlockPool(blocks))
    with torch.inference_mode():
        meta = runner.build_metadata(step)
        hidden = loaded.model(torch.from_numpy(step.input_ids), torch.from_numpy(step.positions),
                              runner.kv_cache, meta, runner.backend)
        return loaded.model.compute_logits(hidden)


def _perplexity(loaded, token_ids: list[int]) -> float:
    logits = _all_logits(loaded, token_ids)[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:]))
    return float(torch.exp(nll))


@pytest.fixture(scope="module")
def reference(smollm2):
    """(prompts, float32 continuations, float32 perplexity of TEXT)."""
    tok = smollm2.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    runner = ModelRunner(smollm2, num_gpu_blocks=4 * len(prompts), num_cpu_blocks=0, block_size=16)
    continuations = greedy_generate(runner, prompts, NEW_TOKENS)
    return prompts, continuations, _perplexity(smollm2, tok.encode(TEXT))


@pytest.mark.parametrize(("weight_dtype", "min_agreement", "max_ppl_ratio"), [("int8", 0.90, 1.02),
                                                                              ("int4", 0.95, 1.10),
                                                                              ("gguf", 0.96, 1.0057)])
def test_quantized_formats_stay_close_to_float32(smollm2, reference, weight_dtype, min_agreement, max_ppl_ratio):
    prompts, continuations, ppl_fp32 = reference
    quantized = load_model("smollm2-135m", weight_dtype=weight_dtype)
    assert quantized.weight_format.name == weight_dtype
    # the output head is int8 in both aten formats (a packed copy of the tied table), the file's Q8_0 in
    # gguf; the lookup stays exact
    assert quantized.model.lm_head.method.name == ("gguf" if weight_dtype == "gguf" else "int8")
    assert quantized.model.model.embed_tokens.weight.dtype == torch.float32
    agree = total = 0
    first_miss = []
    for prompt, cont in zip(prompts, continuations, strict=True):
        logits = _all_logits(quantized, prompt + cont)
        choices = logits[len(prompt) - 1 : -1].argmax(-1).tolist()  # its greedy pick at each of the 32 positions
        same = [a == b for a, b in zip(choices, cont, strict=True)]
        agree += sum(same)
        total += len(same)
        first_miss.append(same.index(False) if False in same else len(same))
    ppl = _perplexity(quantized, quantized.tokenizer.encode(TEXT))
    print(f"\n{weight_dtype}: greedy agreement {agree}/{total} = {agree / total:.1%}, first miss per prompt "
          f"{first_miss}, perplexity {ppl:.3f} vs float32 {ppl_fp32:.3f} ({ppl / ppl_fp32 - 1:+.2%})")
    assert agree / total >= min_agreement
    assert ppl / ppl_fp32 <= max_ppl_ratio


def test_auto_on_the_q4_1_gguf_is_its_own_blocks_where_the_kernel_runs(smollm2):
    """models/quant.py: gguf's quality matches int4's here, and it decodes faster."""
    from pagedrs.models.gguf_linear import cpu_runs_gguf_kernel
    from pagedrs.models.quant import cpu_has_fast_bf16

    auto = load_model("smollm2-135m")
    assert auto.weight_format.name == ("gguf" if cpu_runs_gguf_kernel() else "int4" if cpu_has_fast_bf16()
                                       else "float32")
    assert (auto.model.fused_cpu_decode is not None) == cpu_runs_gguf_kernel()
    assert smollm2.weight_format.name == "float32"
    assert auto.dtype == torch.float32  # activations (and the KV cache) stay float32 whatever the weights
