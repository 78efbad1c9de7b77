"""Write a tiny Hugging Face llama-family model as a GGUF file, the way llama.cpp's converter does
(Q/K rows permuted, tensors quantized), so loader tests have a GGUF of known content."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import quantize

from kquants import quantize_iq4_xs, quantize_q3_k, quantize_q4_k, quantize_q5_k, quantize_q6_k
from pagedrs.models.gguf_loader import permute_qk

K_QUANTIZERS = {gguf.GGMLQuantizationType.Q3_K: quantize_q3_k, gguf.GGMLQuantizationType.Q4_K: quantize_q4_k, gguf.GGMLQuantizationType.Q5_K: quantize_q5_k,
                gguf.GGMLQuantizationType.Q6_K: quantize_q6_k, gguf.GGMLQuantizationType.IQ4_XS: quantize_iq4_xs}

# which quantization each tensor kind gets: every supported type appears at least once
QTYPES = {
    "attn_q": gguf.GGMLQuantizationType.Q8_0,
    "attn_k": gguf.GGMLQuantizationType.Q4_0,
    "attn_v": gguf.GGMLQuantizationType.Q4_1,
    "attn_output": gguf.GGMLQuantizationType.F16,
    "ffn_gate": gguf.GGMLQuantizationType.BF16,
    "ffn_up": gguf.GGMLQuantizationType.Q8_0,
    "ffn_down": gguf.GGMLQuantizationType.F32,
}
# every tensor in a format the Rust GEMV reads (fused siblings share one): a model wholly on the kernel
KERNEL_QTYPES = {
    "attn_q": gguf.GGMLQuantizationType.Q8_0,
    "attn_k": gguf.GGMLQuantizationType.Q8_0,
    "attn_v": gguf.GGMLQuantizationType.Q8_0,
    "attn_output": gguf.GGMLQuantizationType.Q4_0,
    "ffn_gate": gguf.GGMLQuantizationType.Q4_1,
    "ffn_up": gguf.GGMLQuantizationType.Q4_1,
    "ffn_down": gguf.GGMLQuantizationType.Q8_0,
}
# llama.cpp's "Q4_K_M" mix (Q4_K, with Q6_K values and down projections): q/k/v siblings of two types
Q4_K_M_QTYPES = {
    "attn_q": gguf.GGMLQuantizationType.Q4_K,
    "attn_k": gguf.GGMLQuantizationType.Q4_K,
    "attn_v": gguf.GGMLQuantizationType.Q6_K,
    "attn_output": gguf.GGMLQuantizationType.Q4_K,
    "ffn_gate": gguf.GGMLQuantizationType.Q4_K,
    "ffn_up": gguf.GGMLQuantizationType.Q4_K,
    "ffn_down": gguf.GGMLQuantizationType.Q6_K,
}
# llama.cpp's "Q5_K_M" mix: Q5_K, with Q6_K values and down projections
Q5_K_M_QTYPES = {**Q4_K_M_QTYPES, **{k: gguf.GGMLQuantizationType.Q5_K for k in ("attn_q", "attn_k", "attn_output",
                                                                               "ffn_gate", "ffn_up")}}
# llama.cpp's "Q3_K_M" mix (its common case: Q3_K, with Q5_K values and Q4_K output and down projections)
Q3_K_M_QTYPES = {**Q4_K_M_QTYPES, **{k: gguf.GGMLQuantizationType.Q3_K for k in ("attn_q", "attn_k", "ffn_gate", "ffn_up")},
                 "attn_v": gguf.GGMLQuantizationType.Q5_K, "attn_output": gguf.GGMLQuantizationType.Q4_K,
                 "ffn_down": gguf.GGMLQuantizationType.Q4_K}
# a "Q4_K_M" file of a model whose rows are not whole super-blocks (SmolLM2's 576): llama.cpp's fallbacks,
# Q5_0 for Q4_K and Q8_0 for Q6_K, where a row is 576 wide; ffn_down's 1536 takes Q6_K itself
Q4_K_M_FALLBACK_QTYPES = {
    "attn_q": gguf.GGMLQuantizationType.Q5_0,
    "attn_k": gguf.GGMLQuantizationType.Q5_0,
    "attn_v": gguf.GGMLQuantizationType.Q8_0,
    "attn_output": gguf.GGMLQuantizationType.Q5_0,
    "ffn_gate": gguf.GGMLQuantizationType.Q5_0,
    "ffn_up": gguf.GGMLQuantizationType.Q5_0,
    "ffn_down": gguf.GGMLQuantizationType.Q6_K,
}
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def write_gguf(model, tokenizer_dir: Path, out: Path, rope_freqs: np.ndarray | None = None,
               quantized: bool = True, qtypes: dict | None = None, recode=None) -> None:
    """``quantized=False`` writes every tensor as F32 (a GGUF equal to the HF weights); ``qtypes``
    replaces ``QTYPES`` (e.g. ``KERNEL_QTYPES``). ``rope_freqs``: Llama 3 frequency factors to store as llama.cpp's converter does (see
    ``llama3_rope_freqs``); the model's own rope_scaling is otherwise not written. ``recode(kind, blocks,
    cols, qtype) -> (blocks, qtype)`` replaces each quantized tensor's blocks before they are written."""
    cfg = model.config
    w = gguf.GGUFWriter(str(out), arch="llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}  # transformers 5 keeps rope_theta there
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or rope.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(w, tokenizer_dir)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    embd_type = (qtypes or {}).get("token_embd")  # None: F32; a type: quantized, and a tied head not written again
    for name, t in model.state_dict().items():
        arr = t.detach().float().numpy()
        if name == "model.embed_tokens.weight" and embd_type is not None:
            w.add_tensor("token_embd.weight", _blocks(arr, embd_type), raw_dtype=embd_type)
        elif name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", arr)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", arr)
        elif name == "lm_head.weight" and embd_type is not None and cfg.tie_word_embeddings:
            continue  # llama.cpp writes a tied head once, as token_embd
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", arr)
        else:
            _, _, layer, *rest = name.split(".")
            kind = _HF_TO_GGUF[".".join(rest[:-1])]
            if kind == "attn_q":
                arr = permute_qk(torch.from_numpy(arr), cfg.num_attention_heads).numpy()
            elif kind == "attn_k":
                arr = permute_qk(torch.from_numpy(arr), cfg.num_key_value_heads).numpy()
            qtype = (qtypes or QTYPES).get(kind, gguf.GGMLQuantizationType.F32) if quantized else gguf.GGMLQuantizationType.F32
            gname = f"blk.{layer}.{kind}.{rest[-1]}"
            if qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(gname, arr)
            elif qtype == gguf.GGMLQuantizationType.F16:
                w.add_tensor(gname, arr.astype(np.float16))
            else:
                blocks = _blocks(arr, qtype)
                if recode is not None:
                    blocks, qtype = recode(kind, blocks, arr.shape[1], qtype)
                w.add_tensor(gname, blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _blocks(arr: np.ndarray, qtype) -> np.ndarray:
    """``arr`` quantized to ``qtype``'s blocks (gguf-py cannot write K-quants: tests/kquants.py does)."""
    return K_QUANTIZERS[qtype](arr) if qtype in K_QUANTIZERS else quantize(arr, qtype)


def _add_tokenizer(w, folder: Path) -> None:
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    for added in tj["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])


def llama3_rope_freqs(head_dim: int, rope_theta: float, scaling: dict) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), written out again:
    per rotary frequency, the divisor that turns plain RoPE into Llama 3 RoPE."""
    import math

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)
