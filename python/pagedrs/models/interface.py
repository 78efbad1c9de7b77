"""What the runner and the executors need from a model, as one Protocol (``LlamaForCausalLM`` implements it).

The model owns its KV layout: the runner allocates ``kv_cache_shape(...)`` once per tier and
hands the forward pass the per-layer views ``kv_layer_views`` makes of it, and the executor
sizes the pools by ``kv_heads_per_rank`` (a tensor-parallel rank stores only its KV heads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from pagedrs.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from pagedrs.step_input import StepInput


class KvModel(Protocol):
    """A decoder that runs one flat batch of tokens over a paged KV cache."""

    @property
    def heads_per_rank(self) -> int:
        """Attention (query) heads this tensor-parallel rank computes."""
        ...

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads this tensor-parallel rank stores (all of them with one rank)."""
        ...

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape of one tier's KV tensor of ``num_blocks`` blocks; dim 2 indexes the block."""
        ...

    def kv_layer_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(key cache, value cache) of each layer: views into a ``kv_cache_shape`` tensor."""
        ...

    def uses_attention_backend(self, kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
                               backend: AttentionBackend) -> bool:
        """Whether a step over ``kv_cache`` attends through ``backend`` (else the runner skips its plan)."""
        ...

    def step_hidden(self, step: StepInput, kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
                    backend: AttentionBackend) -> torch.Tensor | None:
        """The final hidden states [T, hidden] (normed) of ``step`` straight from its arrays, where the
        model has such a path for it (the fused CPU decode); None: the runner builds the metadata
        and calls the model."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],  # the tensor, or its kv_layer_views
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (normed)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of the hidden states ``hidden`` [rows, hidden]."""
        ...
