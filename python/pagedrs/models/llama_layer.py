"""One Llama decoder layer: its modules (``DecoderLayer``: attention and MLP, which own the parameters),
the plain record they bind to (``BoundLayer``), and the function the forward pass runs over it
(``decoder_layer``), with the RMSNorm both norms use.

Apart from llama.py, which stacks the layers into a model and loads its weights, because a layer is
where the float operations are chosen to match transformers bit for bit (the fused QKV and gate/up
GEMMs, the residual adds in place, rotary on the QKV output) and where the per-op overhead of a decode
step is kept down (``BoundLayer``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.distributed.parallel_state import all_reduce_, tp_rank, tp_size
from pagedrs.models.config import ModelConfig
from pagedrs.models.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedrs.models.quant import WeightFormat
from pagedrs.models.rotary import apply_rotary_


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
