"""Reading a GGUF file: its config (``gguf_config``, checked and built in ``gguf_metadata``, re-exported
here), the tensors' places (``tensor_index``), each tensor dequantized to float32 (``gguf_tensors``) or as
its raw blocks (``gguf_raw_linears``), under transformers' names.

A block-format load (``weight_dtype="gguf"``) maps the file and packs its blocks; the rest of a load
dequantizes one tensor at a time. The cached folder a file converts into (config, tokenizer, this
module's index, and float32 weights for the loads that want them) is ``gguf_cache``'s.

llama.cpp stores the Q and K projections of ``llama`` models with their rows
permuted (interleaved rotary halves); ``unpermute_qk`` undoes it so the weights
match the Hugging Face rotary layout our model uses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from pagedrs.models.gguf_metadata import _ARCHITECTURES, _field, gguf_config  # noqa: F401  (gguf_config re-exported)

# GGUF tensor names -> transformers names; "{i}" is the layer index.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_INDEX = "gguf_index.json"  # the file's architecture and tensors (type, shape, bytes), in the converted folder
_Rows = TypeVar("_Rows", torch.Tensor, np.ndarray)  # Q/K rows: float tensors, or arrays of block bytes
_DEQUANTIZE_FLOATS = 1 << 22  # floats dequantized per call (16 MiB): bounds the transient arrays of a large tensor


def open_gguf(path: Path) -> Any:
    from pagedrs import gguf_reader

    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        reader = gguf_reader.reader(path)
        if not isinstance(reader, gguf_reader.HeaderInMemoryReader):  # gguf-py's own: checked after its parse
            gguf_reader.check_tensor_infos(gguf_reader.tensor_infos(t.field for t in reader.tensors),
                                           int(reader.data_offset), int(reader.alignment), path.stat().st_size)
    except gguf_reader.TensorPastEnd as e:
        raise ValueError(f"GGUF file {str(path)!r} is truncated or corrupt: {e}") from e
    except gguf_reader.TensorInfoError as e:
        raise ValueError(f"GGUF file {str(path)!r}: {e}") from e
    except Exception as e:  # the reader raises assorted errors on a short or garbled file
        raise ValueError(f"GGUF file {str(path)!r} is truncated or corrupt: {type(e).__name__}: {e}") from e
    return reader


def gguf_tensors(path: Path, index: dict[str, Any], config: dict[str, Any],
                 skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file (but those whose transformers name is in ``skip``) dequantized to float32
    under its transformers name, one at a time as the caller takes them (so a load holds one float32
    tensor beyond its model's at a time), read at the places ``index`` gives (``tensor_index``)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    permuted = _ARCHITECTURES[index["architecture"]][1]
    file = np.memmap(path, dtype=np.uint8, mode="r")
    for name, t in _weights(index, path):
        if name in skip:
            continue
        raw = _tensor_bytes(file, t, path)
        qtype = GGMLQuantizationType[t["type"]]
        array = np.empty(t["shape"], dtype=np.float32)
        # in runs of rows: gguf-py's intermediates (two or three arrays of the output's size) stay small
        step = max(1, _DEQUANTIZE_FLOATS // array.shape[1]) if array.ndim == 2 else array.shape[0]
        for first in range(0, array.shape[0], step):
            rows = raw[first:first + step] if array.ndim == 2 else raw  # a vector: its bytes in one run
            try:
                array[first:first + step] = np.asarray(dequantize(rows, qtype)).reshape(array[first:first + step].shape)
            except NotImplementedError as e:
                raise ValueError(f"GGUF tensor {t['name']!r} in {str(path)!r} has unsupported type {t['type']}") from e
            _check_finite(array[first:first + step], first, t, path)
        tensor = torch.from_numpy(array)
        yield name, _unpermuted(tensor, name, config) if permuted else tensor


def _check_finite(values: np.ndarray, first_row: int, t: dict[str, Any], path: Path) -> None:
    """Refuse a NaN or infinity among ``values`` (rows ``first_row``.. of tensor ``t`` dequantized, or the whole
    of a vector) naming the tensor and the first one's place: its row and column as the file stores them, and
    for a quantized type the block that holds it (a NaN or infinite f16 scale or minimum gives a whole block
    of them). Why here: every float a load takes from a GGUF (the dense formats' weights before they are
    written to the cache, the norms, biases and float head a block-format load keeps in torch) comes through
    ``gguf_tensors``, and a model that loads with one computes NaN logits (greedy picks token 0) without a word."""
    if np.isfinite(values).all():
        return
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    place = np.argwhere(~np.isfinite(values))[0]
    value = values[tuple(place)]
    per_block = GGML_QUANT_SIZES[GGMLQuantizationType[t["type"]]][0]
    if values.ndim == 1:
        where = f"index {int(place[0])}"
        col = int(place[0])
    else:
        where = f"row {first_row + int(place[0])}, column {int(place[1])}"
        col = int(place[1])
    block = f" ({t['type']} block {col // per_block}{' of that row' if values.ndim > 1 else ''}: its scale or minimum is not finite)" \
        if per_block > 1 else ""
    raise ValueError(f"GGUF tensor {t['name']!r} in {str(path)!r} holds {float(value)} at {where}{block}; "
                     "a model needs finite weights (the file is corrupt)")


def gguf_checkpoint_shapes(path: Path, index: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The file's tensors' transformers names and (row-major) shapes, from ``index``: what a load checks
    against the config before it reads any weight."""
    return {name: tuple(t["shape"]) for name, t in _weights(index, path)}


def _weights(index: dict[str, Any], path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(transformers name, index entry) of every weight in ``index``: all its tensors but ``rope_freqs``, a
    config value (``gguf_config``); a tensor with no place in the architecture is refused by name."""
    for t in index["tensors"]:
        if t["name"] != "rope_freqs.weight":
            yield _hf_name(t["name"], path), t


def _tensor_bytes(file: np.ndarray, t: dict[str, Any], path: Path) -> np.ndarray:
    """A read-only view of tensor ``t``'s bytes in the mapped ``file``: ``[rows, bytes per row]`` for a matrix."""
    offset, nbytes = int(t["offset"]), int(t["bytes"])
    if offset + nbytes > file.size:
        raise ValueError(f"GGUF file {str(path)!r} is truncated or corrupt: tensor {t['name']!r} needs bytes "
                         f"{offset}..{offset + nbytes}, the file has {file.size}")
    raw = file[offset:offset + nbytes]
    if len(t["shape"]) == 1:
        return raw
    rows = t["shape"][0]
    if nbytes % rows:
        raise ValueError(f"GGUF tensor {t['name']!r} in {str(path)!r}: {nbytes} bytes do not split into {rows} rows")
    return raw.reshape(rows, -1)


def _unpermuted(rows: _Rows, name: str, config: dict[str, Any]) -> _Rows:
    """Q and K projections' rows (a tensor of floats, or an array of whole block runs of bytes) back in
    transformers' rotary layout; other tensors as they are. Only for architectures whose converter
    permuted them."""
    if name.endswith("q_proj.weight"):
        return unpermute_qk(rows, config["num_attention_heads"])
    if name.endswith("k_proj.weight"):
        return unpermute_qk(rows, config["num_key_value_heads"])
    return rows


def _tensor_index(reader: Any) -> dict[str, Any]:
    """What loading needs of a GGUF beyond its converted folder: the architecture and, per tensor, its
    GGUF type, row-major shape and the bytes of its data (absolute offset into the file, length)."""
    return {"architecture": str(_field(reader, "general.architecture")),
            "tensors": [{"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in reversed(t.shape.tolist())],
                         "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors]}


def tensor_index(path: Path, folder: Path | None = None) -> dict[str, Any]:
    """``_tensor_index`` of the file: from its converted ``folder`` (written at conversion; the folder is
    keyed by the file's content hash, so its offsets are this file's), else parsed from the file.
    Why: gguf-py's reader takes seconds to parse a file (it reads the tokenizer's 49k strings one by
    one), and a warm load needs only the tensors' places."""
    if folder is not None:
        try:
            index = json.loads((folder / _INDEX).read_text())
        except (OSError, json.JSONDecodeError):
            index = None  # no index (or a broken one): parse the file
        if _well_formed(index):
            return index
    return _tensor_index(open_gguf(path))


def _well_formed(index: Any) -> bool:
    """Whether ``index`` has the architecture and, per tensor, a name, a known type, a shape and an offset,
    with the bytes that type and shape take (gguf-py's block sizes): an index that does not add up is
    never read from (the file is parsed instead)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if not isinstance(index, dict) or not isinstance(index.get("architecture"), str):
        return False
    tensors = index.get("tensors")
    if not isinstance(tensors, list):
        return False
    for t in tensors:
        try:
            per_block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t["type"]]]
            count = math.prod(t["shape"])
            ok = (isinstance(t["name"], str) and all(isinstance(d, int) and d > 0 for d in t["shape"])
                  and isinstance(t["offset"], int) and t["offset"] >= 0 and count % per_block == 0
                  and t["bytes"] == count // per_block * size)
        except (KeyError, TypeError):
            return False
        if not ok:
            return False
    return True


def linear_tensor_types(path: Path, index: dict[str, Any] | None = None) -> list[str]:
    """GGUF type names (``Q4_1``, ``Q8_0``, ``F16`` ...) of the file's 2-D layer weights: what "auto" matches.
    ``index``: the file's ``tensor_index`` when the caller has it."""
    index = tensor_index(path) if index is None else index
    return [t["type"] for t in index["tensors"] if t["name"].startswith("blk.") and len(t["shape"]) == 2]


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} in {str(path)!r} has no counterpart in the Llama architecture")


def permute_qk(w: _Rows, num_heads: int) -> _Rows:
    """llama.cpp's convert_hf_to_gguf permutation (rotary halves -> interleaved pairs), for tests."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: _Rows, num_heads: int) -> _Rows:
    """Inverse of ``permute_qk``: interleaved rotary pairs -> the two halves transformers expects."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_raw_linears(path: Path, config: dict[str, Any],
                     index: dict[str, Any] | None = None) -> dict[str, tuple[np.ndarray, int, str]]:
    """Raw block bytes of every 2-D tensor the kernel runs (``gguf_convert.kernel_type``: its own three
    formats as they are, the other quantized types once converted), by transformers name: (uint8
    [rows, bytes per row], cols, the file's GGUF type name). The arrays are read-only views of the mapped
    file (nothing is copied until a matrix is packed from them), except Q/K rows, unpermuted like the
    dequantized path (rows are whole block runs, so permuting rows of bytes is exact)."""
    from pagedrs.models.gguf_convert import kernel_type

    index = tensor_index(path) if index is None else index
    permuted = _ARCHITECTURES[index["architecture"]][1]
    file = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, tuple[np.ndarray, int, str]] = {}
    for name, t in _weights(index, path):
        if len(t["shape"]) != 2 or kernel_type(t["type"]) is None:
            continue
        blocks = _tensor_bytes(file, t, path)
        if permuted:
            blocks = np.ascontiguousarray(_unpermuted(blocks, name, config))
        out[name] = (blocks, t["shape"][1], t["type"])
    return out
