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
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.distributed.parallel_state import all_reduce_, tp_rank, tp_size
from pagedrs.models.config import ModelConfig
from pagedrs.models.cpu_decode import FusedCpuDecode
from pagedrs.models.embedding import BlockEmbedding, lookup
from pagedrs.models.layers import (
    DenseLinearMethod,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardId,
)
from pagedrs.models.quant import WeightFormat
from pagedrs.models.rotary import Rotary, apply_rotary_

if TYPE_CHECKING:
    from pagedrs.step_input import StepInput


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, then back to the activation dtype before the weight.

    For float32 activations ``torch.rms_norm`` computes the same operations in one call
    (bitwise equal here; ``tests/test_layers.py`` checks it); other dtypes keep the
    explicit upcast, whose rounding point ``torch.rms_norm`` does not promise.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, fmt: WeightFormat, device: torch.device | str | None,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        h, q = config.hidden_size, self.num_heads * self.head_dim
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        tp = dict(tp_rank=tp_rank(), tp_size=tp_size())  # heads split across ranks; o_proj sums the parts
        self.qkv_proj = QKVParallelLinear(h, self.head_dim, self.num_heads, self.num_kv_heads,
                                          bias=config.attention_bias, method=fmt.method(h, qkv_out), device=device,
                                          **tp)
        self.o_proj = RowParallelLinear(q, h, bias=False, method=fmt.method(q, h), device=device, **tp)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, fmt: WeightFormat, device: torch.device | str | None) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        tp = dict(tp_rank=tp_rank(), tp_size=tp_size())
        self.gate_up_proj = MergedColumnParallelLinear(h, [i, i], bias=False, method=fmt.method(h, 2 * i),
                                                       device=device, **tp)
        self.down_proj = RowParallelLinear(i, h, bias=False, method=fmt.method(i, h), device=device, **tp)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, fmt: WeightFormat, device: torch.device | str | None,
                 layer: int = 0) -> None:
        super().__init__()
        dtype = fmt.params_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = Attention(config, fmt, device, config.layer_sliding_window(layer))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = MLP(config, fmt, device)

    def bind(self) -> BoundLayer:
        attn, mlp = self.self_attn, self.mlp
        qkv = attn.qkv_proj
        return BoundLayer(
            input_norm=self.input_layernorm.weight, post_norm=self.post_attention_layernorm.weight,
            eps=self.input_layernorm.eps, qkv=qkv.bind(), o=attn.o_proj.bind(), gate_up=mlp.gate_up_proj.bind(),
            down=mlp.down_proj.bind(), num_heads=qkv.heads_per_rank, num_kv_heads=qkv.kv_heads_per_rank,
            head_dim=attn.head_dim, scale=attn.scale, sliding_window=attn.sliding_window,
            reduce=all_reduce_ if tp_size() > 1 else None,
        )


class BoundLayer:
    """One decoder layer as plain tensors and closures, for ``decoder_layer``.

    The modules own the parameters (loading, sharding, quantizing); the forward pass runs
    over these records instead, because a decode step is about 50 small ops per layer and
    every module ``__call__`` and ``nn.Module.__getattr__`` costs about as much as one op.
    """

    __slots__ = ("input_norm", "post_norm", "eps", "qkv", "o", "gate_up", "down", "num_heads", "num_kv_heads",
                 "head_split", "head_dim", "scale", "sliding_window", "reduce")

    def __init__(self, *, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                 qkv: Callable[[torch.Tensor], torch.Tensor], o: Callable[[torch.Tensor], torch.Tensor],
                 gate_up: Callable[[torch.Tensor], torch.Tensor], down: Callable[[torch.Tensor], torch.Tensor],
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.input_norm, self.post_norm, self.eps = input_norm, post_norm, eps
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim  # on this rank
        self.head_split = [num_heads, num_kv_heads, num_kv_heads]  # the fused QKV output, in heads
        self.scale, self.sliding_window = scale, sliding_window
        self.reduce = reduce  # the tensor-parallel all-reduce of the row-parallel outputs; None with one rank


def decoder_layer(
    layer: BoundLayer,
    h: torch.Tensor,  # [T, hidden]: the previous layer's MLP output (the embeddings for layer 0)
    residual: torch.Tensor | None,  # [T, hidden]: the residual stream before it, updated in place; None at layer 0
    cos: torch.Tensor,  # [T, 1, head_dim / 2]
    sin: torch.Tensor,
    layer_cache: tuple[torch.Tensor, torch.Tensor],  # key and value cache [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    backend: AttentionBackend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this layer's MLP output, the residual stream before it): the next layer's norm adds them.

    Same float operations as transformers' decoder layer: the residual adds happen in place
    (``residual += h``), and addition commutes, so the sums are the same bits.
    """
    if residual is None:
        residual = h
    else:
        residual.add_(h)
    t = h.shape[0]
    heads = layer.qkv(rms_norm(residual, layer.input_norm, layer.eps)).view(t, -1, layer.head_dim)  # [T, q+2kv, d]
    apply_rotary_(heads[:, : layer.num_heads + layer.num_kv_heads], cos, sin)  # query and key heads at once
    q, k, v = heads.split(layer.head_split, dim=1)
    key_cache, value_cache = layer_cache
    backend.write_kv(k, v, key_cache, value_cache, meta)
    if layer.sliding_window is None:
        o = backend.forward(q, key_cache, value_cache, meta, layer.scale)
    else:
        o = backend.forward(q, key_cache, value_cache, meta, layer.scale, sliding_window=layer.sliding_window)
    h = layer.o(o.reshape(t, -1))
    if layer.reduce is not None:
        h = layer.reduce(h)
    residual.add_(h)
    gate, up = layer.gate_up(rms_norm(residual, layer.post_norm, layer.eps)).chunk(2, dim=-1)
    h = layer.down(F.silu(gate).mul_(up))
    if layer.reduce is not None:
        h = layer.reduce(h)
    return h, residual


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
