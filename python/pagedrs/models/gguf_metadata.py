"""A GGUF's metadata read into a transformers-style config (``gguf_config``), each field bounded and checked
against the file's tensors before any model is sized from it.

Separate from ``gguf_loader`` (which reads the tensors) because these checks are the file's first line of
defence against a hostile or corrupt header: a size that would hang or ask for terabytes, a layer count
the tensors do not hold, per-token lists shorter than the vocabulary. All of it runs on the parsed header
only, before any weight is read.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp architecture -> (our model_type, whether Q/K rows were permuted by the converter)
_ARCHITECTURES: dict[str, tuple[str, bool]] = {"llama": ("llama", True), "qwen2": ("qwen2", False)}


def _field(reader: Any, key: str, default: Any = None, *, path: Path | None = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if path is not None:
            raise ValueError(f"GGUF file {str(path)!r} lacks metadata field {key!r}")
        return default
    return f.contents()


# Bounds on the sizes a GGUF's metadata gives, checked before anything is sized from them (a model of a
# billion layers or a 2**40-wide matrix would hang or ask for terabytes before any tensor's shape is
# compared): generous for any model this engine can run (Llama 3 405B: 126 layers, hidden 16384,
# intermediate 53248, 128 heads, vocabulary 128256).
_MAX_LAYERS = 1024
_MAX_WIDTH = 1 << 20  # hidden, intermediate and head sizes
_MAX_HEADS = 4096
_MAX_VOCAB = 1 << 24
_MAX_CONTEXT = (1 << 31) - 1
_MISSING = object()


def _int_field(reader: Any, key: str, path: Path, low: int, high: int, default: Any = _MISSING) -> Any:
    """The integer metadata field ``key``, refused by name unless it is one from ``low`` to ``high`` (a
    missing field: ``default``, or refused when there is none)."""
    if key not in reader.fields and default is not _MISSING:
        return default
    value = _field(reader, key, path=path)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"GGUF file {str(path)!r}: metadata field {key!r} is {_shown(value)}; expected an "
                         f"integer from {low} to {high}")
    return value


def _float_field(reader: Any, key: str, path: Path, default: Any = _MISSING) -> float:
    value = _field(reader, key, path=path) if default is _MISSING else _field(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"GGUF file {str(path)!r}: metadata field {key!r} is {_shown(value)}; expected a "
                         "finite number")
    return float(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def gguf_config(reader: Any, path: Path) -> dict[str, Any]:
    """A transformers-style config.json dict from the GGUF metadata, each size bounded and checked against
    the file's tensors (a field that disagrees with them is refused by its key, before any model is sized
    from it)."""
    from pagedrs.models.config import SUPPORTED_MODEL_TYPES

    arch = _field(reader, "general.architecture", path=path)
    if not isinstance(arch, str) or arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} in {str(path)!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (GGUF architectures: {', '.join(_ARCHITECTURES)})"
        )
    hidden = _int_field(reader, f"{arch}.embedding_length", path, 1, _MAX_WIDTH)
    heads = _int_field(reader, f"{arch}.attention.head_count", path, 1, _MAX_HEADS)
    kv_heads = _int_field(reader, f"{arch}.attention.head_count_kv", path, 1, heads, default=heads)
    if heads % kv_heads:
        raise ValueError(f"GGUF file {str(path)!r}: metadata field '{arch}.attention.head_count_kv' is {kv_heads}, "
                         f"which does not divide '{arch}.attention.head_count' {heads}")
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    if not isinstance(tokens, list):
        raise ValueError(f"GGUF file {str(path)!r}: metadata field 'tokenizer.ggml.tokens' is {_shown(tokens)}; "
                         "expected a list of strings")
    _check_per_token_lists(reader, len(tokens), path)
    names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "model_type": _ARCHITECTURES[arch][0],
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": _int_field(reader, f"{arch}.vocab_size", path, 1, _MAX_VOCAB,
                                 default=len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": _int_field(reader, f"{arch}.feed_forward_length", path, 1, _MAX_WIDTH),
        "num_hidden_layers": _int_field(reader, f"{arch}.block_count", path, 1, _MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": _int_field(reader, f"{arch}.attention.key_length", path, 1, _MAX_WIDTH,
                               default=hidden // heads),
        "rms_norm_eps": _float_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-6),
        "rope_theta": _float_field(reader, f"{arch}.rope.freq_base", path, 10000.0),
        "max_position_embeddings": _int_field(reader, f"{arch}.context_length", path, 1, _MAX_CONTEXT,
                                              default=2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    _check_against_tensors(config, arch, len(tokens), reader, path)
    known = len(tokens) or config["vocab_size"]  # a special token's id must name a token of the tokenizer
    config["bos_token_id"] = _int_field(reader, "tokenizer.ggml.bos_token_id", path, 0, known - 1, default=None)
    config["eos_token_id"] = _int_field(reader, "tokenizer.ggml.eos_token_id", path, 0, known - 1, default=None)
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": _float_field(reader, f"{arch}.rope.scaling.factor", path)}
    elif scaling_type not in (None, "none"):
        raise ValueError(
            f"GGUF file {str(path)!r} uses RoPE scaling {scaling_type!r}; supported: 'none', 'linear', and Llama 3 "
            "scaling through a rope_freqs tensor"
        )
    if "rope_freqs.weight" in names:
        # Llama 3 RoPE scaling as llama.cpp's converter writes it: the divisor of each rotary
        # frequency (llama.cpp rotates by theta / freq_factor), with no scaling metadata.
        factors = _rope_freqs(reader, path)
        if len(factors) != config["head_dim"] // 2:
            raise ValueError(
                f"GGUF file {str(path)!r}: rope_freqs has {len(factors)} entries; head_dim {config['head_dim']} "
                f"needs {config['head_dim'] // 2}"
            )
        config["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": factors}
    return config


def _check_against_tensors(config: dict[str, Any], arch: str, n_tokens: int, reader: Any, path: Path) -> None:
    """The config's sizes against the file's tensors' shapes, each mismatch named by its tensor and the
    GGUF key the expected size came from: the layers the file holds are exactly ``block_count``'s, and
    every known tensor has the rank and shape its sizes imply (which also refuses a tokenizer with more
    tokens than the table has rows)."""
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    where = f"GGUF file {str(path)!r}"
    layers = {p[1] for p in (n.split(".") for n in shapes) if p[0] == "blk" and len(p) > 2}
    count = config["num_hidden_layers"]
    if layers != {str(i) for i in range(count)}:
        held = sorted(layers, key=lambda x: (len(x), x))
        shown = ", ".join(held[:8]) + (", ..." if len(held) > 8 else "")
        raise ValueError(f"{where}: metadata field '{arch}.block_count' is {count}, but the file's tensors hold "
                         f"{len(held)} layers (blk.N for N in {{{shown}}}); expected blk.0 to blk.{count - 1}")
    a = f"{arch}.attention."
    keys = {"vocab": f"{arch}.vocab_size" if f"{arch}.vocab_size" in reader.fields else "tokenizer.ggml.tokens",
            "hidden": f"{arch}.embedding_length", "inter": f"{arch}.feed_forward_length",
            "q": f"{a}head_count x {a}key_length", "kv": f"{a}head_count_kv x {a}key_length"}
    size = {"vocab": config["vocab_size"], "hidden": config["hidden_size"], "inter": config["intermediate_size"],
            "q": config["num_attention_heads"] * config["head_dim"],
            "kv": config["num_key_value_heads"] * config["head_dim"]}
    dims = {"token_embd.weight": ("vocab", "hidden"), "output.weight": ("vocab", "hidden"),
            "output_norm.weight": ("hidden",), "attn_norm.weight": ("hidden",), "ffn_norm.weight": ("hidden",),
            "attn_q.weight": ("q", "hidden"), "attn_k.weight": ("kv", "hidden"), "attn_v.weight": ("kv", "hidden"),
            "attn_output.weight": ("hidden", "q"), "attn_q.bias": ("q",), "attn_k.bias": ("kv",),
            "attn_v.bias": ("kv",), "ffn_gate.weight": ("inter", "hidden"), "ffn_up.weight": ("inter", "hidden"),
            "ffn_down.weight": ("hidden", "inter")}
    for name, shape in shapes.items():
        parts = name.split(".")
        expect = dims.get(name if parts[0] != "blk" else ".".join(parts[2:]))
        if expect is None:
            continue  # rope_freqs, checked with the config; a tensor with no place: refused by its name later
        if tuple(shape) != tuple(size[k] for k in expect):
            implied = " x ".join(f"{keys[k]} ({size[k]})" for k in expect)
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(shape)}, but the metadata implies {implied}")
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{where} lacks the tensor 'token_embd.weight'")
    if n_tokens > config["vocab_size"]:
        raise ValueError(f"{where}: metadata field 'tokenizer.ggml.tokens' holds {n_tokens} tokens, but "
                         f"'token_embd.weight' has {config['vocab_size']} rows")


def _check_per_token_lists(reader: Any, n_tokens: int, path: Path) -> None:
    """The scores and token types, one per token, counted without reading them (the field's entry count).
    Why here, on every load: transformers builds a tokenizer from a short token-type list without a word,
    every token past its end typed "normal", so a control token the list left out is printed by
    ``skip_special_tokens`` (and llama.cpp reads past the list's end)."""
    from gguf import GGUFValueType

    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        field = reader.fields.get(key)
        if field is None:
            continue
        if field.types[:1] != [GGUFValueType.ARRAY]:
            raise ValueError(f"GGUF file {str(path)!r}: metadata field {key!r} is not a list; expected one entry "
                             "for each token")
        if len(field.data) != n_tokens:
            raise ValueError(f"GGUF file {str(path)!r}: metadata field {key!r} has {len(field.data)} entries; "
                             f"'tokenizer.ggml.tokens' has {n_tokens}, and there must be one for each token")


def _rope_freqs(reader: Any, path: Path) -> list[float]:
    from gguf.quants import dequantize

    (tensor,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    return [float(x) for x in np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)]

