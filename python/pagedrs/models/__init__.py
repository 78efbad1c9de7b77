"""Models: one Llama-family decoder for paged execution, the interface the runner sees (KvModel), and the loaders."""

from pagedrs.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pagedrs.models.interface import KvModel
from pagedrs.models.llama import LlamaForCausalLM
from pagedrs.models.loader import EMBEDDED_MODEL_NAME, LoadedModel, embedded_model_path, load_model

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "SUPPORTED_MODEL_TYPES",
    "KvModel",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "embedded_model_path",
    "load_model",
]
