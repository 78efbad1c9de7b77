"""ModelConfig: the architecture numbers the runner and the KV pool need, from any source.

Built from a Hugging Face ``config.json`` dict (``from_hf_dict``) or from GGUF
metadata (the GGUF loader produces the same dict first), so both paths share one
validation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedrs.models.kv_geometry import KvGeometry

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")

# rope_scaling types we implement; None / "default" means plain RoPE.
# "freq_factors" is llama.cpp's form of Llama 3 scaling (a GGUF's rope_freqs tensor): one divisor
# per rotary frequency, kept as rope_scaling["freq_factors"] in a converted GGUF's config.json.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "freq_factors")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention: each token sees the last `sliding_window` positions (its own
    # included), on the layers `layer_types` marks "sliding_attention" (None: every layer).
    sliding_window: int | None = None
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config field {name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        self._check_numbers()
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(f"config field sliding_window={self.sliding_window!r} must be a positive integer or null")
        if self.layer_types is not None and (
            len(self.layer_types) != self.num_hidden_layers
            or not set(self.layer_types) <= {"full_attention", "sliding_attention"}
        ):
            raise ValueError(
                f"config field layer_types={self.layer_types!r} must list 'full_attention' or 'sliding_attention' "
                f"for each of the {self.num_hidden_layers} layers"
            )
        if rope_type == "freq_factors":
            factors = (self.rope_scaling or {}).get("freq_factors")
            if not isinstance(factors, list) or len(factors) != self.head_dim // 2 or not all(
                _positive_number(f) for f in factors
            ):
                shown = factors if not isinstance(factors, list) else f"a list of {len(factors)}"
                raise ValueError(
                    f"rope_scaling freq_factors is {shown!r}; it must be a list of head_dim / 2 = "
                    f"{self.head_dim // 2} positive finite numbers"
                )
        for key in _ROPE_NUMBERS.get(rope_type, ()):
            value = (self.rope_scaling or {}).get(key)
            if not _positive_number(value):
                raise ValueError(f"config field rope_scaling[{key!r}]={value!r} must be a positive finite number for "
                                 f"rope_type {rope_type!r}" + (" (it is missing)" if value is None else "")
                                 + (self._gguf_key("factor") if key == "factor" and rope_type == "linear" else ""))

    def _gguf_key(self, config_field: str) -> str:
        """Where a GGUF file keeps ``config_field`` (its config is made from the metadata), as a note for a message."""
        arch = "qwen2" if self.model_type == "qwen2" else "llama"
        return f" (a GGUF file's metadata key {arch}.{_GGUF_KEYS[config_field]})"

    def _check_numbers(self) -> None:
        """The scalars the forward computes with: a NaN or infinite one (or a zero or negative RoPE base, or a
        context of no positions) makes every logit NaN or fails only at a later step, so it is refused at load
        naming the field (a GGUF's come from its metadata: ``attention.layer_norm_rms_epsilon``,
        ``rope.freq_base``, ``context_length``, ``rope.scaling.factor``)."""
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 <= eps < math.inf):
            raise ValueError(f"config field rms_norm_eps={eps!r} must be a finite number >= 0{self._gguf_key('rms_norm_eps')}")
        if not _positive_number(self.rope_theta):
            raise ValueError(f"config field rope_theta={self.rope_theta!r} must be a positive finite number"
                             f"{self._gguf_key('rope_theta')}")
        length = self.max_position_embeddings
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"config field max_position_embeddings={length!r} must be a positive integer"
                             f"{self._gguf_key('max_position_embeddings')}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"config field rope_scaling={self.rope_scaling!r} must be an object (or null)")

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer ``layer``, or None for full causal attention."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def context_length(self) -> int:
        """The positions the model was made for: ``max_position_embeddings``, times the factor of a
        linear RoPE scaling (vLLM's rule: such configs give the unscaled length). Llama 3 scaling and
        llama.cpp's freq_factors give the scaled length already."""
        if self.rope_type == "linear" and self.rope_scaling is not None:  # (__post_init__: a positive finite factor)
            factor = float(self.rope_scaling["factor"])
            if factor > 1:
                return int(self.max_position_embeddings * factor)
        return self.max_position_embeddings

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From a transformers ``config.json`` dict; fills the family defaults transformers would."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            vocab = int(d["vocab_size"])
            intermediate = int(d["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks required field {e.args[0]!r}") from None
        head_dim = d.get("head_dim") or hidden // heads
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(x) for x in eos])
        # transformers: Qwen2 always has q/k/v bias; llama/mistral read `attention_bias`.
        bias = True if model_type == "qwen2" else bool(d.get("attention_bias", False))
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        rope_params = d.get("rope_parameters")  # transformers >= 5 folds theta and scaling in here
        if isinstance(rope_params, dict):
            _check_rope_fields_agree(rope_params, rope_theta, rope_scaling)
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling or None,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_sliding_window_fields(model_type, d, layers),
        )

    def kv_bytes_per_token(self, dtype: str | torch.dtype, kv_heads: int | None = None) -> int:
        """Bytes of K and V for one token across all layers (``KvGeometry``'s one formula);
        ``kv_heads``: the heads one tensor-parallel rank holds (default: all)."""
        heads = self.num_key_value_heads if kv_heads is None else kv_heads
        return KvGeometry(self.num_hidden_layers, heads, self.head_dim).bytes_per_element_token(_as_dtype(dtype).itemsize)


def _rope_scaling_part(value: Any) -> dict | None:
    """A rope_scaling or rope_parameters dict without its theta, legacy "type" named "rope_type";
    None for no scaling (absent, or rope_type "default")."""
    if not isinstance(value, dict):
        return None
    part = {k: v for k, v in value.items() if k != "rope_theta"}
    if "type" in part and "rope_type" not in part:
        part["rope_type"] = part.pop("type")
    return None if part.get("rope_type", "default") == "default" else part


def _check_rope_fields_agree(rope_params: dict, rope_theta: Any, rope_scaling: Any) -> None:
    """A config.json with transformers 5's rope_parameters beside the older top-level rope_theta or
    rope_scaling: which one transformers reads depends on its version, so two that disagree are
    refused naming both (guessing would be a model that answers differently from transformers)."""
    theta = rope_params.get("rope_theta")
    numbers = all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in (rope_theta, theta))
    if numbers and rope_theta != theta:  # anything else is refused by name where theta is checked
        raise ValueError(f"config.json has rope_parameters.rope_theta={theta!r} and rope_theta={rope_theta!r}: they "
                         "disagree, and which one transformers uses depends on its version; allowed: one of "
                         "them, or both equal")
    if rope_scaling is not None and _rope_scaling_part(rope_scaling) != _rope_scaling_part(rope_params):
        raise ValueError(f"config.json has rope_parameters={rope_params!r} and rope_scaling={rope_scaling!r}: they "
                         "disagree, and which one transformers uses depends on its version; allowed: one of "
                         "them, or both saying the same scaling")

def _sliding_window_fields(model_type: str, d: dict[str, Any], layers: int) -> dict[str, Any]:
    """transformers' reading of the window: Mistral applies ``sliding_window`` on every layer
    (it ignores ``layer_types``); Qwen2 only with ``use_sliding_window``, on the layers its
    ``layer_types`` name (by default the layers from ``max_window_layers`` on); Llama has none."""
    window = d.get("sliding_window")
    if model_type == "llama" or window is None or (model_type == "qwen2" and not d.get("use_sliding_window", False)):
        return {}
    if model_type == "mistral":
        return {"sliding_window": window}
    layer_types = d.get("layer_types") or [
        "sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention" for i in range(layers)
    ]
    return {"sliding_window": window, "layer_types": list(layer_types)}


# GGUF metadata keys (after "<architecture>.") of the config fields a GGUF's config is made from
_GGUF_KEYS = {"rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
              "max_position_embeddings": "context_length", "factor": "rope.scaling.factor"}
# the numbers each RoPE scaling type computes with (transformers' required keys), each positive and finite
_ROPE_NUMBERS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Parse a dtype name; only the three floating types a model can run in are allowed."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r} is not supported; allowed: float32, bfloat16, float16")
