"""One Llama-family decoder (llama, mistral, qwen2) written for paged execution.

The forward pass takes one flat batch of T tokens from many sequences (prompt
chunks and decode tokens back to back, no padding) with their positions; each
layer writes its new K/V into the paged cache and attends through the backend.

Each layer runs few, large ops: one fused QKV GEMM and one fused gate/up GEMM (the
checkpoint's separate projections land side by side through the layers'
``weight_loader``, see ``STACKED_PARAMS``), the residual add folded into the RMSNorm
that follows it, and rotary applied in place on the QKV output. In float32 with dense
weights every op computes what transformers computes, so greedy output matches it.

Attention is causal; a layer with a sliding window (Mistral's ``sliding_window``,
Qwen2's sliding layers) passes it to the backend, which lets each token see only the
last ``sliding_window`` positions, as transformers does.

This module stacks the layers into a model and loads its weights; one decoder layer
(its modules, ``BoundLayer`` and ``decoder_layer``) is llama_layer.py's, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.models.config import ModelConfig
from pagedrs.models.cpu_decode import FusedCpuDecode
from pagedrs.models.embedding import BlockEmbedding, lookup
from pagedrs.models.layers import DenseLinearMethod, LinearBase, QKVParallelLinear, ReplicatedLinear, ShardId
from pagedrs.models.llama_layer import (  # noqa: F401  (the layer's names are re-exported)
    MLP,
    Attention,
    BoundLayer,
    DecoderLayer,
    RMSNorm,
    decoder_layer,
    rms_norm,
)
from pagedrs.models.quant import WeightFormat
from pagedrs.models.rotary import Rotary

if TYPE_CHECKING:
    from pagedrs.step_input import StepInput


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig, fmt: WeightFormat, device: torch.device | str | None) -> None:
        super().__init__()
        dtype = fmt.params_dtype
        # _weight skips the random init of a table that is about to be overwritten; under "gguf" the table is a
        # shape only (meta) until the loader knows whether it stays in the file's blocks (BlockEmbedding)
        table = torch.empty(config.vocab_size, config.hidden_size, device="meta" if fmt.name == "gguf" else device,
                            dtype=dtype)
        # a GGUF load may put a BlockEmbedding (the file's blocks) in its place (loader._load_gguf_blocks)
        self.embed_tokens: nn.Embedding | BlockEmbedding = nn.Embedding(config.vocab_size, config.hidden_size,
                                                                         _weight=table, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, fmt, device, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)


# checkpoint (transformers) projection -> (fused parameter, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    """Parameters are created empty; ``load_weights`` fills them from checkpoint tensors by their transformers
    names, through each layer's ``weight_loader`` (so a fused or sharded layer takes its slice)."""

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None,
                 weight_format: WeightFormat | None = None) -> None:
        super().__init__()
        fmt = weight_format or WeightFormat("float32", torch.float32)
        self.config = config
        self.weight_format = fmt
        self.model = LlamaBody(config, fmt, device)
        self.rotary = Rotary(config).to(device)  # computed, never loaded
        h, vocab = config.hidden_size, config.vocab_size
        self.lm_head = ReplicatedLinear(h, vocab, bias=False, method=fmt.head_method(h, vocab), device=device)
        # dense and in the embedding's dtype: one tensor serves both (no copy of the largest matrix)
        self.shares_embedding = config.tie_word_embeddings and (
            isinstance(self.lm_head.method, DenseLinearMethod) and self.lm_head.weight.dtype == fmt.params_dtype
        )
        if self.shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight  # type: ignore[assignment]  # a Parameter
        self._bound: list[BoundLayer] | None = None  # made by bind(), after loading
        self._bound_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._embed: Callable[[torch.Tensor], torch.Tensor] = lookup(self.model.embed_tokens)  # again in bind()
        # every layer in one Rust call on the CPU when all products run the GGUF kernel (cpu_decode.py)
        self.fused_cpu_decode: FusedCpuDecode | None = None

    @property
    def heads_per_rank(self) -> int:
        """Attention (query) heads this tensor-parallel rank computes."""
        return self._first_qkv().heads_per_rank

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads this tensor-parallel rank stores (all of them with one rank)."""
        return self._first_qkv().kv_heads_per_rank

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[layers, 2 (K, V), num_blocks, block_size, kv_heads_per_rank, head_dim]: a block's K and V of
        every layer is one slice along dim 2, so a copy or swap of blocks is one indexed copy."""
        c = self.config
        return (c.num_hidden_layers, 2, num_blocks, block_size, self.kv_heads_per_rank, c.head_dim)

    @staticmethod
    def kv_layer_views(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(key cache, value cache) of each layer: views into ``kv_cache`` (``kv_cache_shape``)."""
        return [(layer[0], layer[1]) for layer in kv_cache]

    def _first_qkv(self) -> QKVParallelLinear:
        layer = self.model.layers[0]
        assert isinstance(layer, DecoderLayer)  # for the type checker: ModuleList items are Modules
        return layer.self_attn.qkv_proj

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a transformers checkpoint of this config holds, with its (unsharded) shape."""
        return checkpoint_shapes(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, preloaded: Collection[str] = ()) -> None:
        """Route each checkpoint tensor to its parameter's ``weight_loader``, then let every layer convert.

        ``preloaded``: parameters that got their weights another way before this call (a GGUF layer's
        matrix packed from the file's blocks); a tensor aimed at one of them is not loaded (the tied
        embedding, which such a head was made of)."""
        self._materialize_staged()
        params = dict(self.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            targets: list[tuple[str, ShardId]] = [(name, None)]
            for ckpt, fused, fused_shard in STACKED_PARAMS:
                if ckpt in name:
                    targets = [(name.replace(ckpt, fused), fused_shard)]
                    break
            if name == "model.embed_tokens.weight" and self.config.tie_word_embeddings and not self.shares_embedding:
                targets.append(("lm_head.weight", None))
            for target, shard in targets:
                if target in preloaded:
                    continue
                param = params[target]
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    default_weight_loader(param, tensor)
                else:
                    loader(param, tensor, shard)
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.process_weights_after_loading()
        self.bind()

    def _materialize_staged(self) -> None:
        """Real (uninitialized) storage on the model's device for every parameter staged on the meta device
        (``GgufLinearMethod``'s weights, the "gguf" format's lookup table): the ones still there when loading
        starts are the ones the checkpoint fills. Their ``weight_loader`` goes with them."""
        device = self.model.norm.weight.device
        for module in self.modules():
            for name, staged in list(module.named_parameters(recurse=False)):
                if staged.is_meta:
                    real = nn.Parameter(torch.empty(staged.shape, dtype=staged.dtype, device=device), requires_grad=False)
                    if hasattr(staged, "weight_loader"):
                        real.weight_loader = staged.weight_loader  # type: ignore[attr-defined]
                    setattr(module, name, real)

    def bind(self) -> list[BoundLayer]:
        """Builds the per-layer records the forward pass runs over (again after parameters are replaced;
        in-place changes to them need nothing)."""
        self._bound = [layer.bind() for layer in self.model.layers]  # type: ignore[operator]  # DecoderLayer
        self._embed = lookup(self.model.embed_tokens)
        self._bound_head = self.lm_head.bind()
        self.fused_cpu_decode = FusedCpuDecode.build(self)
        return self._bound

    def uses_attention_backend(self, kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
                               backend: AttentionBackend) -> bool:
        """False when the fused CPU decode runs the step (it attends itself: the runner need not plan)."""
        fused = self.fused_cpu_decode
        return fused is None or not fused.runs(kv_cache, backend)

    def step_hidden(self, step: StepInput, kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
                    backend: AttentionBackend) -> torch.Tensor | None:
        """``FusedCpuDecode.decode_step`` where the fused CPU decode runs this step, else None."""
        fused = self.fused_cpu_decode
        if fused is None or not fused.runs(kv_cache, backend):
            return None
        return fused.decode_step(step, kv_cache)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        # [layers, 2, num_blocks, block_size, kv_heads, head_dim], or its kv_layer_views (a runner makes them once)
        kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (normed); ``compute_logits`` turns the rows you need into logits."""
        layers = self._bound if self._bound is not None else self.bind()
        h = self._embed(input_ids)
        norm = self.model.norm
        fused = self.fused_cpu_decode
        if fused is not None and fused.runs(kv_cache, backend):
            return fused.forward(h, positions, kv_cache, meta)  # normed by the stack
        cos, sin = self.rotary(positions, h.dtype)  # once per step, shared by every layer
        residual: torch.Tensor | None = None
        caches = self.kv_layer_views(kv_cache) if isinstance(kv_cache, torch.Tensor) else kv_cache
        for layer, layer_cache in zip(layers, caches, strict=True):
            h, residual = decoder_layer(layer, h, residual, cos, sin, layer_cache, meta, backend)
        assert residual is not None  # every model has a layer
        return rms_norm(residual.add_(h), norm.weight, norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self._bound_head if self._bound_head is not None else self.lm_head.bind()
        logits = head(hidden)
        return logits if logits.dtype is torch.float32 else logits.float()  # (a no-op .float() is a call too)

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every linear layer (the embedding is only indexed)."""
        return sum(m.method.weight_bytes(m) for m in self.modules() if isinstance(m, LinearBase))

    def outside_torch_bytes(self) -> int:
        """Bytes of weights this model holds outside torch's tensors: GGUF matrices (the Rust GEMV's tiles,
        each matrix once) and a block embedding's own blocks. Parameters and buffers are counted apart
        (``memory_weights_bytes`` adds the two); before this, a GGUF model reported its norms alone."""
        from pagedrs.models.embedding import BlockEmbedding

        matrices: dict[int, Any] = {}
        for m in self.modules():
            matrix = getattr(m, "gguf_matrix", None)
            if matrix is not None:
                matrices[id(matrix)] = matrix
        tables = [m for m in self.modules() if isinstance(m, BlockEmbedding)]
        return sum(int(m.weight_bytes) for m in matrices.values()) + sum(t.weight_bytes() for t in tables)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.is_meta:  # a copy into a meta tensor does nothing: the weight would be left unset without a word
        raise RuntimeError(f"a parameter of shape {tuple(param.shape)} has no storage (staged on the meta device)")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"tensor of shape {tuple(loaded.shape)} cannot fill a parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def checkpoint_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a transformers checkpoint of config ``c`` holds, with its (unsharded) shape."""
    h, q, kv, i = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    per_layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    if c.attention_bias:
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
    for layer in range(c.num_hidden_layers):
        shapes.update({f"model.layers.{layer}.{k}": v for k, v in per_layer.items()})
    return shapes
