"""Writes a random llama in llama.cpp's Q4_K_M mix, sized like SmolLM2 but with K-quant widths, to time it.

    python benches/kquant_model.py OUT.gguf
    pagedrs bench decode --quick --model OUT.gguf --weight-dtype float32,gguf --threads 1

SmolLM2's widths (576) are not multiples of 256, so no K-quant SmolLM2 exists; this model has 30
layers of hidden 512, intermediate 1536, 8 heads of 64 (4 KV heads) and SmolLM2's tokenizer and
vocabulary (the tied embedding and head in Q6_K, as Q4_K_M stores its head), random weights (std 0.02): what
decode streams is what a Q4_K_M file of that shape streams (Q4_K as Q4_1 blocks, Q6_K and the mixed
q/k/v as Q8_0, ``models/gguf_convert.py``), so its tokens/s say what the conversion delivers.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    import torch
    import transformers

    from gguf_writer import Q4_K_M_QTYPES, write_gguf
    from pagedrs.models.gguf_loader import convert_gguf_cached
    from pagedrs.models.loader import embedded_model_path

    tokenizer_folder = convert_gguf_cached(embedded_model_path())  # SmolLM2's tokenizer.json
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, initializer_range=0.02, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    out = Path(sys.argv[1])
    import gguf

    # the tied embedding and head in Q6_K, as llama.cpp's Q4_K_M stores an output head
    write_gguf(model, tokenizer_folder, out, qtypes={**Q4_K_M_QTYPES, "token_embd": gguf.GGMLQuantizationType.Q6_K})
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
