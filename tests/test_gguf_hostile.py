"""A hostile or broken GGUF is refused at load with a ValueError naming the tensor or metadata field and its
value: never a hang, a huge allocation, a raw ZeroDivisionError/IndexError/TypeError, or a model read from
overlapping or misplaced bytes. Files are written here directly (tiny F32 llama tensors, no tokenizer
conversion) and their tensor entries patched in place, so each check runs in milliseconds."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V

from pagedrs.models import gguf_loader

H, INTER, VOCAB, HEADS = 32, 64, 40, 4


def _tensors(layers: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {"token_embd.weight": (VOCAB, H), "output_norm.weight": (H,)}
    for i in range(layers):
        out.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                    f"blk.{i}.attn_q.weight": (H, H), f"blk.{i}.attn_k.weight": (H, H),
                    f"blk.{i}.attn_v.weight": (H, H), f"blk.{i}.attn_output.weight": (H, H),
                    f"blk.{i}.ffn_gate.weight": (INTER, H), f"blk.{i}.ffn_up.weight": (INTER, H),
                    f"blk.{i}.ffn_down.weight": (H, INTER)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in out.items()}


def _write(path: Path, meta: dict[str, Any] | None = None, tensors: dict[str, np.ndarray] | None = None,
           raw: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """A one-layer llama GGUF; ``meta`` entries replace the defaults (a value ``(type, value)`` gives its GGUF
    type; ``None`` drops the field); ``raw``: tensors given as blocks of that type."""
    fields: dict[str, Any] = {
        "llama.block_count": 1, "llama.context_length": 128, "llama.embedding_length": H,
        "llama.feed_forward_length": INTER, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": HEADS, "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)],
        "tokenizer.ggml.eos_token_id": 1,
    }
    fields.update(meta or {})
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in fields.items():
        if value is None:
            continue
        vtype, value = value if isinstance(value, tuple) else (
            V.STRING if isinstance(value, str) else V.ARRAY if isinstance(value, list) else V.UINT32, value)
        w.add_key_value(key, value, vtype)
    for name, arr in (_tensors() if tensors is None else tensors).items():
        w.add_tensor(name, arr, raw_dtype=(raw or {}).get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _patch(path: Path, name: str, *, offset: int | None = None, dims: list[int] | None = None,
           qtype: int | None = None) -> None:
    """Rewrite tensor ``name``'s entry in the header in place: its data offset, GGUF dims (innermost first,
    as many as it has), or raw type."""
    reader = gguf.GGUFReader(str(path))
    (t,) = [t for t in reader.tensors if t.name == name]
    n_dims = len(t.shape)
    dims_at = t.field.offset + 8 + len(name.encode()) + 4
    type_at = dims_at + 8 * n_dims
    del reader
    with path.open("r+b") as f:
        if dims is not None:
            assert len(dims) == n_dims
            f.seek(dims_at)
            f.write(struct.pack(f"<{n_dims}Q", *dims))
        if qtype is not None:
            f.seek(type_at)
            f.write(struct.pack("<I", qtype))
        if offset is not None:
            f.seek(type_at + 4)
            f.write(struct.pack("<Q", offset))


def _offset(path: Path, name: str) -> int:
    reader = gguf.GGUFReader(str(path))
    (t,) = [t for t in reader.tensors if t.name == name]
    return int(t.data_offset) - int(reader.data_offset)


def _config(path: Path) -> dict[str, Any]:
    return gguf_loader.gguf_config(gguf_loader.open_gguf(path), path)


def test_a_well_formed_file_passes(tmp_path):
    config = _config(_write(tmp_path / "ok.gguf"))
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (H, 1, VOCAB)


# -- tensor entries: checked before gguf-py reads any tensor's bytes


def test_an_offset_that_would_wrap_is_refused_naming_the_tensor(tmp_path):
    path = _write(tmp_path / "m.gguf")
    _patch(path, "blk.0.attn_q.weight", offset=2**64 - 32)  # uint64 start + offset wrapped to before the data
    with pytest.raises(ValueError, match=r"truncated or corrupt: tensor 'blk\.0\.attn_q\.weight' .*needs bytes "
                                         r"\d{19,}\.\.\d+, the file has \d+"):
        _config(path)


def test_an_offset_past_the_end_is_refused_naming_the_tensor(tmp_path):
    path = _write(tmp_path / "m.gguf")
    _patch(path, "blk.0.ffn_up.weight", offset=1 << 30)
    with pytest.raises(ValueError, match=r"truncated or corrupt: tensor 'blk\.0\.ffn_up\.weight' \(F32, shape "
                                         r"\(64, 32\)\) needs bytes"):
        _config(path)


def test_a_huge_dimension_is_refused_naming_the_tensor(tmp_path):
    path = _write(tmp_path / "m.gguf")
    _patch(path, "blk.0.attn_q.weight", dims=[H, 2**40])
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_q\.weight' \(F32, shape \(1099511627776, 32\)\) "
                                         r"needs bytes"):
        _config(path)


def test_tensors_sharing_bytes_are_refused_naming_both(tmp_path):
    path = _write(tmp_path / "m.gguf")
    _patch(path, "blk.0.attn_k.weight", offset=_offset(path, "blk.0.attn_q.weight"))
    with pytest.raises(ValueError, match=r"tensors 'blk\.0\.attn_[qk]\.weight' and 'blk\.0\.attn_[qk]\.weight' "
                                         r"overlap"):
        _config(path)


def test_an_offset_off_the_alignment_is_refused(tmp_path):
    path = _write(tmp_path / "m.gguf")
    at = _offset(path, "blk.0.attn_q.weight")
    _patch(path, "blk.0.attn_q.weight", offset=at + 2)
    with pytest.raises(ValueError, match=rf"tensor 'blk\.0\.attn_q\.weight' starts at data offset {at + 2}, not a "
                                         r"multiple of the file's alignment 32 \(general\.alignment\)"):
        _config(path)


def test_an_unknown_type_is_refused_naming_the_tensor(tmp_path):
    path = _write(tmp_path / "m.gguf")
    _patch(path, "blk.0.attn_v.weight", qtype=99)
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_v\.weight' has type 99, which is no GGML type"):
        _config(path)


@pytest.mark.parametrize("name, dims", [("blk.0.attn_q.weight", [H, 0]), ("output_norm.weight", [0])])
def test_a_zero_dimension_is_refused_naming_the_tensor(tmp_path, name, dims):
    path = _write(tmp_path / "m.gguf")
    _patch(path, name, dims=dims)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \(0,?( {H})?\); every dimension must be at "
                                         "least 1"):
        _config(path)


def test_rows_of_partial_blocks_are_refused_naming_the_tensor(tmp_path):
    from gguf.quants import quantize

    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = _tensors()
    tensors["blk.0.ffn_up.weight"] = quantize(tensors["blk.0.ffn_up.weight"], q8)
    path = _write(tmp_path / "m.gguf", tensors=tensors, raw={"blk.0.ffn_up.weight": q8})
    _patch(path, "blk.0.ffn_up.weight", dims=[48, INTER // 2 * 2])  # 48 values a row: one and a half blocks
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_up\.weight' of shape \(64, 48\): its rows of 48 values "
                                         r"are not whole Q8_0 blocks \(32 values each\)"):
        _config(path)


# -- metadata: typed and bounded by key, and checked against the tensors' shapes before any model is sized


@pytest.mark.parametrize("key, value, shown", [
    ("llama.block_count", 2**31, "int 2147483648"),
    ("llama.feed_forward_length", (V.UINT64, 2**40), "int 1099511627776"),
    ("llama.embedding_length", (V.UINT64, 2**40), "int 1099511627776"),
    ("llama.embedding_length", "32", "str '32'"),
    ("llama.attention.head_count", 0, "int 0"),
    ("llama.block_count", [1], r"list \[1\]"),
    ("llama.context_length", (V.INT32, -1), "int -1"),
    ("llama.context_length", 0, "int 0"),
    ("llama.attention.head_count_kv", 5, "int 5"),
    ("tokenizer.ggml.eos_token_id", "2", "str '2'"),
    ("tokenizer.ggml.eos_token_id", VOCAB, f"int {VOCAB}"),
    ("tokenizer.ggml.bos_token_id", 10**6, "int 1000000"),
])
def test_a_metadata_size_of_the_wrong_type_or_out_of_bounds_is_refused_by_key(tmp_path, key, value, shown):
    path = _write(tmp_path / "m.gguf", {key: value})
    with pytest.raises(ValueError, match=rf"metadata field '{key}' is {shown}; expected an integer from -?\d+ to \d+"):
        _config(path)


@pytest.mark.parametrize("key, value, message", [
    ("llama.attention.head_count_kv", 3, r"'llama\.attention\.head_count_kv' is 3, which does not divide "
                                         r"'llama\.attention\.head_count' 4"),
    ("llama.block_count", 2, r"'llama\.block_count' is 2, but the file's tensors hold 1 layers"),
    ("llama.feed_forward_length", 48, r"tensor 'blk\.0\.ffn_gate\.weight' has shape \(64, 32\), but the metadata "
                                      r"implies llama\.feed_forward_length \(48\) x llama\.embedding_length \(32\)"),
], ids=["kv heads that do not divide the heads", "a block count the tensors do not bear out",
        "a size the tensors do not bear out"])
def test_metadata_the_tensors_do_not_bear_out_is_refused_naming_the_key(tmp_path, key, value, message):
    path = _write(tmp_path / "m.gguf", {key: value})
    with pytest.raises(ValueError, match=message):
        _config(path)


def test_a_projection_of_the_wrong_rank_is_refused_naming_it(tmp_path):
    tensors = _tensors()
    tensors["blk.0.attn_q.weight"] = tensors["blk.0.attn_q.weight"].reshape(2, H // 2, H)
    path = _write(tmp_path / "m.gguf", tensors=tensors)
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_q\.weight' has shape \(2, 16, 32\), but the metadata "
                                         r"implies"):
        _config(path)


def test_more_tokens_than_the_table_has_rows_are_refused(tmp_path):
    path = _write(tmp_path / "m.gguf", {"llama.vocab_size": VOCAB,
                                        "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB + 1)]})
    with pytest.raises(ValueError, match=rf"'tokenizer\.ggml\.tokens' holds {VOCAB + 1} tokens, but "
                                         rf"'token_embd\.weight' has {VOCAB} rows"):
        _config(path)


@pytest.mark.parametrize("key, values", [
    ("tokenizer.ggml.token_type", [1] * (VOCAB - 10)), ("tokenizer.ggml.token_type", [1] * (VOCAB + 1)),
    ("tokenizer.ggml.scores", [0.0] * (VOCAB - 1)),
], ids=["types-short", "types-long", "scores-short"])
def test_a_per_token_list_of_another_length_than_the_tokens_is_refused_by_key(tmp_path, key, values):
    """transformers builds a tokenizer from a short token-type list without a word (the tokens past its end
    typed "normal": a control token left out is printed by skip_special_tokens), so the loader counts them."""
    path = _write(tmp_path / "m.gguf", {key: (V.ARRAY, values)})
    with pytest.raises(ValueError, match=rf"'{key}' has {len(values)} entries; 'tokenizer\.ggml\.tokens' has {VOCAB}"):
        _config(path)
    ok = _write(tmp_path / "ok.gguf", {key: (V.ARRAY, values[:1] * VOCAB)})
    assert _config(ok)["vocab_size"] == VOCAB


_TOKENS = ["a", "b", "ab", "c"] + [f"t{i}" for i in range(VOCAB - 4)]


@pytest.mark.parametrize("meta, message", [
    ({"tokenizer.ggml.merges": ["a x"]}, r"'tokenizer.ggml.merges' entry 0 \('a x'\) needs token 'x', which "
                                          r"'tokenizer.ggml.tokens' lacks"),
    ({"tokenizer.ggml.merges": ["b c"]}, r"entry 0 \('b c'\) needs token 'bc'"),  # the merge's result
    ({"tokenizer.ggml.merges": (V.ARRAY, [1, 2])}, r"'tokenizer.ggml.merges' entry 0 is int 1; each entry must be a string"),
    ({"tokenizer.ggml.merges": ["ab"]}, r"entry 0 is 'ab'; a merge is two tokens joined by one space"),
    ({"tokenizer.ggml.tokens": (V.ARRAY, list(range(VOCAB)))},
     r"'tokenizer.ggml.tokens' entry 0 is int 0; each entry must be a string"),
], ids=["merge-names-no-token", "merge-result-no-token", "merges-ints", "merge-no-space", "tokens-ints"])
def test_a_malformed_tokenizer_section_is_refused_by_its_key(tmp_path: Path, meta: dict[str, Any], message: str) -> None:
    """transformers' own errors for these name no key ("'int' object has no attribute 'split'", "Token `x`
    out of vocabulary", a bare Exception from the tokenizers library): each is a ValueError naming the
    field, its entry and what a well-formed one holds."""
    from pagedrs.tokenizer import Tokenizer

    good = _write(tmp_path / "good.gguf", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": _TOKENS,
                                           "tokenizer.ggml.merges": ["a b"]})
    assert len(Tokenizer.from_gguf(good).hf) >= VOCAB  # the well-formed section builds
    bad = _write(tmp_path / "bad.gguf", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": _TOKENS,
                                         "tokenizer.ggml.merges": ["a b"], **meta})
    with pytest.raises(ValueError, match=message) as caught:
        Tokenizer.from_gguf(bad)
    assert str(bad) in str(caught.value)


def test_a_tokenizer_transformers_cannot_build_is_a_valueerror_naming_the_file(tmp_path: Path) -> None:
    from pagedrs.tokenizer import Tokenizer

    bad = _write(tmp_path / "odd.gguf", {"tokenizer.ggml.model": "nonsense", "tokenizer.ggml.tokens": _TOKENS})
    with pytest.raises(ValueError, match=r"cannot build a tokenizer from GGUF file .*odd\.gguf.*skip_tokenizer_init"):
        Tokenizer.from_gguf(bad)
