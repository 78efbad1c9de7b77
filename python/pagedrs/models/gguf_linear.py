"""``weight_dtype="gguf"``: linear layers multiplied by the Rust GEMV in the GGUF file's own block format.

Why: batch-1 decode on a CPU streams every weight once per token; aten's int4/int8 kernels
reach under 40% of the memory bandwidth at M = 1, the Rust kernel (``rust/src/gemv``) reads
the GGUF blocks as they are (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS: no
re-quantization, so no second rounding)
with int8 activations per block of 32, as llama.cpp does. Other quantized types are converted once
at load (``gguf_convert``: requantized to Q8_0), and so are fused siblings whose types differ (all to
Q8_0).

Loading (``loader._load_gguf_blocks``): before any weight is read, ``install_gguf_weights``
gives each layer a ``GgufMatrix`` packed from the file's raw blocks (``gguf_loader.gguf_raw_linears``,
views of the mapped file) and drops its staged float32 weight (a shape on the meta device, never given
storage); only the tensors no matrix took are then dequantized and loaded through the usual
weight loaders. Fused QKV and gate/up concatenate their siblings' block rows (rows are
independent, so this is exact); siblings the file stores in different types (a K-quant mix's Q4_K
q / k beside a Q6_K v) stay one part each in its own format (``GgufMatrix.fused``: the activations
quantized once, each part writing its own columns), where they were all converted to Q8_0 before
(8.5 bits a weight and a second rounding); the tied Q8_0 embedding becomes the head's matrix, and the lookup
reads the same blocks (``embedding.BlockEmbedding``). A layer with a tensor in no quantized type
(F32 / F16 / BF16) keeps its float32 weight and the dense product.

Tensor parallelism: each rank builds (and repacks) a matrix of its own shard only, sliced from the
file's blocks where the dense loader slices the float32 tensor (``LinearBase.row_shard`` and
``col_shard``, one definition for both). Rows are whole block runs, so a column-parallel shard is
exact; a row-parallel shard (``o_proj``, ``down_proj``) must start and end on a block boundary (one
scale covers 32 columns), so its columns per rank must be a multiple of 32, else the load is refused
by name (and ``auto`` does not pick this format). A K-quant tensor's blocks span 256 columns: where a
rank's shard would cut one, that layer runs Q4_K as Q4_1, Q5_K as Q5_1, IQ4_XS as IQ4_NL and Q6_K as Q8_0
(``gguf_convert.narrower``).
Each rank quantizes the same 32-column blocks of its
input slice that one rank would, so a shard's partial sum differs from one rank's only in the order
the blocks' sums are added.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedrs.models.gguf_convert import QK, block_columns, common_type, kernel_type, narrower, to_kernel
from pagedrs.models.layers import LinearBase, LinearMethod, ShardId

# fused module name -> its checkpoint siblings with their shard ids, in the fused row order
_FUSED: dict[str, tuple[tuple[str, ShardId], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}


class GgufLinearMethod(LinearMethod):
    """Multiplies through a ``GgufMatrix`` once ``install`` gave the layer one; a layer whose file tensors are
    not on the kernel keeps a dense float32 weight and the dense product.

    The weight ``create_weights`` registers lives on the meta device (a shape, no storage) until
    ``LlamaForCausalLM.load_weights`` gives the layers that still have one real storage: a layer that got a
    matrix first never needed a float32 copy, and an 8B model's would have been 32 GB of address space that
    a host with strict overcommit refuses."""

    name = "gguf"
    # The kernel's team size; None: torch's intra-op thread count. ``hand_cpu_threads_to_gemv``
    # sets it on every layer of a model the engine runs.
    threads: int | None = None

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int, device: Any) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32, device="meta"),
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


def install_gguf_weights(model: nn.Module, raw: dict[str, tuple[np.ndarray, int, str]], *, tied: bool,
                         convert: Callable[[np.ndarray, int, str, str, str], np.ndarray] = to_kernel,
                         ) -> dict[str, tuple[str, ...]]:
    """Give every ``GgufLinearMethod`` layer its raw-block matrix. Returns, per parameter that got one
    (``"model.layers.0.self_attn.qkv_proj.weight"``), the checkpoint tensors it was made of: a load
    need not read them again. ``convert``: ``to_kernel``, or one that keeps its results
    (``gguf_cache.ConvertedBlocks``). Bind the model again afterwards (``load_weights`` does).

    The matrices are converted and packed on up to ``LOAD_THREADS`` threads (packing releases the GIL:
    one thread repacked ~0.5 GB/s here, most of a warm load); they are installed in order, and an error
    is the first layer's in that order, as on one thread."""
    jobs: list[tuple[str, LinearBase, tuple[str, ...], Callable[[], Any]]] = []
    for module_name, layer in model.named_modules():
        if not isinstance(layer, LinearBase) or not isinstance(layer.method, GgufLinearMethod):
            continue
        siblings: tuple[tuple[str, ShardId], ...]
        if module_name == "lm_head":
            siblings = (("model.embed_tokens.weight" if tied else "lm_head.weight", None),)
        else:
            prefix, _, leaf = module_name.rpartition(".")
            siblings = tuple((f"{prefix}.{part}.weight", sid) for part, sid in _FUSED.get(leaf, ((leaf, None),)))
        names = [n for n, _ in siblings]
        found = [raw.get(n) for n in names]
        parts = [p for p in found if p is not None]
        if len(parts) != len(found) or common_type([p[2] for p in parts]) is None:
            continue  # keeps its float32 weight
        shard_ids = [sid for _, sid in siblings]
        jobs.append((module_name, layer, tuple(names),
                     functools.partial(_layer_matrix, layer, parts, shard_ids, names, convert)))
    workers = max(1, min(LOAD_THREADS, len(jobs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedrs-pack") as pool:
        matrices = list(pool.map(lambda job: job[3](), jobs))  # in order: the first failure in order is raised
    installed: dict[str, tuple[str, ...]] = {}
    for (module_name, layer, names_of, _), matrix in zip(jobs, matrices, strict=True):
        GgufLinearMethod.install(layer, matrix)
        installed[f"{module_name}.weight"] = names_of
    return installed


LOAD_THREADS = 4  # threads that convert and pack a model's matrices at load (at most the CPUs this process may use)


def _layer_matrix(layer: LinearBase, parts: list[tuple[np.ndarray, int, str]], shard_ids: list[ShardId],
                  names: list[str], convert: Callable[[np.ndarray, int, str, str, str], np.ndarray]) -> Any:
    """``layer``'s matrix (a ``GgufMatrix``: one format, or a fused product of its siblings' parts) from its
    siblings' raw blocks ``parts`` (blocks, columns, GGUF type): each sibling in its own kernel format, or, where
    a rank's columns cut a K-quant super-block, the narrower one (``rank_blocks`` checks the 32s)."""
    from pagedrs._core import GgufMatrix

    first, count = layer.col_shard()
    targets = [cast(str, kernel_type(kind)) for _, _, kind in parts]  # (all on the kernel: checked by the caller)
    targets = [t if not (first % block_columns(t) or count % block_columns(t)) else narrower(t) for t in targets]
    kept = [(convert(blocks, cols, kind, t, n), cols, t) for (blocks, cols, kind), t, n in zip(parts, targets, names)]
    if len(set(targets)) == 1:
        blocks, cols = rank_blocks(layer, kept, shard_ids, names)
        return GgufMatrix(blocks.reshape(-1), blocks.shape[0], cols, targets[0], "+".join(names))
    ranked = [rank_part(layer, part, sid, name) for part, sid, name in zip(kept, shard_ids, names)]
    return GgufMatrix.fused([GgufMatrix(b.reshape(-1), b.shape[0], c, t, n) for (b, c), t, n in zip(ranked, targets, names)],
                            "+".join(names))


def rank_blocks(layer: LinearBase, parts: Sequence[tuple[np.ndarray, int, str]], shard_ids: Sequence[ShardId],
                names: Sequence[str]) -> tuple[np.ndarray, int]:
    """This rank's raw blocks of ``layer`` (C-contiguous uint8 ``[rows, bytes per row]``) and their columns:
    each sibling's rows where ``layer.row_shard`` puts them, then the columns of ``layer.col_shard``.

    ``parts``: each sibling's (blocks ``[rows, bytes per row]``, columns, kernel format), in the fused row
    order, all of one format. A column shard must be whole blocks of the format (``block_columns``): refused
    by name otherwise."""
    rows: list[np.ndarray] = []
    cols = parts[0][1]
    for (blocks, _, _), sid, sibling in zip(parts, shard_ids, names, strict=True):
        offset, _, _ = layer.row_shard(sid)
        assert offset == sum(r.shape[0] for r in rows), "fused siblings' rows are in shard order"
        rows.append(_rank_rows(layer, blocks, cols, sid, sibling))
    out = np.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]
    return _rank_cols(layer, out, cols, parts[0][2], names)


def rank_part(layer: LinearBase, part: tuple[np.ndarray, int, str], shard_id: ShardId, name: str) -> tuple[np.ndarray, int]:
    """``rank_blocks`` of one sibling of a fused product whose siblings differ in format (one part each)."""
    blocks, cols, fmt = part
    return _rank_cols(layer, _rank_rows(layer, blocks, cols, shard_id, name), cols, fmt, [name])


def _rank_rows(layer: LinearBase, blocks: np.ndarray, cols: int, sid: ShardId, sibling: str) -> np.ndarray:
    """This rank's rows of one sibling's blocks (``layer.row_shard``), its shape checked against the layer's."""
    _, start, n = layer.row_shard(sid)
    if (blocks.shape[0], cols) != (layer.full_rows(sid), layer.in_features):
        raise ValueError(f"GGUF tensor {sibling!r} is [{blocks.shape[0]}, {cols}]; the layer needs "
                         f"[{layer.full_rows(sid)}, {layer.in_features}] (the whole tensor, before ranks split it)")
    return blocks[start:start + n]


def _rank_cols(layer: LinearBase, out: np.ndarray, cols: int, fmt: str, names: Sequence[str]) -> tuple[np.ndarray, int]:
    """This rank's columns (``layer.col_shard``) of blocks ``out`` in kernel format ``fmt``, C-contiguous."""
    first, count = layer.col_shard()
    if (first, count) != (0, cols):
        span = block_columns(fmt)
        if first % span or count % span:
            raise ValueError(
                f"weight_dtype 'gguf' with tensor_parallel_size={layer.tp_size}: GGUF tensor {'+'.join(names)!r} "
                f"({fmt}, {cols} columns) would be split at column {first} into {count} columns a rank, inside a block of "
                f"{span} columns (one scale each); a rank's columns must be a multiple of {span}: "
                "use a tensor_parallel_size that allows it, or weight_dtype 'int8', 'int4' or 'float32'")
        per_block = out.shape[1] // (cols // span)
        out = out[:, first // span * per_block:(first + count) // span * per_block]
        cols = count
    return np.ascontiguousarray(out), cols


def shards_hold_whole_blocks(config: dict[str, Any], tp: int) -> bool:
    """Whether every rank's columns of the row-parallel products (``o_proj``: heads x head_dim inputs,
    ``down_proj``: the intermediate size) are whole GGUF blocks on ``tp`` ranks (``rank_blocks``)."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return all(n % tp == 0 and (n // tp) % QK == 0
               for n in (heads * head_dim, int(config["intermediate_size"])))


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
