"""A fingerprint of the weights, recorded in the disk store's header: pages written by
one model must never be read by another (their K/V would be wrong, silently).

It hashes the config and, for every tensor of the model's state, its name, shape, dtype and
every byte (SHA-256, which runs on the CPU's SHA extensions where it has them; measured at 0.27 GB/s on
a shared 2-core AMD EPYC at load 7, so ~2 s for SmolLM2's 538 MB of float32, once at start and only
for an engine with a disk tier). It used to hash a strided
sample of 4096 values a tensor: SmolLM2's embedding was read at column 0 of every 12th row, so a
fine-tune that retrained a few tokens' rows (added tokens, a chat template's) kept the fingerprint,
and the second model was served the first one's pages: wrong tokens with no error
(``tests/test_kv_tiers.py::test_a_model_that_differs_in_one_embedding_row_gets_a_fresh_store``).

Weights that live outside torch's tensors count too (``_outside_torch``): a GGUF model's
matrices are the Rust GEMV's tiles (their modules' ``weight`` is None) and its token table
may be a ``BlockEmbedding`` of raw blocks. Before they were hashed, such a model's
``state_dict`` held its norms alone, all ones in most checkpoints, so two different GGUF
models of one geometry (or one model in two quantizations) shared a fingerprint and the
disk tier served one model's pages to the other.

A speculative draft model is left out on purpose: the store holds the target's layers only (the
draft mirrors no disk transfer), and a page read back never serves draft K/V (a new sequence's draft
feeds its context from position 0, spec/draft.py), so a store serves any draft alike
(tests/test_spec_draft.py pins both; a change that stored the draft's layers would have to add it here).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

_PROBE_SEED = 0x9A6ED  # the probe rows' values: fixed, so every process computes the same digest


def model_fingerprint(model: torch.nn.Module, config: object) -> str:
    h = hashlib.sha256()
    h.update(repr(config).encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            h.update(_bytes_of(p))
    _outside_torch(model, h)
    return h.hexdigest()[:32]


def _bytes_of(tensor: torch.Tensor) -> bytes | memoryview:
    """Every byte of ``tensor`` as stored (any dtype, fp8 and bool included), copied to the host once."""
    flat = tensor.detach().reshape(-1).contiguous().to("cpu")
    return flat.view(torch.uint8).numpy().data if flat.numel() else b""


def _outside_torch(model: torch.nn.Module, h: Any) -> None:
    """Hashes the weights ``state_dict`` does not hold, in module order.

    A GGUF matrix by its product with two fixed probe rows: every weight (and every block scale)
    moves the result, and the kernels give the same bits on every path and thread count (their
    contract, tested), so the digest does not depend on the machine. It streams each matrix once:
    ~20 ms for SmolLM2's 96 MB, and only for an engine with a disk tier. A block table's own blocks
    are hashed whole; one that reads the head's tiles is covered by the head's matrix.
    """
    from pagedrs.models.embedding import BlockEmbedding

    seen: set[int] = set()
    for name, module in model.named_modules():
        matrix = getattr(module, "gguf_matrix", None)
        if matrix is not None and id(matrix) not in seen:
            seen.add(id(matrix))
            h.update(f"{name}:gguf:{matrix.format}:{matrix.rows}x{matrix.cols}".encode())
            h.update(np.ascontiguousarray(matrix.matmul(_probe(matrix.cols), threads=1)).tobytes())
        if isinstance(module, BlockEmbedding):
            h.update(f"{name}:blocks:{module.qtype}:{module.num_embeddings}x{module.embedding_dim}".encode())
            if module.blocks is not None:
                h.update(np.ascontiguousarray(module.blocks).data)  # (the buffer itself: no copy of the table)
            else:
                h.update(b"the head's tiles")


def _probe(cols: int) -> np.ndarray:
    """float32 [2, cols] of magnitudes in [0.5, 1) and random signs. Not near zero: the kernels
    quantize their input to int8 per block of 32, and a value below half a step would be code 0,
    hiding its column's weights. Two rows of other values, so that changes in several weights of a
    row cannot cancel in both."""
    rng = np.random.default_rng(_PROBE_SEED)
    magnitude = rng.uniform(0.5, 1.0, (2, cols))
    sign = np.where(rng.random((2, cols)) < 0.5, -1.0, 1.0)
    return (magnitude * sign).astype(np.float32)
