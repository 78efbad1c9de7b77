"""Quality of the weight-only formats on the embedded SmolLM2, against its float32 (transformers-exact) path.

Two measures, both deterministic:

- greedy agreement: the float32 model writes 32 greedy tokens after each prompt; the
  quantized model reads the same text (teacher forcing) and we count the positions where
  its own greedy choice is the float32 one (free-running generations part for good after
  one different token, which would measure one near-tie, not the format); the first miss
  per prompt is printed with -s;
- perplexity of five fixed English paragraphs (553 tokens: a story, science, instructions, a
  dialogue, history), relative to float32.

Bounds (issue 12): int8 agreement >= 90% and perplexity within 2%; int4 perplexity within
10%, and (our own guard, measured 97.4% on the 24 prompts) agreement >= 95%. Both formats quantize the output
head to int8 (an int4 head measured 88% agreement). The embedded GGUF is Q4_1: its float32 weights
already sit on a 4-bit grid, which int4 (group 32) re-quantizes almost exactly.

gguf (the file's own Q4_1 / Q8_0 blocks through the Rust GEMV, activations int8 per block of 32, the
layers in one Rust call: models/cpu_decode.py) is noisier than the weight-only formats, and the noise
is the format's own: rounding each activation to 1/127 of its block's maximum makes two runs that
differ by one ulp anywhere (one op computed another way, or the embedding table times (1 + 2^-23))
differ by 2-5% in their logits. So one run is one draw. Over six draws (the embedding times
1 + k ulp, k = 0, +-1, +-2, 3; measured 2026-12-04): gguf agreement 96.2-97.1% (mean 96.6%) and
perplexity +0.00% .. +0.58% (mean +0.30%); int4 96.9-97.5% (mean 97.3%) and +0.24% .. +0.40% (mean
+0.33%): on the means, within the issue's one point and 0.3% (issue 30). The single paragraph used
before moved 0.55% between draws, hence the five. The gguf bounds sit below every draw with room for
another: agreement 95.5% (the lowest draw 96.2%), perplexity int4's worst +0.40% plus 0.3% plus the
0.6% spread (1.012) — enough to catch a wrong kernel (a real error costs whole points of agreement and
whole percents of perplexity), not the rounding of an op.

q8_0 / q4_1 (``models/block_quant.py``: the float32 weights quantized at load into those blocks, the
head Q8_0, then the same kernel as gguf): q4_1 re-quantizes the Q4_1-valued weights into the file's own
blocks, so it measures what gguf measures, to the bit (96.2% / +0.58% on 2026-12-06); q8_0 97.1% /
+0.66%. (q4_0 is not bounded here: symmetric 4-bit blocks of weights already on Q4_1's asymmetric grid
round twice, 73.7% / +16% on this file; a float checkpoint does not pay that.)
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
TEXTS = [
    # narrative
    "The library opened early on Saturday mornings, and the old librarian liked to arrive before anyone else. "
    "She would unlock the heavy front door, switch on the lamps one by one, and walk slowly between the shelves, "
    "straightening books that had been pushed too far back. Most visitors came for the newspapers or to use the "
    "computers, but a few children always headed straight for the corner with the picture books. Over the years "
    "she had learned which stories they loved most, and she kept those close to the low table by the window, "
    "where the light was best in the afternoon.",
    # science
    "When sunlight reaches a leaf, most of it is absorbed by chlorophyll, the green pigment inside the chloroplasts. "
    "The energy of that light is used to split water molecules, releasing oxygen into the air and producing the "
    "chemical energy the plant needs to turn carbon dioxide into sugar. This process, called photosynthesis, is the "
    "reason almost every food chain on Earth begins with a plant. It also explains why forests and oceans matter so "
    "much for the climate: together they take up a large share of the carbon dioxide that people release by burning "
    "coal, oil and gas.",
    # instructions
    "Before you plant tomatoes, choose a spot that gets at least six hours of direct sun each day. Dig the soil to a "
    "depth of about thirty centimetres and mix in a few handfuls of compost. Set each seedling deeper than it grew in "
    "its pot, because new roots will form along the buried stem. Water the plants at the base in the morning rather "
    "than over the leaves, and add a stake or a cage early, while the plants are still small. Once the first fruits "
    "appear, feed them every two weeks and pick them as soon as they are fully coloured.",
    # dialogue
    "\"Are you sure this is the right train?\" asked Maria, looking at the board again. \"It says the next one to the "
    "airport leaves from platform four.\" Her brother shrugged and pointed at the screen above the doors. \"That one "
    "says airport too, and it leaves in two minutes. If we wait for the other one, we might miss the flight.\" Maria "
    "sighed, picked up her bag and followed him inside. The doors closed behind them, and for a moment neither of "
    "them said a word, until the announcement confirmed that the next stop was the central station.",
    # history
    "The first public railway to carry passengers with steam locomotives opened in England in 1825. Within a few "
    "decades, railways had spread across Europe and North America, cutting journeys that once took days to a matter "
    "of hours. Towns grew up around new stations, farmers could send fresh produce to distant markets, and the need "
    "for a shared time along the lines led to the adoption of standard time zones. Historians often describe the "
    "railway as the invention that did the most to change how ordinary people thought about distance.",
]


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


def greedy_agreement(loaded, prompts: list[list[int]], continuations: list[list[int]]) -> tuple[int, int, list[int]]:
    """(positions where ``loaded``'s greedy pick is the reference's, positions, the first miss per prompt):
    ``loaded`` reads each prompt and its reference continuation (teacher forcing)."""
    agree = total = 0
    first_miss = []
    for prompt, cont in zip(prompts, continuations, strict=True):
        logits = _all_logits(loaded, prompt + cont)
        choices = logits[len(prompt) - 1 : -1].argmax(-1).tolist()  # its greedy pick at each position
        same = [a == b for a, b in zip(choices, cont, strict=True)]
        agree += sum(same)
        total += len(same)
        first_miss.append(same.index(False) if False in same else len(same))
    return agree, total, first_miss


def _perplexity(loaded, texts: list[str]) -> float:
    """exp of the mean next-token NLL over every token of every text (each text one sequence)."""
    nll, count = 0.0, 0
    for text in texts:
        token_ids = loaded.tokenizer.encode(text)
        logits = _all_logits(loaded, token_ids)[:-1]
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:]), reduction="sum"))
        count += len(token_ids) - 1
    return float(torch.exp(torch.tensor(nll / count)))


@pytest.fixture(scope="module")
def reference(smollm2):
    """(prompts, float32 continuations, float32 perplexity of TEXTS)."""
    tok = smollm2.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    runner = ModelRunner(smollm2, num_gpu_blocks=4 * len(prompts), num_cpu_blocks=0, block_size=16)
    continuations = greedy_generate(runner, prompts, NEW_TOKENS)
    return prompts, continuations, _perplexity(smollm2, TEXTS)


@pytest.mark.parametrize(("weight_dtype", "min_agreement", "max_ppl_ratio"), [("int8", 0.90, 1.02),
                                                                              ("int4", 0.95, 1.10),
                                                                              ("gguf", 0.955, 1.012),
                                                                              ("q8_0", 0.96, 1.01),
                                                                              ("q4_1", 0.95, 1.012)])
def test_quantized_formats_stay_close_to_float32(smollm2, reference, weight_dtype, min_agreement, max_ppl_ratio):
    prompts, continuations, ppl_fp32 = reference
    quantized = load_model("smollm2-135m", weight_dtype=weight_dtype)
    assert quantized.weight_format.name == weight_dtype
    # the output head is int8 in both aten formats (a packed copy of the tied table), the file's Q8_0 in
    # gguf; the lookup stays exact
    head = {"gguf": "gguf", "q8_0": "q8_0", "q4_1": "q8_0"}.get(weight_dtype, "int8")
    assert quantized.model.lm_head.method.name == head
    table = quantized.model.model.embed_tokens  # exact: the file's blocks in gguf (test_embedding.py), else float32
    assert table.qtype == "Q8_0" if weight_dtype == "gguf" else table.weight.dtype == torch.float32
    agree, total, first_miss = greedy_agreement(quantized, prompts, continuations)
    ppl = _perplexity(quantized, TEXTS)
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
