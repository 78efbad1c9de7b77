"""Where a benchmark's model lives and how many KV-cache bytes one token costs.

Every model resolves to one Hugging Face folder: a GGUF (the embedded SmolLM2 or a
path) goes through the engine's own cached converter, so transformers and pagedrs
load exactly the same weights. The KV byte budget, the one quantity every system in a
comparison shares, is computed here once from that folder's config.json:
``2 (K and V) * layers * kv_heads * head_dim * dtype bytes`` per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedrs.models.kv_geometry import DTYPE_BYTES, KvGeometry, geometry_from_dict, read_config_json


def resolve_model(name: str, *, weights: bool = False) -> Path:
    """The Hugging Face folder for ``name`` (same recognition rules as the engine's loader). ``weights``:
    a GGUF's folder must hold its float32 weights (transformers or a dense engine loads them from it);
    without it the folder may hold only config and tokenizer (written on the first call that asks)."""
    from pagedrs.models.gguf_cache import convert_gguf_cached
    from pagedrs.models.loader import EMBEDDED_MODEL_NAME, embedded_model_path

    if name.lower() == EMBEDDED_MODEL_NAME:
        return convert_gguf_cached(embedded_model_path(), dense_weights=weights)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf_cached(path, dense_weights=weights)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        return convert_gguf_cached(ggufs[0], dense_weights=weights)
    raise ValueError(
        f"--model {name!r} is not {EMBEDDED_MODEL_NAME!r}, a .gguf file, or a folder with "
        "config.json or exactly one .gguf"
    )


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    vocab_size: int
    context_len: int  # max_position_embeddings: no benchmark's max_model_len may exceed it

    @property
    def bytes_per_token(self) -> int:
        return KvGeometry(self.num_layers, self.num_kv_heads, self.head_dim).bytes_per_element_token(self.dtype_bytes)


def kv_geometry(folder: Path, dtype: str) -> KVGeometry:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    path = Path(folder) / "config.json"
    cfg: dict[str, Any] = read_config_json(path)
    geo = geometry_from_dict(cfg, path)  # the same arithmetic as `pagedrs kv-size`
    return KVGeometry(
        num_layers=geo.num_layers,
        num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_dim,
        dtype_bytes=DTYPE_BYTES[dtype],
        vocab_size=int(cfg["vocab_size"]),
        context_len=int(cfg.get("max_position_embeddings") or 2048),
    )


def load_tokenizer(folder: Path) -> Any:
    from pagedrs.tokenizer import Tokenizer

    return Tokenizer.from_folder(folder)
