"""The converted GGUF folder's manifest (``gguf_manifest``): a damaged cache entry is converted again, never read.

Before, a converted folder was read as it was found: a flipped byte in the float32 weights (a finite wrong
weight, or a NaN), a stray shard that the safetensors reader merged in, a config edited after the
checks ran, loaded without a word. Each case here loads, says what was wrong, and gives exactly the
weights a fresh conversion gives; a folder that cannot be set aside is refused naming it and the way
out; a disk that fills mid-write leaves nothing a later load reads.
"""

from __future__ import annotations

import errno
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from gguf_writer import write_gguf
from pagedrs.models import gguf_cache, gguf_manifest, load_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gguf")
    write_gguf(make_tiny_model("mistral", d / "hf"), d / "hf", d / "tiny.gguf")
    return d / "tiny.gguf"


@pytest.fixture(scope="module")
def reference(tiny_gguf, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The dense weights of a fresh conversion (in a cache of its own)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path_factory.mktemp("reference-cache")))
        return {k: v.clone() for k, v in load_model(tiny_gguf, weight_dtype="float32").model.state_dict().items()}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def assert_weights(loaded, reference: dict[str, torch.Tensor]) -> None:
    state = loaded.model.state_dict()
    assert state.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(state[k], v), k


def _tensor_offset(path: Path, name: str) -> int:
    """The byte offset of tensor ``name``'s data in the safetensors file at ``path``."""
    data = path.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_len])
    return 8 + header_len + header[name]["data_offsets"][0]


def _set_float(path: Path, name: str, value: float) -> None:
    data = bytearray(path.read_bytes())
    at = _tensor_offset(path, name)
    data[at:at + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(data))


def _flip_low_bit(path: Path, name: str) -> None:
    data = bytearray(path.read_bytes())
    data[_tensor_offset(path, name)] ^= 1  # the lowest mantissa bit: a finite weight, slightly wrong
    path.write_bytes(bytes(data))


def _stray_shard(folder: Path) -> None:
    """Another safetensors file beside the weights: the reader globs *.safetensors and merged its tensors in."""
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.zeros(64)}, str(folder / "zz-extra.safetensors"))


def _index_naming_a_missing_shard(folder: Path) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))


def _manifest_naming(name: str) -> Callable[[Path], None]:
    """A manifest whose entry names ``name``, a path out of the folder: hashing /dev/zero never ends."""
    def spoil(folder: Path) -> None:
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["files"][name] = {"bytes": 0, "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return spoil


def _wrong_shape(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(32)
    save_file(weights, str(folder / "model.safetensors"))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "weights cut short": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
                          "model.safetensors has 5000 bytes"),
    "a NaN weight": (lambda f: _set_float(f / "model.safetensors", "model.norm.weight", float("nan")),
                     "model.safetensors does not have the content written"),
    "a flipped bit": (lambda f: _flip_low_bit(f / "model.safetensors", "model.layers.0.mlp.down_proj.weight"),
                      "model.safetensors does not have the content written"),
    "weights of the wrong shape": (_wrong_shape, "model.safetensors has"),
    "a stray shard": (_stray_shard, "zz-extra.safetensors is not a file the conversion wrote"),
    "an index naming a missing shard": (_index_naming_a_missing_shard,
                                        "model.safetensors.index.json is not a file the conversion wrote"),
    "the config edited, its size kept": (lambda f: (f / "config.json").write_text(
        (f / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": 20000.0')),
        "config.json does not have the content written"),
    "the tokenizer gone": (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    "the index cut short": (lambda f: (f / "gguf_index.json").write_text((f / "gguf_index.json").read_text()[:100]),
                            "gguf_index.json has 100 bytes"),
    "no manifest": (lambda f: (f / "manifest.json").unlink(), "manifest.json is missing or unreadable"),
    "a manifest naming /dev/zero": (_manifest_naming("/dev/zero"), "manifest.json is missing or unreadable"),
    "a manifest naming a path out of the folder": (_manifest_naming("../hashes.json"),
                                                   "manifest.json is missing or unreadable"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_cached_conversion_is_converted_again_never_read(damage, tiny_gguf, reference, cache_dir, caplog):
    spoil, why = DAMAGE[damage]
    load_model(tiny_gguf, weight_dtype="float32")
    folder = gguf_cache.convert_gguf_cached(tiny_gguf)
    assert '"rope_theta": 10000.0' in (folder / "config.json").read_text()
    spoil(folder)
    with caplog.at_level("WARNING", logger="pagedrs.engine"):
        loaded = load_model(tiny_gguf, weight_dtype="float32")
    assert why in caplog.text and str(folder) in caplog.text, caplog.text
    assert_weights(loaded, reference)
    assert gguf_manifest.problems(folder, tiny_gguf.stat().st_size) == []  # whole again
    assert gguf_manifest.dense_problem(folder) is None
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # the damaged copy is gone
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedrs.engine"):
        assert_weights(load_model(tiny_gguf, weight_dtype="float32"), reference)
    assert caplog.text == ""  # and read from then on


def test_a_block_load_checks_the_folder_too_and_leaves_the_dense_weights_to_dense_loads(tiny_gguf, cache_dir, caplog):
    """A block-format load reads the config, tokenizer and index (checked) but never the float32 weights
    (not hashed: they may be absent, or spoiled, without harm to it); a dense load then writes them again."""
    load_model(tiny_gguf, weight_dtype="float32")
    folder = gguf_cache.convert_gguf_cached(tiny_gguf)
    _set_float(folder / "model.safetensors", "model.norm.weight", float("nan"))
    with caplog.at_level("WARNING", logger="pagedrs.engine"):
        load_model(tiny_gguf, weight_dtype="gguf")
    assert caplog.text == ""
    (folder / "tokenizer.json").write_text("{}")
    with caplog.at_level("WARNING", logger="pagedrs.engine"):
        load_model(tiny_gguf, weight_dtype="gguf")
    assert "tokenizer.json has 2 bytes" in caplog.text
    assert not (folder / "model.safetensors").exists()  # the folder was converted again, without the weights


def test_a_damaged_folder_that_cannot_be_moved_is_refused_naming_it_and_the_way_out(tiny_gguf, cache_dir, monkeypatch):
    folder = gguf_cache.convert_gguf_cached(tiny_gguf)
    (folder / "config.json").write_text("{}")
    real_rename = Path.rename

    def read_only(self, target):
        if self == folder:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", read_only)
    with pytest.raises(OSError, match=rf"the cached conversion '{folder}' is damaged \(config\.json has 2 bytes, not "
                                      rf"the \d+ written\) and could not be moved aside \(Read-only file system\); "
                                      rf"delete that folder \(rm -r '{folder}'\)"):
        load_model(tiny_gguf, weight_dtype="gguf")


def test_an_older_formats_folder_is_never_read(tiny_gguf, cache_dir):
    """Format 4 (the manifest, and the finiteness and structure checks at conversion): a folder of format 3
    for the same file, written before those checks, is not read; ``pagedrs cache --prune`` removes it."""
    from pagedrs.models.gguf_cache_admin import prune

    sha = gguf_cache.file_sha256(tiny_gguf)
    old = cache_dir / "gguf" / f"{sha}-v3"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{not read}")
    (old / "gguf_index.json").write_text("{not read}")
    assert gguf_cache._CONVERTED_FORMAT == 4
    assert gguf_cache.convert_gguf_cached(tiny_gguf).name == f"{sha}-v4"
    load_model(tiny_gguf, weight_dtype="gguf")
    assert old in prune().removed


def _full_disk_after(half_of: str):
    """A ``Path.write_text`` that writes half of the file named ``half_of`` and then finds the disk full."""
    real = Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name == half_of:
            real(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)

    return write_text


@pytest.mark.parametrize("file", ["config.json", "gguf_index.json"])
def test_a_disk_that_fills_while_converting_leaves_no_entry(file, tiny_gguf, reference, cache_dir, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", _full_disk_after(file))
        with pytest.raises(OSError, match=r"cannot write the converted GGUF folder under .* \(No space left on "
                                          r"device\); set PAGEDRS_CACHE_DIR to a writable folder"):
            load_model(tiny_gguf, weight_dtype="float32")
    assert list((cache_dir / "gguf").iterdir()) == []  # no folder, no staging left
    assert_weights(load_model(tiny_gguf, weight_dtype="float32"), reference)


def test_a_disk_that_fills_while_writing_the_weights_leaves_none_a_later_load_reads(tiny_gguf, reference, cache_dir,
                                                                                      monkeypatch, caplog):
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def half_then_full(tensors, filename, *args, **kwargs):
        real_save(tensors, filename, *args, **kwargs)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    folder = gguf_cache.convert_gguf_cached(tiny_gguf)
    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", half_then_full)
        with pytest.raises(OSError, match=r"cannot write the converted GGUF folder .* \(No space left on device\)"):
            load_model(tiny_gguf, weight_dtype="float32")
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.suffix == ".safetensors") == []
    # the weights are written, then the manifest update finds the disk full: this load reads what it wrote
    real_atomic = gguf_cache._atomic_write_text

    def manifest_on_a_full_disk(path: Path, text: str) -> None:
        if path.name != "manifest.json":
            return real_atomic(path, text)
        with gguf_cache._replacing(path) as tmp:  # half the temporary file, then the disk is full
            tmp.write_text(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_cache, "_atomic_write_text", manifest_on_a_full_disk)
        with caplog.at_level("WARNING", logger="pagedrs.engine"):
            assert_weights(load_model(tiny_gguf, weight_dtype="float32"), reference)
    assert "model.safetensors could not be recorded in the manifest" in caplog.text
    assert gguf_manifest.dense_problem(folder) == "model.safetensors is not recorded in manifest.json"
    assert gguf_manifest.problems(folder, tiny_gguf.stat().st_size) == []  # the rest of the folder is whole
    _set_float(folder / "model.safetensors", "model.norm.weight", 7.0)  # unrecorded weights are never trusted
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedrs.engine"):
        assert_weights(load_model(tiny_gguf, weight_dtype="float32"), reference)
    assert "model.safetensors is not recorded in manifest.json; writing the float32 weights again" in caplog.text
    assert gguf_manifest.dense_problem(folder) is None
