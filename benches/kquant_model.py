"""Writes a random llama in llama.cpp's Q4_K_M mix, sized like SmolLM2 but with K-quant widths, to time it.

    python benches/kquant_model.py OUT.gguf [--geometry smollm2|llama3-8b] [--layers N]
    pagedrs bench decode --quick --model OUT.gguf --weight-dtype float32,gguf --threads 1

``--geometry llama3-8b``: Llama 3 8B's layer widths (hidden 4096, MLP 14336, 32 heads of 128, 8 KV
heads; default 2 layers, SmolLM2's vocabulary and tokenizer so the tied Q6_K head is 49152 x 4096):
what loading and decoding matrices of a real 8B's size cost, on a machine without an 8B file.

SmolLM2's widths (576) are not multiples of 256, so no K-quant SmolLM2 exists; this model has 30
layers of hidden 512, intermediate 1536, 8 heads of 64 (4 KV heads) and SmolLM2's tokenizer and
vocabulary (the tied embedding and head in Q6_K, as Q4_K_M stores its head), random weights (std 0.02): what
decode streams is what a Q4_K_M file of that shape streams (Q4_K and Q6_K as they are, the mixed q/k/v as
Q8_0, ``models/gguf_convert.py``), so its tokens/s say what the kernel delivers on such a file.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


GEOMETRIES = {
    "smollm2": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, rope_theta=100000.0),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, rope_theta=500000.0),
}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="smollm2")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the geometry's)")
    args = parser.parse_args()
    import torch
    import transformers

    from gguf_writer import Q4_K_M_QTYPES, write_gguf
    from pagedrs.models.gguf_cache import convert_gguf_cached
    from pagedrs.models.loader import embedded_model_path

    tokenizer_folder = convert_gguf_cached(embedded_model_path())  # SmolLM2's tokenizer.json
    geometry = dict(GEOMETRIES[args.geometry])
    if args.layers is not None:
        geometry["num_hidden_layers"] = args.layers
    config = transformers.LlamaConfig(
        vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
        initializer_range=0.02, bos_token_id=0, eos_token_id=2, **geometry)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    out = args.out
    import gguf

    # the tied embedding and head in Q6_K, as llama.cpp's Q4_K_M stores an output head
    write_gguf(model, tokenizer_folder, out, qtypes={**Q4_K_M_QTYPES, "token_embd": gguf.GGMLQuantizationType.Q6_K})
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
