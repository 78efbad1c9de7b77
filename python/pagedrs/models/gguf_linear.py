"""``weight_dtype="gguf"``: linear layers multiplied by the Rust GEMV in the GGUF file's own block format.

Why: batch-1 decode on a CPU streams every weight once per token; aten's int4/int8 kernels
reach under 40% of the memory bandwidth at M = 1, the Rust kernel (``rust/src/gemv``) reads
the GGUF blocks as they are (Q4_0, Q4_1, Q8_0: no re-quantization, so no second rounding)
with int8 activations per block of 32, as llama.cpp does.

Loading: every layer first loads the dequantized float32 weight like the dense path (the
checkpoint goes through the usual weight loaders and shape checks), then
``install_gguf_weights`` swaps in a ``GgufMatrix`` built from the file's raw blocks
(``gguf_loader.gguf_raw_linears``) and frees the float32 copy. Fused QKV and gate/up
concatenate their siblings' block rows (rows are independent, so this is exact); the tied
Q8_0 embedding becomes the head's matrix while the lookup keeps the float32 table. A layer
whose tensors are not all in one supported block format keeps its float32 weight and the
dense product. Tensor parallelism is not supported for this format yet (ValueError at load).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.models.layers import LinearBase, LinearMethod

GGUF_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # what the Rust kernel reads

# fused module name -> its checkpoint siblings, in the fused row order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class GgufLinearMethod(LinearMethod):
    """Stages a dense float32 weight for loading; after ``install`` multiplies through a ``GgufMatrix``."""

    name = "gguf"
    # The kernel's team size; None: torch's intra-op thread count. ``hand_cpu_threads_to_gemv``
    # sets it on every layer of a model the engine runs.
    threads: int | None = None

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int, device: Any) -> None:
        if layer.tp_size != 1:
            raise ValueError(f"weight_dtype 'gguf' does not support tensor parallelism yet (tp_size={layer.tp_size}); "
                             "use int4, int8 or float32")
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32, device=device),
                                    requires_grad=False)
        layer.gguf_matrix = None  # type: ignore[assignment]  # set by install()

    @staticmethod
    def install(layer: LinearBase, matrix: Any) -> None:
        """Replace the staged float32 weight by ``matrix`` (a ``pagedrs._core.GgufMatrix``)."""
        if (matrix.rows, matrix.cols) != (layer.out_per_rank, layer.in_per_rank):
            raise ValueError(f"GGUF tensor {matrix.name!r} is [{matrix.rows}, {matrix.cols}]; the layer needs "
                             f"[{layer.out_per_rank}, {layer.in_per_rank}]")
        del layer.weight
        layer.register_parameter("weight", None)
        layer.gguf_matrix = matrix

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.bind(layer, bias)(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    def bind(self, layer: LinearBase, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
        matrix = getattr(layer, "gguf_matrix", None)
        if matrix is None:  # not a supported block format in the file: the dense float32 product
            weight = layer.weight
            return lambda x: F.linear(x, weight, bias)
        params_dtype = self.params_dtype
        method = self

        def run(x: torch.Tensor) -> torch.Tensor:
            threads = method.threads or torch.get_num_threads()
            if x.dtype is not torch.float32 or x.requires_grad:  # the common case skips two calls
                x = x.detach().float()
            # a NumPy view (zero-copy) is cheaper to hand over than the tensor: measured 4.4 us of
            # wrapper around a 9.7 us qkv product before, at batch 1
            y = torch.from_numpy(matrix.matmul(x.numpy(), threads))
            y = y if y.dtype == params_dtype else y.to(params_dtype)
            return y if bias is None else y + bias

        return run

    def weight_bytes(self, layer: LinearBase) -> int:
        matrix = getattr(layer, "gguf_matrix", None)
        if matrix is not None:
            return int(matrix.weight_bytes)
        return super().weight_bytes(layer)


def install_gguf_weights(model: nn.Module, raw: dict[str, tuple[np.ndarray, int, str]], *, tied: bool) -> int:
    """Give every ``GgufLinearMethod`` layer its raw-block matrix; returns how many got one, then rebinds."""
    from pagedrs._core import GgufMatrix

    installed = 0
    for module_name, layer in model.named_modules():
        if not isinstance(layer, LinearBase) or not isinstance(layer.method, GgufLinearMethod):
            continue
        if module_name == "lm_head":
            names = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        else:
            prefix, _, leaf = module_name.rpartition(".")
            names = [f"{prefix}.{part}.weight" for part in _FUSED.get(leaf, (leaf,))]
        parts = [raw.get(n) for n in names]
        if any(p is None for p in parts) or len({p[2] for p in parts if p is not None}) != 1:
            continue  # keeps its float32 weight
        blocks = np.concatenate([p[0] for p in parts if p is not None], axis=0)
        cols, fmt = parts[0][1], parts[0][2]  # type: ignore[index]  # checked above
        GgufLinearMethod.install(layer, GgufMatrix(np.ascontiguousarray(blocks).reshape(-1), blocks.shape[0], cols,
                                                   fmt, "+".join(names)))
        installed += 1
    model.bind()  # type: ignore[operator]  # LlamaForCausalLM.bind
    return installed


def hand_cpu_threads_to_gemv(models: Sequence[nn.Module], threads: int) -> bool:
    """Give the GEMV team of every GGUF layer in ``models`` ``threads`` threads and torch's intra-op
    pool one; True when any layer runs the kernel (else nothing changes).

    Why: both pools sized ``cpu_threads`` oversubscribe the cores. torch's OpenMP workers spin
    after each op (libgomp's default wait policy, fixed when torch is imported), so the kernel's
    helpers found no core: measured on a 2-core Xeon (2026-12-03, the embedded model, batch 1),
    2 threads each gave 21.1 ms per token, 1 thread 16.1, the kernel alone on 2 threads 12.5 (the
    same as OMP_WAIT_POLICY=PASSIVE); at batch 32 the kernel alone on 2 threads gave 379 tokens/s,
    both pools on 2 371. The rest of a step (attention over pages, norms: about half of a batch-1
    step, measured) is small ops that torch's threads barely speed up; single-threaded it costs
    less than the spinning did.
    """
    methods = [m.method for model in models for m in model.modules()
               if isinstance(m, LinearBase) and isinstance(m.method, GgufLinearMethod)
               and getattr(m, "gguf_matrix", None) is not None]
    if not methods:
        return False
    for method in methods:
        method.threads = threads
    torch.set_num_threads(1)
    return True


def cpu_runs_gguf_kernel() -> bool:
    """Whether the Rust GEMV has a SIMD kernel on this CPU (run-time detection; scalar alone is too slow)."""
    from pagedrs._core import gemv_kernels

    return len(gemv_kernels()) > 1
