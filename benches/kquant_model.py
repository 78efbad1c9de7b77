"""Writes a random llama in llama.cpp's Q4_K_M mix, sized like SmolLM2 but with K-quant widths, to time it.

    python benches/kquant_model.py OUT.gguf [--geometry smollm2|llama3-8b|smollm2-576] [--layers N] [--mix q4_k_m|q5_k_m]
    pagedrs bench decode --quick --model OUT.gguf --weight-dtype float32,gguf --threads 1

``--geometry llama3-8b``: Llama 3 8B's layer widths (hidden 4096, MLP 14336, 32 heads of 128, 8 KV
heads; default 2 layers, SmolLM2's vocabulary and tokenizer so the tied Q6_K head is 49152 x 4096):
what loading and decoding matrices of a real 8B's size cost, on a machine without an 8B file.

``--mix q5_k_m``: llama.cpp's Q5_K_M (Q5_K where Q4_K_M has Q4_K); ``--mix iq4_xs``: every layer product
IQ4_XS (the head Q6_K, as llama.cpp's IQ4_XS files store it); ``--mix q3_k_m``: llama.cpp's Q3_K_M (Q3_K
q / k / gate / up, Q5_K values, Q4_K output and down projections). ``--geometry smollm2-576``: SmolLM2's
own widths (hidden 576, MLP 1536), which are not whole super-blocks, so llama.cpp's "Q4_K_M" of it
writes its fallbacks: Q5_0 for the 576-wide products, Q8_0 values, Q6_K down projections (and the mix
flag is ignored).

SmolLM2's widths (576) are not multiples of 256, so no K-quant SmolLM2 exists; this model has 30
layers of hidden 512, intermediate 1536, 8 heads of 64 (4 KV heads) and SmolLM2's tokenizer and
vocabulary (the tied embedding and head in Q6_K, as Q4_K_M stores its head), random weights (std 0.02): what
decode streams is what a Q4_K_M file of that shape streams (every tensor as the file stores it; the mixed
q/k/v as one product of parts in their own types), so its tokens/s say what the kernel delivers on such a file.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


GEOMETRIES = {
    "smollm2": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, rope_theta=100000.0),
    "smollm2-576": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3, head_dim=64, rope_theta=100000.0),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, rope_theta=500000.0),
}


def gguf_types():  # noqa: ANN201  (gguf is imported late: the tests folder is on the path first)
    import gguf

    return gguf.GGMLQuantizationType


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="smollm2")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the geometry's)")
    parser.add_argument("--mix", choices=("q4_k_m", "q5_k_m", "iq4_xs", "q3_k_m"), default="q4_k_m", help="llama.cpp's type mix")
    args = parser.parse_args()
    import torch
    import transformers

    from gguf_writer import Q3_K_M_QTYPES, Q4_K_M_FALLBACK_QTYPES, Q4_K_M_QTYPES, Q5_K_M_QTYPES, write_gguf

    iq4_xs = dict.fromkeys(Q4_K_M_QTYPES, gguf_types().IQ4_XS)  # llama.cpp's IQ4_XS: every layer product
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

    mix = {"q4_k_m": Q4_K_M_QTYPES, "q5_k_m": Q5_K_M_QTYPES, "iq4_xs": iq4_xs, "q3_k_m": Q3_K_M_QTYPES}[args.mix]
    if geometry["hidden_size"] % 256:
        mix = Q4_K_M_FALLBACK_QTYPES
    # the tied embedding and head in Q6_K, as llama.cpp's K-quant mixes store an output head (Q8_0 where the
    # rows are not whole super-blocks)
    head = gguf.GGMLQuantizationType.Q8_0 if geometry["hidden_size"] % 256 else gguf.GGMLQuantizationType.Q6_K
    write_gguf(model, tokenizer_folder, out, qtypes={**mix, "token_embd": head})
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
