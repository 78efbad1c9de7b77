"""One Llama-family decoder (llama, mistral, qwen2) written for paged execution.

The forward pass takes one flat batch of T tokens from many sequences (prompt
chunks and decode tokens back to back, no padding) with their positions; each
layer writes its new K/V into the paged cache and attends through the backend.
Parameter names match transformers' ``LlamaForCausalLM`` so a checkpoint's
state dict loads without renaming.

Attention is always full causal attention: a Mistral ``sliding_window`` is not
applied, so results match transformers only while a context fits in the window.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 like transformers, then back to the activation dtype before the weight
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for plain, linear-scaled or Llama 3 RoPE (transformers' formulas)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if config.rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class Rotary(nn.Module):
    """cos/sin at arbitrary positions (tokens of one step are not contiguous across sequences)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]  # [T, 1, d]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        h, q, kv = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, q, bias=bias, device=device)
        self.k_proj = nn.Linear(h, kv, bias=bias, device=device)
        self.v_proj = nn.Linear(h, kv, bias=bias, device=device)
        self.o_proj = nn.Linear(q, h, bias=False, device=device)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        key_cache, value_cache = layer_cache[0], layer_cache[1]
        backend.write_kv(k, v, key_cache, value_cache, meta)
        o = backend.forward(q, key_cache, value_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str | None) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, device=device)
        self.up_proj = nn.Linear(h, i, bias=False, device=device)
        self.down_proj = nn.Linear(i, h, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.self_attn = Attention(config, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.mlp = MLP(config, device)

    def forward(self, x, cos_sin, layer_cache, meta, backend):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, layer_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)


class LlamaForCausalLM(nn.Module):
    """Build with ``device="meta"`` and load weights with ``load_state_dict(assign=True)`` to skip random init."""

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config, device)
        self.rotary = Rotary(config)  # always real: its buffer is computed, never loaded
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the output projection with the embedding (call again after ``load_state_dict(assign=True)``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] (normed); ``compute_logits`` turns the rows you need into logits."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, kv_cache[i], meta, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
