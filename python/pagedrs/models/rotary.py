"""Rotary position embeddings (RoPE): the inverse frequencies of each scaling scheme, cos/sin at
arbitrary positions, and the in-place rotate-half the decoder applies to its query and key heads."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from pagedrs.models.config import ModelConfig
from pagedrs.step_input import value_bounds


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for plain, linear-scaled or Llama 3 RoPE (transformers' formulas),
    or Llama 3 RoPE as llama.cpp stores it (a divisor per frequency, from a GGUF's rope_freqs)."""
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
    if config.rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    return inv_freq


class Rotary(nn.Module):
    """cos/sin at arbitrary positions (tokens of one step are not contiguous across sequences).

    On the CPU, the values of positions below ``TABLE_POSITIONS`` (and the model's
    ``max_position_embeddings``) are computed once, on first use, into a table that each
    step indexes: one ``index_select`` instead of about eight small ops per step (at batch 1
    each op costs about as much as its work). A table entry is the same elementwise
    product, cosine and sine as the direct formula, so the bits are the same; positions
    past the table take the direct formula.
    """

    TABLE_POSITIONS = 1 << 16  # 512 bytes per position at head_dim 128: 32 MiB at most; 2 MiB for SmolLM2

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.table_positions = min(config.max_position_embeddings, self.TABLE_POSITIONS)
        self._table: torch.Tensor | None = None  # float32 [table_positions, 2, head_dim / 2]: cos, sin
        self._table_np: np.ndarray | None = None  # the same table as a NumPy view (cos_sin_rows_np)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim / 2]: one half, since rotate-half uses the same angle in both."""
        cos_sin = self._from_table(positions)  # [T, 2, d/2], or None
        if cos_sin is None:
            cos, sin = self._cos_sin(positions)
            return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
        if dtype != cos_sin.dtype:
            cos_sin = cos_sin.to(dtype)
        return cos_sin[:, :1], cos_sin[:, 1:]

    def cos_sin_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 [T, 2, head_dim / 2] (each row's cos, then sin) for the fused CPU decode: the same
        values ``forward`` returns, in one contiguous array."""
        cos_sin = self._from_table(positions)
        if cos_sin is None:
            cos_sin = torch.stack(self._cos_sin(positions), dim=1)
        return cos_sin.contiguous()

    def cos_sin_rows_np(self, positions: np.ndarray) -> np.ndarray:
        """``cos_sin_rows`` of int64 NumPy positions, as NumPy: one ``take`` from the same table (the
        same values), for the fused CPU decode's step, where each torch op runs cold after the Rust
        stack has streamed the weights. Positions past the table (or below 0) take ``cos_sin_rows``."""
        table = self._table_np
        if table is not None and positions.size:
            lo, hi = value_bounds(positions)
            if lo >= 0 and hi < table.shape[0]:
                return table.take(positions, axis=0)
        rows = self.cos_sin_rows(torch.from_numpy(positions)).numpy()
        if self._table is not None and self._table.device.type == "cpu":
            self._table_np = self._table.numpy()  # built by that call, on the CPU
        return rows

    def _from_table(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The table's float32 rows [T, 2, d/2] (cos, sin) for ``positions`` on the CPU; None elsewhere
        (an index past the table is a device-side assert there, not an error) and past the table."""
        if positions.device.type != "cpu":
            return None
        table = self._table
        if table is None or table.device != self.inv_freq.device:
            positions_all = torch.arange(self.table_positions, device=self.inv_freq.device)
            table = self._table = torch.stack(self._cos_sin(positions_all), dim=1)
        try:
            return table.index_select(0, positions)
        except IndexError:  # a position past the table (checked by index_select on the CPU)
            return None

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [T, d/2] of ``positions`` (int64 [T])."""
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()  # [T, d/2]
        return freqs.cos(), freqs.sin()


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on ``x`` [T, heads, d] (a view into the fused QKV output:
    the model passes the query and key heads together, one call per layer).

    Same float operations as transformers' ``x * cos + rotate_half(x) * sin``:
    first half ``x1 * cos - x2 * sin``, second half ``x2 * cos + x1 * sin``.
    """
    x1, x2 = x.chunk(2, dim=-1)
    x1_sin, x2_sin = x1 * sin, x2 * sin
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)
