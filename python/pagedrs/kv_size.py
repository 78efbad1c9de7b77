"""The KV memory calculator behind `pagedrs kv-size`: why paging matters, in bytes.

    bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element

Llama 3.1 70B in float16: 2 x 80 x 8 x 128 x 2 = 327,680 bytes per token, about
1.34 GB for one 4096-token sequence and about 344 GB for 256 such users. With
``--kv-cache-dtype fp8_e4m3`` (or ``fp8_e5m2``) the pages hold 1 byte per element whatever
``--dtype`` is: half of that, the same pool holding twice the tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedrs.models.kv_geometry import DTYPE_BYTES, KvGeometry, geometry_from_dict, read_config_json

__all__ = ["DTYPE_BYTES", "KV_CACHE_DTYPES", "PRESETS", "KvGeometry", "geometry_from_config", "kv_itemsize", "kv_size",
           "resolve", "tp_layout"]

# EngineArgs.kv_cache_dtype -> bytes per stored element (None: the model dtype's)
KV_CACHE_DTYPES: dict[str, int | None] = {"auto": None, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}  # "fp8": vLLM's e4m3


# Published architecture figures (config.json of each model).
PRESETS: dict[str, KvGeometry] = {
    "llama-3.1-8b": KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128),
    "llama-3.1-70b": KvGeometry(num_layers=80, num_kv_heads=8, head_dim=128),
    "llama-3.1-405b": KvGeometry(num_layers=126, num_kv_heads=8, head_dim=128),
    "mistral-7b": KvGeometry(num_layers=32, num_kv_heads=8, head_dim=128),
    "qwen2.5-7b": KvGeometry(num_layers=28, num_kv_heads=4, head_dim=128),
    "smollm2-135m": KvGeometry(num_layers=30, num_kv_heads=3, head_dim=64),
}


def geometry_from_config(path: Path) -> KvGeometry:
    """Reads the KV geometry from an HF config.json (or a folder holding one)."""
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {str(path)!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    return geometry_from_dict(read_config_json(path), path)


# Published parameter counts, for the weights' share of each device under tensor parallelism.
PARAMETERS: dict[str, float] = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "llama-3.1-405b": 405.9e9,
    "mistral-7b": 7.24e9,
    "qwen2.5-7b": 7.62e9,
    "smollm2-135m": 134.5e6,
}


def resolve(model: str) -> KvGeometry:
    return PRESETS[model.lower()] if model.lower() in PRESETS else geometry_from_config(Path(model))


def kv_itemsize(dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes per stored K or V element: the model dtype's, 2 for a bfloat16 cache, 1 for an fp8 one."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype is {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype is {kv_cache_dtype!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or DTYPE_BYTES[dtype]


def kv_size(model: str, tokens: int, seqs: int = 1, dtype: str = "float16", kv_cache_dtype: str = "auto",
            draft_model: str | None = None) -> dict[str, Any]:
    """``draft_model``: a speculative draft whose layers every page also holds (spec/draft_runner.py),
    so a token costs the target's bytes plus the draft's."""
    if tokens < 1 or seqs < 1:
        raise ValueError(f"tokens is {tokens} and seqs is {seqs}; both must be >= 1")
    itemsize = kv_itemsize(dtype, kv_cache_dtype)
    per_token = resolve(model).bytes_per_element_token(itemsize)
    draft_bytes = resolve(draft_model).bytes_per_element_token(itemsize) if draft_model is not None else 0
    per_token += draft_bytes
    result: dict[str, Any] = {
        "bytes_per_token": per_token,
        "bytes_per_sequence": per_token * tokens,
        "total_bytes": per_token * tokens * seqs,
    }
    if kv_cache_dtype != "auto":
        result["kv_cache_dtype"] = kv_cache_dtype
    if draft_model is not None:
        result["draft_bytes_per_token"] = draft_bytes
    return result


def tp_layout(
    model: str,
    tokens: int,
    seqs: int,
    dtype: str,
    tensor_parallel_size: int,
    device_memory_gb: float,
    memory_utilization: float,
    block_size: int,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
) -> dict[str, float | int]:
    """Weights and KV per device under tensor parallelism, and the sequences each layout admits.

    Each rank holds 1/tp of the weights and the KV heads of its shard (a KV head is
    replicated when there are fewer KV heads than ranks), so every device holds the same
    number of token slots: the pool is what one device's leftover memory holds. The paged
    layout stores a sequence in whole pages of ``block_size``; the contiguous one reserves
    ``max_model_len`` slots per sequence up front.
    """
    geometry = resolve(model)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size is {tensor_parallel_size}; it must be >= 1")
    if model.lower() not in PARAMETERS:
        raise ValueError(f"no parameter count for {model!r}; presets with one: {', '.join(PARAMETERS)}")
    itemsize, kv_item = DTYPE_BYTES[dtype], kv_itemsize(dtype, kv_cache_dtype)
    kv_heads_per_device = max(1, geometry.num_kv_heads // tensor_parallel_size)
    per_token_device = KvGeometry(geometry.num_layers, kv_heads_per_device, geometry.head_dim).bytes_per_element_token(kv_item)
    weights_device = PARAMETERS[model.lower()] * itemsize / tensor_parallel_size
    kv_budget = device_memory_gb * 1e9 * memory_utilization - weights_device
    slots = max(0, int(kv_budget // per_token_device))
    paged_seq_slots = -(-tokens // block_size) * block_size
    total_kv = geometry.bytes_per_element_token(kv_item) * tokens * seqs
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "weights_bytes_per_device": int(weights_device),
        "kv_bytes_per_token_per_device": per_token_device,
        "kv_budget_bytes_per_device": int(max(0.0, kv_budget)),
        "token_slots": slots,
        "sequences_paged": slots // paged_seq_slots,
        "sequences_contiguous": slots // max(max_model_len, tokens),
        "kv_bytes_wanted": total_kv,
        "kv_bytes_available": int(max(0.0, kv_budget)) * tensor_parallel_size,
    }
