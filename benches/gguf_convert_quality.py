"""What a GGUF type costs in quality on the kernel, read as it is or converted at load (models/gguf_convert.py).

    python benches/gguf_convert_quality.py [--types Q5_1,Q5_0]

For each type: the embedded SmolLM2's weights (its Q4_1 file, dequantized) written again as a GGUF of
that type (every layer product; the embedding stays F32, so the head runs dense in these copies),
then ``weight_dtype="gguf"`` (the blocks as the kernel runs them: Q5_0 and Q5_1 as they are since 2026-12-07,
requantized to Q8_0 before; a type the kernel does not read, requantized; int8 activations) against the same
file's dequantized float32 weights: greedy agreement over tests/test_quant.py's 24 prompts x 32
positions and perplexity over its 5 texts. Beside it, in the same run, the embedded Q4_1 file as it is
(its blocks read natively): the cost of the kernel's int8 activations alone. SmolLM2's widths (576) are
not multiples of 256, so no K-quant copy of it exists; Q4_K's conversion is checked block by block in
tests/test_gguf_convert.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def measure(path: Path | str, label: str) -> str:
    from paged_driver import greedy_generate
    from pagedrs.model_runner import ModelRunner
    from pagedrs.models import load_model
    from test_quant import NEW_TOKENS, PROMPTS, TEXTS, _perplexity, greedy_agreement

    dense = load_model(path, weight_dtype="float32")
    prompts = [dense.tokenizer.encode(p) for p in PROMPTS]
    runner = ModelRunner(dense, num_gpu_blocks=4 * len(prompts), num_cpu_blocks=0, block_size=16)
    continuations = greedy_generate(runner, prompts, NEW_TOKENS)
    ppl_dense = _perplexity(dense, TEXTS)
    kernel = load_model(path, weight_dtype="gguf")
    formats = sorted({m.gguf_matrix.format for m in kernel.model.modules() if getattr(m, "gguf_matrix", None) is not None})
    agree, total, _ = greedy_agreement(kernel, prompts, continuations)
    ppl = _perplexity(kernel, TEXTS)
    return (f"| {label} | {', '.join(formats)} | {agree}/{total} = {agree / total:.1%} | {ppl:.3f} vs {ppl_dense:.3f} "
            f"({ppl / ppl_dense - 1:+.2%}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q5_1,Q5_0")
    args = parser.parse_args()
    import gguf
    import transformers

    from gguf_writer import write_gguf
    from pagedrs.bench.machine import describe_machine
    from pagedrs.models.gguf_cache import convert_gguf_cached
    from pagedrs.models.gguf_convert import kernel_type
    from pagedrs.models.loader import embedded_model_path

    embedded = embedded_model_path()
    folder = convert_gguf_cached(embedded, dense_weights=True)  # transformers reads its float32 weights
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    rows = ["| file | kernel formats | greedy agreement with its float32 weights | perplexity |", "|---|---|---|---|",
            measure(embedded, "embedded Q4_1 (native)")]
    print(rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.types.split(","):
            qtype = gguf.GGMLQuantizationType[name]
            kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
            out = Path(tmp) / f"smollm2-{name}.gguf"
            write_gguf(model, folder, out, qtypes=dict.fromkeys(kinds, qtype))
            how = "native" if kernel_type(name) == name else f"as {kernel_type(name)}"
            rows.append(measure(out, f"SmolLM2 as {name} ({how})"))
            print(rows[-1], flush=True)
    print("\n".join(rows))
    print(f"Machine: {describe_machine()}")


if __name__ == "__main__":
    main()
