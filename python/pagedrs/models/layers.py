"""Linear layers that know how a checkpoint tensor lands in them, with a pluggable linear method.

Two questions are kept apart (vLLM's ``LinearBase`` / ``QuantizeMethodBase`` split):

- *where a checkpoint tensor goes* is the layer's ``weight_loader(param, loaded, shard_id)``:
  whole (``ReplicatedLinear``), a slice of the output rows (``ColumnParallelLinear``), a slice
  of the input columns (``RowParallelLinear``), or one of several fused siblings
  (``QKVParallelLinear`` with shard ids ``"q" / "k" / "v"``, ``MergedColumnParallelLinear``
  with shard ids ``0, 1, ...``);
- *how the weight is stored and multiplied* is the layer's ``LinearMethod``: it creates the
  parameters, converts them once every shard has landed (``process_weights_after_loading``:
  quantize, pack) and computes ``y = x W^T + b`` (``apply``). ``DenseLinearMethod`` is the
  plain one; the weight-only int8 / int4 methods live in ``models/quant.py``.

Tensor parallelism: every layer knows ``(tp_rank, tp_size)`` and keeps only its shard.
Column-parallel layers produce a slice of the output features; row-parallel layers take
a slice of the input features and produce a *partial* sum that an all-reduce completes
(the bias is added on rank 0 only, so the sum of the partials is the full output). With
``tp_size=1`` (the default and, today, the only size the engine runs) every shard is the
whole tensor and nothing is reduced.

Fused layout of ``QKVParallelLinear`` on one rank (rows of its weight)::

    | q: heads_per_rank * head_dim | k: kv_heads_per_rank * head_dim | v: same as k |
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ShardId = str | int | None


class LinearMethod(ABC):
    """How a linear layer stores its weight and computes ``x @ W.T + b`` (vLLM's QuantizeMethodBase)."""

    name: str

    def __init__(self, params_dtype: torch.dtype) -> None:
        self.params_dtype = params_dtype  # the activations' dtype: biases and outputs are in it

    @abstractmethod
    def create_weights(self, layer: LinearBase, in_features: int, out_features: int, device: Any) -> None:
        """Register ``layer.weight`` [out_features, in_features] (the shard this rank holds) to load into."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Convert the loaded dense weight into the stored format (quantize, pack); dense keeps it."""
        return None

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` in the dtype of ``x``."""

    def bind(self, layer: LinearBase, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> x @ W.T + bias`` for a 2-D ``x`` over the tensors the layer holds now.

        The model's forward pass calls these closures instead of the modules: a decode step
        runs about 50 small ops per layer, and each module ``__call__`` and parameter lookup
        costs as much as one of them. Bind again after the parameters are replaced.
        """
        return lambda x: self.apply(layer, x, bias)

    def weight_bytes(self, layer: LinearBase) -> int:
        """Bytes a forward pass reads for this layer's weight (the batch-1 bandwidth bound counts them)."""
        return sum(t.numel() * t.element_size() for t in layer.parameters(recurse=False) if t is not layer.bias)


class DenseLinearMethod(LinearMethod):
    """Weights kept dense in ``weight_dtype`` (None: the activations' dtype, the transformers-exact path).

    A float32 model with ``weight_dtype=torch.bfloat16`` multiplies in bfloat16 (oneDNN's AVX512-BF16 / AMX
    kernels) and hands float32 back, so norms, rotary and the KV cache stay in float32.
    """

    name = "dense"

    def __init__(self, params_dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> None:
        super().__init__(params_dtype)
        self.weight_dtype = weight_dtype or params_dtype

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int, device: Any) -> None:
        weight = torch.empty(out_features, in_features, dtype=self.weight_dtype, device=device)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """A float32 weight on an MKL CPU is stored column-major (``W.T`` contiguous, ``layer.weight`` its
        transposed view), which makes ``F.linear`` call MKL's sgemm without a transposed B.

        Why: MKL's transposed-B sgemm takes a slow path for 1-3 rows. With SmolLM2-135M's
        weights streaming from memory on one thread, a whole batch-1 pass of the linear layers
        took 32.3 ms against 24.7 ms column-major (16.6 vs 21.8 GB/s), and 3 rows 66.3 vs 47.8 ms;
        from 4 rows on the two layouts give bit-identical results at equal or better speed
        (``python benches/linear_streaming.py --formats float32 --rows 1,2,3,4,8``). Rows 1-3 differ from the row-major path by float32
        rounding, as any two BLAS paths do. bfloat16 (oneDNN) is 20-30% slower
        column-major, and GPUs and other BLAS libraries keep the checkpoint's layout, so
        the rule is this one dtype on this one library: decided by the build, never by a
        timing, so that two runs of the same build compute the same numbers.
        """
        if column_major_preferred(layer.weight):
            layer.weight.data = layer.weight.data.t().contiguous().t()

    def bind(self, layer: LinearBase, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        weight = layer.weight
        if weight.dtype == self.params_dtype:
            return lambda x: F.linear(x, weight, bias)
        return super().bind(layer, bias)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype == layer.weight.dtype:
            return F.linear(x, layer.weight, bias)
        y = F.linear(x.to(layer.weight.dtype), layer.weight)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def column_major_preferred(weight: torch.Tensor) -> bool:
    """Whether a dense weight multiplies faster stored column-major: float32 on a CPU whose torch uses MKL."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkl.is_available())


class LinearBase(nn.Module):
    """A linear layer's shard on rank ``tp_rank`` of ``tp_size``; subclasses say how a tensor is sliced."""

    weight: nn.Parameter  # what checkpoint tensors land in; a quantized method replaces it after loading
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,  # of the whole (unsharded) layer
        out_features: int,  # of the whole layer
        *,
        bias: bool = False,
        method: LinearMethod,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: Any = None,
    ) -> None:
        super().__init__()
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank}, tp_size={tp_size}: need tp_size >= 1 and 0 <= tp_rank < tp_size")
        self.in_features, self.out_features = in_features, out_features
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.method = method
        self.in_per_rank, self.out_per_rank = self.shard_sizes()
        method.create_weights(self, self.in_per_rank, self.out_per_rank, device)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # read by load_weights
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.bias_size(), dtype=method.params_dtype, device=device),
                requires_grad=False,
            )
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def shard_sizes(self) -> tuple[int, int]:
        """(input features, output features) this rank holds."""
        return self.in_features, self.out_features

    def bias_size(self) -> int:
        return self.out_per_rank

    def row_shard(self, shard_id: ShardId = None) -> tuple[int, int, int]:
        """Where the rows of one checkpoint tensor (``shard_id``'s, for a fused layer) land on this rank:
        (first row in this rank's weight, first row taken from the checkpoint tensor, rows). The one
        place that says it: ``weight_loader`` and the GGUF path's raw blocks (``gguf_linear``) both slice by it."""
        return 0, 0, self.out_per_rank

    def col_shard(self) -> tuple[int, int]:
        """(first column, columns) of a checkpoint tensor this rank keeps."""
        return 0, self.in_per_rank

    def full_rows(self, shard_id: ShardId = None) -> int:
        """The rows of the whole checkpoint tensor (``shard_id``'s) before it is split across ranks."""
        return self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Whole tensor: the checkpoint's shape must be the parameter's."""
        _copy_checked(param.data, loaded, self, shard_id)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """This layer's forward on a 2-D input as a plain closure (see ``LinearMethod.bind``)."""
        return self.method.bind(self, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, method={self.method.name}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (the LM head of a small model, for instance)."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows ``[r * n, (r + 1) * n)`` of W (and of b)."""

    def shard_sizes(self) -> tuple[int, int]:
        return self.in_features, _divide(self.out_features, self.tp_size, "out_features")

    def row_shard(self, shard_id: ShardId = None) -> tuple[int, int, int]:
        n = self.out_per_rank
        return 0, self.tp_rank * n, n

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """The checkpoint tensor's rows of this rank (``row_shard``), where the fused layout puts them."""
        offset, start, n = self.row_shard(shard_id)
        _copy_checked(param.data.narrow(0, offset, n), _rows(loaded, start, n), self, shard_id,
                      full=loaded, full_rows=self.full_rows(shard_id))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; each rank's output is a partial sum (the bias only on rank 0)."""

    def shard_sizes(self) -> tuple[int, int]:
        return _divide(self.in_features, self.tp_size, "in_features"), self.out_features

    def bias_size(self) -> int:
        return self.out_features

    def col_shard(self) -> tuple[int, int]:
        k = self.in_per_rank
        return self.tp_rank * k, k

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if param.dim() == 2 and loaded.dim() == 2 and loaded.shape[1] != param.shape[1]:
            loaded_shard = loaded.narrow(1, *self.col_shard())
        else:
            loaded_shard = loaded
        _copy_checked(param.data, loaded_shard, self, shard_id, full=loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias if self.tp_rank == 0 else None)

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.method.bind(self, self.bias if self.tp_rank == 0 else None)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers on one input fused into one GEMM (gate and up: shard ids 0 and 1).

    On each rank the fused rows are ``[shard 0 of this rank | shard 1 of this rank | ...]``, so
    a rank's output splits into its part of every sibling.
    """

    def __init__(self, in_features: int, out_sizes: list[int], **kwargs: Any) -> None:
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), **kwargs)

    def shard_sizes(self) -> tuple[int, int]:
        for i, size in enumerate(self.out_sizes):
            _divide(size, self.tp_size, f"out_sizes[{i}]")
        return self.in_features, self.out_features // self.tp_size

    def row_shard(self, shard_id: ShardId = None) -> tuple[int, int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.out_sizes):
            raise ValueError(f"{type(self).__name__}: shard_id {shard_id!r} is not one of 0..{len(self.out_sizes) - 1}")
        n = self.out_sizes[shard_id] // self.tp_size
        return sum(self.out_sizes[:shard_id]) // self.tp_size, self.tp_rank * n, n

    def full_rows(self, shard_id: ShardId = None) -> int:
        self.row_shard(shard_id)  # refuses a shard id this layer does not have
        assert isinstance(shard_id, int)
        return self.out_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one GEMM, split by attention heads across ranks.

    With fewer KV heads than ranks, each KV head is replicated on ``tp_size / num_kv_heads``
    ranks (rank r holds KV head ``r * num_kv_heads // tp_size``), as in vLLM.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, **kwargs: Any) -> None:
        tp_size = kwargs.get("tp_size", 1)
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.heads_per_rank = _divide(num_heads, tp_size, "num_heads")
        if num_kv_heads >= tp_size:
            self.kv_heads_per_rank = _divide(num_kv_heads, tp_size, "num_kv_heads")
        else:
            _divide(tp_size, num_kv_heads, "tp_size (over num_kv_heads)")
            self.kv_heads_per_rank = 1
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, **kwargs)

    def shard_sizes(self) -> tuple[int, int]:
        return self.in_features, (self.heads_per_rank + 2 * self.kv_heads_per_rank) * self.head_dim

    @property
    def q_size(self) -> int:
        return self.heads_per_rank * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads_per_rank * self.head_dim

    def row_shard(self, shard_id: ShardId = None) -> tuple[int, int, int]:
        if shard_id == "q":
            return 0, self.tp_rank * self.heads_per_rank * self.head_dim, self.q_size
        if shard_id in ("k", "v"):
            first_head = (self.tp_rank * self.num_kv_heads // self.tp_size if self.num_kv_heads < self.tp_size
                          else self.tp_rank * self.kv_heads_per_rank)
            return self.q_size + (0 if shard_id == "k" else self.kv_size), first_head * self.head_dim, self.kv_size
        raise ValueError(f"QKVParallelLinear: shard_id {shard_id!r} is not one of 'q', 'k', 'v'")

    def full_rows(self, shard_id: ShardId = None) -> int:
        self.row_shard(shard_id)  # refuses a shard id this layer does not have
        return (self.num_heads if shard_id == "q" else self.num_kv_heads) * self.head_dim


def _rows(loaded: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows ``[start, start + n)`` when the tensor has them; else the tensor (the shape check then explains)."""
    return loaded.narrow(0, start, n) if loaded.shape[0] >= start + n else loaded


def _copy_checked(
    dst: torch.Tensor,
    src: torch.Tensor,
    layer: LinearBase,
    shard_id: ShardId,
    *,
    full: torch.Tensor | None = None,
    full_rows: int | None = None,
) -> None:
    """``dst.copy_(src)`` after checking that the checkpoint tensor has the shape this layer implies."""
    if dst.is_meta:  # a copy into a meta tensor does nothing: the weight would be left unset without a word
        raise RuntimeError(f"{type(layer).__name__} (in={layer.in_features}, out={layer.out_features}) has no storage "
                           "for its weight (staged on the meta device and never materialized)")
    full = src if full is None else full
    if (full_rows is not None and full.shape[0] != full_rows) or tuple(src.shape) != tuple(dst.shape):
        shard = "" if shard_id is None else f" (shard {shard_id!r})"
        raise ValueError(
            f"{type(layer).__name__}{shard} got a tensor of shape {tuple(full.shape)}; this layer "
            f"(in={layer.in_features}, out={layer.out_features}, tp {layer.tp_rank}/{layer.tp_size}) "
            f"expects a shard of shape {tuple(dst.shape)}"
        )
    dst.copy_(src)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tp_size={d}")
    return n // d
