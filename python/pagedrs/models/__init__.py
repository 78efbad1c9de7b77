"""Models: one Llama-family decoder for paged execution, and the loaders that build it."""

from pagedrs.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pagedrs.models.llama import LlamaForCausalLM
from pagedrs.models.loader import EMBEDDED_MODEL_NAME, LoadedModel, embedded_model_path, load_model

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "SUPPORTED_MODEL_TYPES",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "embedded_model_path",
    "load_model",
]
