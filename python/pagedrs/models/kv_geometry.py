"""A model's KV geometry and the one formula for its bytes per token.

    bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element

The engine sizes its pools with it (``ModelConfig.kv_bytes_per_token``), and the
``pagedrs kv-size`` calculator and the benchmarks print it; all three use this one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class KvGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: str) -> int:
        return self.bytes_per_element_token(DTYPE_BYTES[dtype])

    def bytes_per_element_token(self, itemsize: int) -> int:
        """The formula, once: K and V, every layer, every KV head, ``itemsize`` bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def geometry_from_dict(cfg: dict[str, Any], source: Path) -> KvGeometry:
    """The KV geometry of an HF config.json's fields; ValueError naming ``source`` and the missing field."""
    try:
        heads = int(cfg["num_attention_heads"])
        return KvGeometry(
            num_layers=int(cfg["num_hidden_layers"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        )
    except KeyError as exc:
        raise ValueError(f"{source} lacks the field {exc.args[0]!r} needed for the KV size") from exc


def read_config_json(path: Path) -> dict[str, Any]:
    """An HF config.json (``path`` is the file); ValueError when it is not valid JSON."""
    try:
        cfg: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return cfg
