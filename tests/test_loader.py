"""Loading: HF folders, GGUF (dequantization, Q/K unpermute, the converted-weights cache) and every error."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from gguf_writer import write_gguf
from pagedrs.models import ModelConfig, gguf_cache, gguf_loader, load_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny untied llama written as GGUF with F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors."""
    d = tmp_path_factory.mktemp("gguf")
    model = make_tiny_model("mistral", d / "hf")
    write_gguf(model, d / "hf", d / "tiny.gguf")
    return d / "tiny.gguf"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDRS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _vouch_for(folder: Path, gguf: Path) -> None:
    """Writes the converted folder's manifest again after a test edited a file in it: the checks that come
    after the manifest's must hold on their own (a folder whose manifest vouches for what it holds)."""
    from pagedrs.models.gguf_manifest import seal

    seal(folder, gguf.stat().st_size, gguf_cache._atomic_write_text)


def _copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_gguf_logits_match_transformers_reading_the_same_file(tiny_gguf, cache_dir):
    from transformers import AutoModelForCausalLM

    from paged_driver import BlockPool, PagedSeq, build_step
    from pagedrs.model_runner import ModelRunner

    loaded = load_model(tiny_gguf, weight_dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name).eval()
    prompt = [5, 9, 17, 33, 65, 129, 250]
    runner = ModelRunner(loaded, num_gpu_blocks=8, num_cpu_blocks=0, block_size=4)
    got = runner.execute(build_step([PagedSeq(prompt)], [len(prompt)], 4, BlockPool(8)))[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert (got - ref).abs().max().item() <= 1e-4
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("lazy dog", add_special_tokens=False)) == "lazy dog"


def test_gguf_cache_is_written_then_used(tiny_gguf, cache_dir, monkeypatch):
    first = load_model(tiny_gguf)
    sha = gguf_cache.file_sha256(tiny_gguf)
    folders = list((cache_dir / "gguf").iterdir())
    assert [f.name for f in folders] == [f"{sha}-v{gguf_cache._CONVERTED_FORMAT}"]
    assert (folders[0] / "model.safetensors").is_file() and (folders[0] / "tokenizer.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("second load converted the GGUF again instead of reading the cache")

    monkeypatch.setattr(gguf_cache, "convert_gguf", no_conversion)
    second = load_model(tiny_gguf)
    for (k, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        permuted = gguf_loader.permute_qk(w, heads)
        assert not torch.equal(permuted, w)
        assert torch.equal(gguf_loader.unpermute_qk(permuted, heads), w)


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model.*does not exist.*never downloads"):
        load_model(missing)


def test_folder_without_weights(tiny_llama_dir, tmp_path):
    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has no weights: expected \*\.safetensors"):
        load_model(folder)


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(tmp_path / "empty")


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"safetensors file '.*model\.safetensors' is truncated or corrupt"):
        load_model(folder)


def test_a_tensor_in_two_files_is_refused_not_overridden(tiny_llama_dir, tmp_path):
    """A stray file beside the weights holding a tensor of the same name (an older download, a
    fine-tune's delta): the later file's copy replaced the earlier one without a word, so the model ran
    weights nobody chose. Now refused, naming the tensor and both files."""
    from safetensors.torch import load_file, save_file

    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    name = sorted(state)[0]
    save_file({name: torch.zeros_like(state[name])}, str(folder / "zz-stray.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(name)}' is in both 'model.safetensors' and "
                                         r"'zz-stray.safetensors'"):
        load_model(folder)


def test_sharded_safetensors_with_index(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_model(folder)
    whole = load_model(tiny_llama_dir)
    for a, b in zip(sharded.model.state_dict().values(), whole.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="lists shards that do not exist.*00002-of-00002"):
        load_model(folder)


def test_shapes_not_matching_config(tiny_llama_dir, tmp_path):
    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' .* has shape .*implies"):
        load_model(folder)


def test_unsupported_model_type(tiny_llama_dir, tmp_path):
    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: llama, mistral, qwen2"):
        load_model(folder)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(ValueError, match=r"bad\.gguf' is not a GGUF file .*b'NOPE'"):
        load_model(bad)


def test_truncated_gguf(tiny_gguf, tmp_path, cache_dir):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size - 1000])
    with pytest.raises(ValueError, match=r"GGUF file '.*cut\.gguf' is truncated or corrupt"):
        load_model(cut)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype 'int8' is not supported; allowed: float32, bfloat16, float16"):
        load_model("smollm2-135m", dtype="int8")


def test_embedded_model_config(smollm2):
    c = smollm2.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_key_value_heads) == ("llama", 30, 576, 3)
    assert c.tie_word_embeddings and smollm2.name == "smollm2-135m"
    assert c.kv_bytes_per_token("float16") == 2 * 30 * 3 * 64 * 2


def test_kv_bytes_per_token():
    c = ModelConfig.from_hf_dict(
        {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    )
    assert c.head_dim == 16
    assert c.kv_bytes_per_token(torch.float32) == 2 * 3 * 2 * 16 * 4
    assert c.kv_bytes_per_token("bfloat16") == 2 * 3 * 2 * 16 * 2


def test_the_converted_folders_tensor_index_places_every_tensor_as_the_reader_does(tiny_gguf, cache_dir, monkeypatch):
    """A warm load reads the tensors' places from the converted folder's index (parsing the file again
    cost seconds: gguf-py reads a tokenizer's strings one by one). The index's bytes are the reader's,
    every tensor; a broken or inconsistent index is parsed again from the file; a file cut short is
    refused by name."""
    import gguf
    import numpy as np

    folder = gguf_cache.convert_gguf_cached(tiny_gguf)
    index = gguf_loader.tensor_index(tiny_gguf, folder)
    reader = gguf.GGUFReader(str(tiny_gguf))
    assert [t["name"] for t in index["tensors"]] == [t.name for t in reader.tensors]
    for entry, t in zip(index["tensors"], reader.tensors, strict=True):
        placed = np.memmap(tiny_gguf, dtype=np.uint8, mode="r", offset=entry["offset"], shape=(entry["bytes"],))
        np.testing.assert_array_equal(placed, np.asarray(t.data).view(np.uint8).reshape(-1))
        assert entry["type"] == t.tensor_type.name and entry["shape"] == list(reversed(t.shape.tolist()))
    # a warm load never parses the file: the index is enough
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda path: pytest.fail("the file was parsed again"))
    config = json.loads((folder / "config.json").read_text())
    raw = gguf_loader.gguf_raw_linears(tiny_gguf, config, index)
    assert {kind for _, _, kind in raw.values()} == {"Q8_0", "Q4_0", "Q4_1"}
    load_model(tiny_gguf, weight_dtype="gguf")
    monkeypatch.undo()
    (folder / "gguf_index.json").write_text("{not json")
    assert gguf_loader.tensor_index(tiny_gguf, folder) == index  # parsed from the file instead
    # an index that does not add up (bytes that are not its type's for its shape, a missing field) neither
    for spoil in (lambda t: t.update(bytes=t["bytes"] + 1), lambda t: t.pop("offset"), lambda t: t.update(type="Q9_9")):
        bad = json.loads(json.dumps(index))
        spoil(bad["tensors"][3])
        (folder / "gguf_index.json").write_text(json.dumps(bad))
        assert gguf_loader.tensor_index(tiny_gguf, folder) == index
    cut = cache_dir / "cut.gguf"
    last = max((t for t in index["tensors"] if t["type"] in ("Q8_0", "Q4_0", "Q4_1")), key=lambda t: t["offset"])
    cut.write_bytes(tiny_gguf.read_bytes()[: last["offset"] + last["bytes"] // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf' is truncated or corrupt: tensor '.*' needs bytes"):
        gguf_loader.gguf_raw_linears(cut, config, index)


def _last_logits(loaded, prompt: list[int]) -> torch.Tensor:
    from paged_driver import BlockPool, PagedSeq, build_step
    from pagedrs.model_runner import ModelRunner

    runner = ModelRunner(loaded, num_gpu_blocks=8, num_cpu_blocks=0, block_size=4)
    return runner.execute(build_step([PagedSeq(prompt)], [len(prompt)], 4, BlockPool(8)))[0]


@pytest.mark.parametrize("source", ["tiny", "smollm2"])
def test_a_block_load_dequantizes_only_what_no_matrix_took(source, tiny_gguf, smollm2_path, cache_dir, monkeypatch):
    """``weight_dtype="gguf"`` packs the kernel's matrices from the file's blocks before reading any weight,
    so no product the kernel runs is ever dequantized (a float32 copy of each took 4 bytes a weight of
    memory during the load, and of disk in the cache); the tensors it does dequantize are the rest (norms,
    the embedding's lookup table, products in a float type), and the model computes what the old order
    (everything dense first, then the matrices swapped in) computed, bit for bit. Both files: the tiny one
    (untied; Q/K rows permuted; F32, F16 and BF16 products beside Q4_0, Q4_1 and Q8_0), SmolLM2 (tied)."""
    from pagedrs.models.embedding import BlockEmbedding
    from pagedrs.models.gguf_linear import install_gguf_weights
    from pagedrs.models.gguf_loader import gguf_raw_linears, tensor_index
    from pagedrs.models.loader import load_hf_folder

    path = tiny_gguf if source == "tiny" else smollm2_path
    dequantized: list[str] = []
    real = gguf_loader.gguf_tensors

    def recording(*args, **kwargs):
        for name, tensor in real(*args, **kwargs):
            dequantized.append(name)
            yield name, tensor

    with monkeypatch.context() as patch:
        patch.setattr(gguf_loader, "gguf_tensors", recording)
        loaded = load_model(path, weight_dtype="gguf")
    folder = gguf_cache.convert_gguf_cached(path)
    assert not (folder / "model.safetensors").exists()  # no float32 copy on disk either
    shapes = gguf_loader.gguf_checkpoint_shapes(path, tensor_index(path, folder))
    matrices = {n: m.gguf_matrix.name for n, m in loaded.model.named_modules() if getattr(m, "gguf_matrix", None)}
    from_blocks = {part for name in matrices.values() for part in name.split("+")}
    table = loaded.model.model.embed_tokens
    if isinstance(table, BlockEmbedding):  # a quantized table is looked up from its blocks
        from_blocks.add("model.embed_tokens.weight")
    else:
        from_blocks.discard("model.embed_tokens.weight")
    assert from_blocks and len(dequantized) == len(set(dequantized))
    assert not [n for n, p in loaded.model.named_parameters() if p.is_meta]  # every staged weight that loads got storage
    assert set(dequantized) == set(shapes) - from_blocks
    if source == "tiny":  # the float-typed products were read dense, and their layers kept a float32 weight
        dense_products = [n for n in dequantized if n.endswith("proj.weight")]
        assert dense_products
    else:  # every product is a matrix and the table is Q8_0: only the norms
        assert isinstance(table, BlockEmbedding) and table.qtype == "Q8_0"
        assert set(dequantized) == {n for n in shapes if n.endswith("norm.weight")}

    # the old order: every tensor dense (the float32 file), then the matrices installed over the layers
    config = json.loads((folder / "config.json").read_text())
    old = load_hf_folder(gguf_cache.convert_gguf_cached(path, dense_weights=True), torch.float32, torch.device("cpu"),
                         name="old", weight_format=loaded.weight_format)
    install_gguf_weights(old.model, gguf_raw_linears(path, config), tied=old.config.tie_word_embeddings)
    old.model.bind()
    prompt = [5, 9, 17, 33, 65, 129, 250]
    assert torch.equal(_last_logits(loaded, prompt), _last_logits(old, prompt))
    every_row = torch.arange(loaded.config.vocab_size)
    assert torch.equal(loaded.model._embed(every_row), old.model.model.embed_tokens.weight)  # the table's floats


def test_the_float32_weights_are_written_once_on_the_first_dense_load(tiny_gguf, cache_dir, monkeypatch):
    """The converted folder holds float32 weights only once a load wants them dense; later dense loads read
    them (no second write), a file cut short is written again, and what they hold is what the file's
    tensors dequantize to."""
    from safetensors.torch import load_file

    load_model(tiny_gguf, weight_dtype="gguf")
    folder = gguf_cache.convert_gguf_cached(tiny_gguf)
    assert not (folder / "model.safetensors").exists()
    first = load_model(tiny_gguf, weight_dtype="float32")
    assert (folder / "model.safetensors").is_file()
    assert [f.name for f in folder.iterdir() if f.name.startswith(".")] == []  # no temporary file left behind
    with monkeypatch.context() as patch:
        patch.setattr(gguf_cache, "_write_dense_weights", lambda *a: pytest.fail("the weights were written again"))
        second = load_model(tiny_gguf, weight_dtype="float32")
    for (k, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # cut short (a copy that failed, a disk that filled): written again
    assert torch.equal(load_model(tiny_gguf, weight_dtype="float32").model.model.norm.weight, first.model.model.norm.weight)
    assert weights.read_bytes() == whole
    config = json.loads((folder / "config.json").read_text())
    index = gguf_loader.tensor_index(tiny_gguf, folder)
    written = load_file(str(folder / "model.safetensors"))
    streamed = dict(gguf_loader.gguf_tensors(tiny_gguf, index, config))
    assert written.keys() == streamed.keys()
    assert all(torch.equal(written[k], streamed[k]) for k in written)


def test_a_block_loads_tensors_are_checked_against_the_config_before_any_is_read(tmp_path, cache_dir):
    """Tensors a block-format load takes from the file's blocks (the products, a quantized embedding table)
    are checked against the config like every other: an embedding of another vocabulary size is refused
    naming it, before a matrix is packed (it used to surface only as a token refused at a later step)."""
    import gguf

    from gguf_writer import KERNEL_QTYPES

    model = make_tiny_model("mistral", tmp_path / "hf")
    path = tmp_path / "q8_table.gguf"
    write_gguf(model, tmp_path / "hf", path, qtypes={**KERNEL_QTYPES, "token_embd": gguf.GGMLQuantizationType.Q8_0})
    table = load_model(path, weight_dtype="gguf").model.model.embed_tokens
    assert type(table).__name__ == "BlockEmbedding" and table.head is None  # an untied head: the table keeps its blocks
    folder = gguf_cache.convert_gguf_cached(path)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] += 1
    (folder / "config.json").write_text(json.dumps(config))
    _vouch_for(folder, path)
    with pytest.raises(ValueError, match=r"tensor 'model\.embed_tokens\.weight' in .*q8_table\.gguf has shape \(300, 64\), but config\.json implies \(301, 64\)"):
        load_model(path, weight_dtype="gguf")


def test_auto_on_a_folder_keeps_float32_and_says_a_block_format_is_faster(tiny_llama_dir, monkeypatch, caplog):
    """``auto`` never quantizes a Hugging Face folder (the numbers stay its weights'), but on a CPU the kernel
    runs on it says, once, that q8_0 / q4_1 would decode several times faster; an explicit choice is not
    second-guessed, nor a CPU without the kernel."""
    from pagedrs.models import gguf_linear

    monkeypatch.setattr(gguf_linear, "cpu_runs_gguf_kernel", lambda: True)
    with caplog.at_level("INFO", logger="pagedrs.engine"):
        assert load_model(tiny_llama_dir).weight_format.name == "float32"
    assert [r.getMessage().count("weight_dtype 'q8_0'") for r in caplog.records] == [1]
    caplog.clear()
    with caplog.at_level("INFO", logger="pagedrs.engine"):
        load_model(tiny_llama_dir, weight_dtype="float32")
        monkeypatch.setattr(gguf_linear, "cpu_runs_gguf_kernel", lambda: False)
        load_model(tiny_llama_dir)
    assert "q8_0" not in caplog.text


def test_a_cache_that_cannot_be_written_is_named_with_the_way_out(tiny_gguf, cache_dir, monkeypatch):
    """A full disk or a read-only home while a GGUF is first converted: an error naming the cache folder and
    PAGEDRS_CACHE_DIR (not a bare errno from deep inside), no half-written folder left; the hash not being
    remembered loses only that saving."""
    import errno

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_cache.tempfile, "mkdtemp", read_only)
        patch.setattr(gguf_cache, "_atomic_write_text", read_only)
        with pytest.raises(OSError, match=r"cannot write the converted GGUF folder under '.*cache' \(Read-only file "
                                          r"system\); set PAGEDRS_CACHE_DIR to a writable folder"):
            load_model(tiny_gguf, weight_dtype="gguf")
    assert not list((cache_dir / "gguf").glob("*"))
    assert load_model(tiny_gguf, weight_dtype="gguf").weight_format.name == "gguf"  # writable again: loads


def test_gguf_staged_weights_have_no_storage_and_cannot_be_filled_by_mistake():
    """Under "gguf" the products' float32 weights and the lookup table are shapes on the meta device until a
    load knows which of them load dense (an 8B model's would be 32 GB of address space a host with strict
    overcommit refuses); a copy into one would do nothing without a word, so the weight loaders refuse it."""
    from pagedrs.models.layers import LinearBase
    from pagedrs.models.llama import LlamaForCausalLM, default_weight_loader
    from pagedrs.models.quant import WeightFormat

    config = ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
                                       "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                                       "num_key_value_heads": 1})
    model = LlamaForCausalLM(config, device="cpu", weight_format=WeightFormat("gguf", torch.float32))
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.is_meta for m in linears) and model.model.embed_tokens.weight.is_meta
    o_proj = model.model.layers[0].self_attn.o_proj
    with pytest.raises(RuntimeError, match=r"RowParallelLinear \(in=64, out=64\) has no storage for its weight"):
        o_proj.weight_loader(o_proj.weight, torch.zeros(64, 64))
    with pytest.raises(RuntimeError, match=r"no storage \(staged on the meta device\)"):
        default_weight_loader(model.model.embed_tokens.weight, torch.zeros(64, 64))


def test_a_tensor_name_that_would_make_a_path_is_refused_before_anything_is_written(tiny_gguf, cache_dir):
    """A GGUF tensor's name becomes part of a kept conversion's file name; one whose layer part holds a slash
    (``blk./x.attn_q.weight``) has no place in the architecture and is refused by the shape check, which runs
    before any matrix is packed or any file kept."""
    folder = gguf_cache.convert_gguf_cached(tiny_gguf)
    index = json.loads((folder / "gguf_index.json").read_text())
    extra = dict(next(t for t in index["tensors"] if t["name"] == "blk.0.attn_q.weight"), name="blk./x.attn_q.weight")
    index["tensors"].append(extra)  # the same bytes again, under the name
    (folder / "gguf_index.json").write_text(json.dumps(index))
    _vouch_for(folder, tiny_gguf)
    with pytest.raises(ValueError, match=r"hold tensors this architecture has no place for, e\.g\. "
                                         r"\['model\.layers\./x\.self_attn\.q_proj\.weight'\]"):
        load_model(tiny_gguf, weight_dtype="gguf")
    assert not (folder / "converted").exists() and not (folder / "model.layers.").exists()


def test_a_tied_q6_k_table_is_read_from_the_heads_matrix(tmp_path, cache_dir, monkeypatch):
    """A tied head in Q6_K (llama.cpp's type for a K-quant mix's table that is also the head): the lookup reads
    the head's tiles (the table's bytes held once), and the model computes bit for bit what it computed with
    a copy of the table's blocks for the lookup, every row of the table included."""
    import gguf

    from gguf_writer import KERNEL_QTYPES
    from pagedrs.models import loader

    model = make_tiny_model("llama", tmp_path / "hf", hidden_size=256, intermediate_size=512, head_dim=64,
                            tie_word_embeddings=True)
    path = tmp_path / "tied_q6_k.gguf"
    write_gguf(model, tmp_path / "hf", path, qtypes={**KERNEL_QTYPES, "token_embd": gguf.GGMLQuantizationType.Q6_K})
    shared = load_model(path, weight_dtype="gguf")
    table = shared.model.model.embed_tokens
    assert table.qtype == "Q6_K" and table.head is shared.model.lm_head.gguf_matrix and table.weight_bytes() == 0
    with monkeypatch.context() as patch:
        patch.setattr(loader, "_shared_head", lambda *args: None)
        copied = load_model(path, weight_dtype="gguf")
    assert copied.model.model.embed_tokens.head is None and copied.model.model.embed_tokens.weight_bytes() > 0
    every_row = torch.arange(shared.config.vocab_size)
    assert torch.equal(shared.model._embed(every_row), copied.model._embed(every_row))
    prompt = [5, 9, 17, 33, 65, 129, 250]
    assert torch.equal(_last_logits(shared, prompt), _last_logits(copied, prompt))


@pytest.fixture(scope="module")
def kernel_gguf(tmp_path_factory) -> Path:
    """A tiny untied llama in the kernel's formats (attn_q Q8_0), its table in Q8_0 and its head and norms F32."""
    import gguf

    from gguf_writer import KERNEL_QTYPES

    d = tmp_path_factory.mktemp("kernel_gguf")
    model = make_tiny_model("mistral", d / "hf")
    write_gguf(model, d / "hf", d / "kernel.gguf", qtypes={**KERNEL_QTYPES, "token_embd": gguf.GGMLQuantizationType.Q8_0})
    return d / "kernel.gguf"


def _poke(src: Path, dst: Path, tensor: str, at: int, value: bytes) -> Path:
    """A copy of GGUF ``src`` at ``dst`` with ``value`` written ``at`` bytes into ``tensor``'s data."""
    index = gguf_loader._tensor_index(gguf_loader.open_gguf(src))
    (t,) = [t for t in index["tensors"] if t["name"] == tensor]
    data = bytearray(src.read_bytes())
    data[t["offset"] + at:t["offset"] + at + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


_NAN16, _INF32 = bytes.fromhex("007e"), bytes.fromhex("0000807f")


@pytest.mark.parametrize("weight_dtype", ["float32", "int8"])
def test_a_non_finite_block_scale_is_refused_by_name_before_the_dense_cache_is_written(
        weight_dtype, kernel_gguf, tmp_path, cache_dir):
    """A NaN f16 scale in one Q8_0 block of attn_q (a fuzzed file): a dense load refuses it naming the tensor,
    the row and column and the block, and leaves no float32 copy in the cache for a later load to trust (it
    used to load, and every logit was NaN: greedy returned token 0)."""
    row_bytes = 64 // 32 * 34
    path = _poke(kernel_gguf, tmp_path / "nan_scale.gguf", "blk.0.attn_q.weight", 2 * row_bytes + 34, _NAN16)
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.attn_q\.weight' in '.*nan_scale\.gguf' holds nan at "
                                         r"row 2, column 32 \(Q8_0 block 1 of that row"):
        load_model(path, weight_dtype=weight_dtype)
    assert not list(cache_dir.glob("gguf/*/model.safetensors"))
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.attn_q\.weight' .* holds nan"):
        load_model(path, weight_dtype=weight_dtype)  # and again: nothing was kept


@pytest.mark.parametrize("weight_dtype", ["float32", "gguf"])
@pytest.mark.parametrize("tensor,at,where", [("output_norm.weight", 3 * 4, "index 3"),
                                             ("blk.1.ffn_norm.weight", 0, "index 0"),
                                             ("output.weight", (100 * 64 + 5) * 4, "row 100, column 5")])
def test_a_non_finite_float_weight_is_refused_by_name(weight_dtype, tensor, at, where, kernel_gguf, tmp_path, cache_dir):
    """An infinite F32 norm or head value: refused naming the tensor and its place, by the dense formats and
    by a block-format load (whose norms and float head stay in torch) alike."""
    path = _poke(kernel_gguf, tmp_path / "inf.gguf", tensor, at, _INF32)
    with pytest.raises(ValueError, match=rf"GGUF tensor '{re.escape(tensor)}' in '.*inf\.gguf' holds inf at {where};"):
        load_model(path, weight_dtype=weight_dtype)


def test_a_non_finite_scale_in_a_block_token_table_is_refused_at_load(kernel_gguf, tmp_path, cache_dir):
    """A NaN scale in the Q8_0 token table a block-format load keeps in its blocks: refused at load naming the
    table and the token (it used to load and fail only when that token was looked up, blaming q_proj)."""
    path = _poke(kernel_gguf, tmp_path / "nan_table.gguf", "token_embd.weight", 9 * (64 // 32 * 34) + 34, _NAN16)
    with pytest.raises(ValueError, match=r"GGUF tensor 'token_embd\.weight': Q8_0 d of row 9 \(token 9\), block 1 is nan"):
        load_model(path, weight_dtype="gguf")


def test_a_non_finite_scale_in_a_tied_table_read_from_the_heads_tiles_is_refused_at_load(tmp_path, cache_dir):
    """A tied Q8_0 table whose lookup reads the head's tiles (``BlockEmbedding.of_head``): the head's matrix
    refuses the NaN scale when it is packed, naming the tensor, the row and the block."""
    import gguf

    from gguf_writer import KERNEL_QTYPES

    model = make_tiny_model("mistral", tmp_path / "hf", tie_word_embeddings=True)
    write_gguf(model, tmp_path / "hf", tmp_path / "tied.gguf", qtypes={**KERNEL_QTYPES, "token_embd": gguf.GGMLQuantizationType.Q8_0})
    assert type(load_model(tmp_path / "tied.gguf", weight_dtype="gguf").model.model.embed_tokens.head).__name__ == "GgufMatrix"
    path = _poke(tmp_path / "tied.gguf", tmp_path / "tied_nan.gguf", "token_embd.weight", 7 * (64 // 32 * 34) + 34, _NAN16)
    with pytest.raises(ValueError, match=r"tensor \"model\.embed_tokens\.weight\": scale field \"d\" of row 7, block 1 is "
                                         r"not finite"):
        load_model(path, weight_dtype="gguf")


_BASE_CONFIG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("fields,message", [
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps=nan must be a finite number >= 0"),
    ({"rms_norm_eps": -1.0}, r"rms_norm_eps=-1\.0 must be a finite number >= 0"),
    ({"rms_norm_eps": float("inf")}, r"rms_norm_eps=inf must be"),
    ({"rope_theta": 0.0}, r"rope_theta=0\.0 must be a positive finite number"),
    ({"rope_theta": float("nan")}, r"rope_theta=nan must be"),
    ({"rope_theta": -10000.0}, r"rope_theta=-10000\.0 must be"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, r"rope_theta=inf must be"),
    ({"max_position_embeddings": -1}, r"max_position_embeddings=-1 must be a positive integer"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings=0 must be a positive integer"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, r"rope_scaling\['factor'\]=0\.0 must be a positive finite number for rope_type 'linear'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("nan")}}, r"rope_scaling\['factor'\]=nan must be"),
    ({"rope_scaling": {"type": "linear"}}, r"rope_scaling\['factor'\]=None must be a positive finite number for rope_type 'linear' \(it is missing\)"),
    ({"rope_scaling": {**_LLAMA3, "low_freq_factor": -1.0}}, r"rope_scaling\['low_freq_factor'\]=-1\.0 must be .* rope_type 'llama3'"),
    ({"rope_scaling": {**_LLAMA3, "high_freq_factor": float("inf")}}, r"rope_scaling\['high_freq_factor'\]=inf must be"),
    ({"rope_scaling": {k: v for k, v in _LLAMA3.items() if k != "original_max_position_embeddings"}},
     r"rope_scaling\['original_max_position_embeddings'\]=None must be .* \(it is missing\)"),
    ({"rope_scaling": {"rope_type": "freq_factors", "freq_factors": [1.0, float("inf"), 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}},
     r"freq_factors is 'a list of 8'; it must be a list of head_dim / 2 = 8 positive finite numbers"),
    ({"rope_scaling": ["linear", 2.0]}, r"rope_scaling=\['linear', 2\.0\] must be an object"),
])
def test_config_numbers_that_make_the_math_non_finite_are_refused_by_name(fields, message):
    """A NaN, infinite or negative norm epsilon, a RoPE base or scaling factor that is not positive and finite,
    a context of no positions: each made every logit NaN (or failed at a later step) and is refused naming the
    field; what transformers accepts still loads."""
    with pytest.raises(ValueError, match=rf"config field {message}" if "freq_factors is" not in message else message):
        ModelConfig.from_hf_dict({**_BASE_CONFIG, **fields})
    for ok in ({"rms_norm_eps": 0.0}, {"rope_scaling": {"rope_type": "linear", "factor": 0.5}},
               {"rope_scaling": _LLAMA3}, {"max_position_embeddings": 1}, {"rope_theta": 1e-3}):
        ModelConfig.from_hf_dict({**_BASE_CONFIG, **ok})


@pytest.mark.parametrize("fields, message", [
    ({"rope_parameters": {**_LLAMA3, "rope_theta": 5e5}, "rope_scaling": {**_LLAMA3, "factor": 2.0}},
     r"rope_parameters=.* and rope_scaling=.*: they disagree"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": {"type": "linear", "factor": 2.0}},
     r"rope_parameters=.* and rope_scaling=.*: they disagree"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": 1e4},
     r"rope_parameters.rope_theta=500000.0 and rope_theta=10000.0: they disagree"),
])
def test_rope_parameters_and_the_older_rope_fields_that_disagree_are_refused(fields, message):
    """transformers 5's rope_parameters beside a top-level rope_scaling (or rope_theta) saying otherwise: pagedrs
    read rope_parameters, the transformers installed read rope_scaling, and the tokens differed."""
    with pytest.raises(ValueError, match=message + ", and which one transformers uses depends on its version"):
        ModelConfig.from_hf_dict({**_BASE_CONFIG, **fields})
    agreeing = [{"rope_parameters": {**_LLAMA3, "rope_theta": 5e5}, "rope_scaling": dict(_LLAMA3), "rope_theta": 5e5},
                {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": None},
                {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": {"rope_type": "default"}},
                {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                 "rope_scaling": {"type": "linear", "factor": 2}}]
    for fields in agreeing:
        config = ModelConfig.from_hf_dict({**_BASE_CONFIG, **fields})
        assert config.rope_theta == fields["rope_parameters"]["rope_theta"]
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("eps, message", [
    # not a finite number: the metadata reader refuses it, naming the file and the key
    (float("nan"), r"nan_eps\.gguf': metadata field 'llama\.attention\.layer_norm_rms_epsilon' is float nan; "
                   r"expected a finite number"),
    # finite but out of range: ModelConfig refuses it, naming the config field and the key
    (-1.0, r"config field rms_norm_eps=-1\.0 must be a finite number >= 0 \(a GGUF file's metadata key "
           r"llama\.attention\.layer_norm_rms_epsilon\)"),
])
def test_gguf_metadata_that_makes_the_math_non_finite_is_refused_naming_its_key(tmp_path, cache_dir, eps, message):
    """A GGUF's config comes from its metadata: a NaN or negative rms epsilon is refused naming the key."""
    model = make_tiny_model("mistral", tmp_path / "hf")
    model.config.rms_norm_eps = eps
    write_gguf(model, tmp_path / "hf", tmp_path / "nan_eps.gguf")
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path / "nan_eps.gguf", weight_dtype="float32")


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", 2**31, r"hold 2 layers \(model\.layers\.N\), but the config's num_hidden_layers is 2147483648"),
    ("intermediate_size", 2**40, r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' .* has shape .*implies"),
])
def test_a_config_the_weights_do_not_bear_out_is_refused_before_a_model_is_built(tiny_llama_dir, tmp_path,
                                                                                field, value, message):
    """The checkpoint is checked against the config before any model is sized from it: a config of 2**31
    layers used to build them all (a hang), one of a 2**40-wide MLP to allocate it, before the check."""
    folder = _copy_folder(tiny_llama_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(folder)


def test_a_block_load_checks_the_cached_config_before_building_the_model(tiny_gguf, cache_dir):
    """The same on the block-format path: a converted folder's config of 2**31 layers is refused by the
    shape check, not built."""
    folder = gguf_cache.convert_gguf_cached(tiny_gguf)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 2**31
    (folder / "config.json").write_text(json.dumps(config))
    _vouch_for(folder, tiny_gguf)
    with pytest.raises(ValueError, match=r"hold 2 layers \(model\.layers\.N\), but the config's num_hidden_layers"):
        load_model(tiny_gguf, weight_dtype="gguf")


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_bfloat16_weights_on_a_cpu_without_fast_bf16_run_float32_and_say_so(tiny_llama_dir, monkeypatch, caplog, fast_bf16):
    """A documented fallback (emulated bf16 GEMMs are slower than float32's), but it was silent: the load now
    warns naming weight_dtype and what runs, and the loaded model's weight format says float32."""
    import logging

    from pagedrs.models import quant

    monkeypatch.setattr(quant, "cpu_has_fast_bf16", lambda: fast_bf16)
    with caplog.at_level(logging.WARNING, logger="pagedrs.engine"):
        loaded = load_model(tiny_llama_dir, weight_dtype="bfloat16")
    said = [r.getMessage() for r in caplog.records if "weight_dtype 'bfloat16'" in r.getMessage()]
    linear = {p.dtype for name, p in loaded.model.named_parameters() if name.endswith("qkv_proj.weight")}
    if fast_bf16:
        assert not said and loaded.weight_format.name == "bfloat16" and linear == {torch.bfloat16}
        return
    assert len(said) == 1 and "no fast bf16" in said[0] and "run as float32 instead" in said[0], said
    assert loaded.weight_format.name == "float32" and linear == {torch.float32}
    from pagedrs import Engine, EngineArgs

    weights = {}
    for weight_dtype in ("bfloat16", "float32"):
        engine = Engine(EngineArgs(model=str(tiny_llama_dir), weight_dtype=weight_dtype, num_gpu_blocks=8, max_model_len=64))
        weights[weight_dtype] = (engine.loaded.weight_format.name, engine.stats()["memory_weights_bytes"])
        engine.shutdown()
    assert weights["bfloat16"] == weights["float32"], "the engine reports the float32 weights that run"
