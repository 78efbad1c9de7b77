"""Every decoder layer of a GGUF model in one Rust call on the CPU (``pagedrs._core.DecodeStack``).

Why: with its linear layers on the Rust GEMV (``gguf_linear``), a batch-1 decode step on a
2-core Xeon spent about half its time outside them, in ~190 small torch ops per layer (norms,
rotary, the page gather, SDPA, residual adds): microseconds of dispatch each for nanoseconds
of work, all on one thread. ``rust/src/cpu_decode`` runs a layer as a few loops over the
step's rows, attends over the pages in place (no gather, no mask) and shares products and
attention heads over the GEMV's thread team.

It runs a step when the model is wholly on the kernel (every layer's four products have a
GGUF matrix, one tensor-parallel rank, float32 activations) and the step's pages are a
float32 or fp8 cache read by the torch backend; anything else (a dense layer, CUDA) takes
the torch ops of ``llama_layer.decoder_layer``. An fp8 cache (``kv_cache_dtype="fp8_e4m3"`` /
``"fp8_e5m2"``) is handed over as its bytes with the backend's scales; the stack writes and reads
the codes by the torch backend's rule (``attention.kv_quant``; ``rust/src/cpu_decode/kv_fp8.rs``),
so a page either path wrote reads the same in the other. Every row is computed on its own, so a row's bits do
not depend on its batch, its thread count or its kind of step (decode, speculative
verification, prompt): a sequence decodes the same tokens alone or in any batch.

It is not the torch path's bits: the norms' and attention's sums run in another order, about
1e-6 relative (``tests/test_cpu_decode.py`` bounds the difference; ``tests/test_quant.py``
measures the quality of what runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from pagedrs.attention.base import AttentionBackend, AttentionMetadata
from pagedrs.models.embedding import numpy_rows
from pagedrs.models.gguf_linear import GgufLinearMethod
from pagedrs.models.layers import LinearBase
from pagedrs.step_input import value_bounds

if TYPE_CHECKING:
    from pagedrs._core import DecodeStack
    from pagedrs.models.llama import DecoderLayer, LlamaForCausalLM
    from pagedrs.step_input import StepInput


class FusedCpuDecode:
    """The model's ``DecodeStack`` and what it needs per step (the kernel's thread count, rotary)."""

    def __init__(self, stack: DecodeStack, threads_of: GgufLinearMethod, model: LlamaForCausalLM) -> None:
        self.stack = stack
        self._method = threads_of  # one layer's method: hand_cpu_threads_to_gemv sets the same count on every layer
        self._rotary = model.rotary
        self._layers = model.config.num_hidden_layers
        # the embedding's rows in NumPy for decode_step (a view of a float32 table, or the blocks' rows);
        # the stack is rebuilt with the model's other records when its parameters are replaced
        # (LlamaForCausalLM.bind)
        self._embed_rows = numpy_rows(model.model.embed_tokens)
        self._vocab = int(model.model.embed_tokens.num_embeddings)
        self.enabled = True  # False: every step takes the torch ops (tests compare the two)
        # what ``runs`` and ``_whole_cache`` found for the runner's views (``_ViewsMemo``)
        self._memo: _ViewsMemo | None = None
        # the cache's format and scales for the stack, set by ``runs`` (called before every step here)
        self._kv_args: tuple[str, float, float] = ("float32", 1.0, 1.0)

    @staticmethod
    def build(model: LlamaForCausalLM) -> FusedCpuDecode | None:
        """The stack of ``model``, or None when some part of it is not on the kernel."""
        from pagedrs._core import DecodeStack, GgufMatrix

        layers = [cast("DecoderLayer", layer) for layer in model.model.layers]
        if model.model.norm.weight.device.type != "cpu" or model.weight_format.params_dtype != torch.float32:
            return None
        # per layer: qkv, o, gate_up, down
        linears: list[LinearBase] = [m for layer in layers for m in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        # only the fused QKV may carry a bias (Qwen2's); the stack adds no other
        if not all(_on_kernel(m) for m in linears) or any(m.bias is not None for i, m in enumerate(linears) if i % 4):
            return None
        config = model.config

        def f32(t: torch.Tensor) -> np.ndarray:
            return np.ascontiguousarray(t.detach().to(torch.float32).numpy())

        def matrices(k: int) -> list[GgufMatrix]:
            return [getattr(m, "gguf_matrix") for m in linears[k::4]]  # noqa: B009  # set by install_gguf_weights

        stack = DecodeStack(
            input_norms=[f32(layer.input_layernorm.weight) for layer in layers],
            post_norms=[f32(layer.post_attention_layernorm.weight) for layer in layers],
            qkv=matrices(0),
            qkv_bias=[None if m.bias is None else f32(m.bias) for m in linears[0::4]],
            o=matrices(1), gate_up=matrices(2), down=matrices(3),
            sliding_windows=[layer.self_attn.sliding_window for layer in layers],
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, intermediate=config.intermediate_size, eps=config.rms_norm_eps,
            scale=config.head_dim**-0.5,
            # the final norm too: a torch op right after the stack runs cold (30-87 us for one row, 4-9 warm)
            final_norm=f32(model.model.norm.weight),
        )
        return FusedCpuDecode(stack, cast(GgufLinearMethod, linears[0].method), model)

    def runs(self, kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend) -> bool:
        """Whether this step runs here: a float32, bfloat16 or fp8 CPU cache that the torch backend reads."""
        if not self.enabled:
            return False
        memo = self._memo_of(kv_cache)
        if memo is not None and memo.backend is backend:
            self._kv_args = memo.kv_args
            return memo.runs
        from pagedrs.attention.torch_backend import TorchAttentionBackend

        first = kv_cache[0] if isinstance(kv_cache, torch.Tensor) else kv_cache[0][0]
        kv_dtype = _KV_DTYPES.get(first.dtype)
        answer = isinstance(backend, TorchAttentionBackend) and kv_dtype is not None and first.device.type == "cpu"
        self._kv_args = (kv_dtype or "float32", 1.0, 1.0)
        if answer and kv_dtype is not None and first.dtype in _FP8:  # only an fp8 cache has scales
            k_scale, v_scale = backend.kv_scales(first.device)
            self._kv_args = (kv_dtype, float(k_scale), float(v_scale))
        if not isinstance(kv_cache, torch.Tensor):  # (a whole tensor's kv_cache[0] is a new view each time)
            self._memo = _ViewsMemo(kv_cache, kv_cache[0], kv_cache[-1], backend, answer, self._kv_args)
        return answer

    def _memo_of(self, kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]]) -> _ViewsMemo | None:
        """The memo, when it is of these very views (the same list, holding the same first and last layers)."""
        memo = self._memo
        if memo is None or isinstance(kv_cache, torch.Tensor) or memo.views is not kv_cache:
            return None
        return memo if kv_cache[0] is memo.first and kv_cache[-1] is memo.last else None

    def _cache_array(self, kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]]) -> np.ndarray:
        """``_whole_cache`` as NumPy, found once per views."""
        memo = self._memo_of(kv_cache)
        if memo is not None and memo.cache is not None:
            return memo.cache
        tensor = _whole_cache(kv_cache, self._layers)
        # NumPy has neither fp8 nor bfloat16: their codes (the stack reads a bfloat16 as its 16 bits)
        if tensor.dtype in _FP8:
            whole = tensor.view(torch.uint8).numpy()
        elif tensor.dtype == torch.bfloat16:
            whole = tensor.view(torch.int16).numpy().view(np.uint16)
        else:
            whole = tensor.numpy()
        if memo is not None:
            memo.cache = whole
        return whole

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """The last layer's ``residual + h`` after the model's final norm [T, hidden] (what the head
        reads); writes the K/V. The model's path (``LlamaForCausalLM.forward``)."""
        out = self.run_stack(h.numpy(), self._rotary.cos_sin_rows(positions).numpy(), kv_cache,
                             meta.slot_mapping.numpy(), meta.query_start_loc.numpy(), meta.seq_lens.numpy(),
                             meta.block_tables.numpy())
        return torch.from_numpy(out)

    def decode_step(self, step: StepInput,
                    kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """``forward`` of a whole step straight from its arrays (the runner's path): the embeddings and
        the rotary rows by NumPy ``take`` (the same values as ``F.embedding`` and ``cos_sin_rows``), no
        attention metadata, no torch op before the head. Why: after the stack has streamed the weights
        each torch op runs cold (a one-row ``rms_norm`` 30-87 us against 4 warm), and a batch-1 step
        made about ten of them around the stack. The stack checks the step's layout itself before it
        writes a page. None when the embedding table is not float32 (the model's path then runs)."""
        rows = self._embed_rows
        if rows is None:
            return None
        ids = step.input_ids
        lo, hi = value_bounds(ids)
        if lo < 0 or hi >= self._vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"input_ids: token {bad} is outside the vocabulary; allowed 0 to {self._vocab - 1}")
        out = self.run_stack(rows(ids), self._rotary.cos_sin_rows_np(step.positions), kv_cache,
                             step.slot_mapping, step.query_start_loc, step.seq_lens, step.block_tables)
        return torch.from_numpy(out)

    def run_stack(self, h: np.ndarray, cos_sin: np.ndarray,
                  kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]], slot_mapping: np.ndarray,
                  query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray) -> np.ndarray:
        """The Rust stack over one step (it writes the step's K/V into the cache): float32 [T, hidden]."""
        threads = self._method.threads or torch.get_num_threads()
        kv_dtype, k_scale, v_scale = self._kv_args  # what ``runs`` found for this cache, just before
        return self.stack.forward(h, cos_sin, self._cache_array(kv_cache), slot_mapping, query_start_loc, seq_lens,
                                  block_tables, threads, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)


@dataclass
class _ViewsMemo:
    """What one runner's views gave, kept while the same views come back (the runner hands the same
    list every step). Why: each torch call in ``runs`` and ``_whole_cache`` runs cold after the stack
    has streamed the weights (24 us a batch-1 step for the cache alone). The views are held (not
    their ids), so a freed cache is never mistaken for a new one."""

    views: object
    first: object  # views[0] and views[-1] when it was made: a list refilled in place is not these views
    last: object
    backend: object
    runs: bool
    kv_args: tuple[str, float, float]  # the stack's kv_dtype, k_scale, v_scale for this cache
    cache: np.ndarray | None = None  # the whole cache as NumPy (an fp8 one's bytes), once the stack first ran on these views


# the cache dtypes the stack reads, by the name it takes them under
_KV_DTYPES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "fp8_e4m3",
                                      torch.float8_e5m2: "fp8_e5m2"}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _on_kernel(layer: LinearBase) -> bool:
    return (isinstance(layer.method, GgufLinearMethod) and getattr(layer, "gguf_matrix", None) is not None
            and layer.tp_size == 1)


def _whole_cache(kv_cache: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]], layers: int) -> torch.Tensor:
    """The ``[layers, 2, blocks, block_size, kv_heads, d]`` tensor behind ``kv_layer_views`` (the runner
    hands the views; they are its slices, so their base is the cache)."""
    if isinstance(kv_cache, torch.Tensor):
        whole = kv_cache
    else:
        base = kv_cache[0][0]._base
        if base is None or base.dim() != 6 or base.shape[0] != layers or len(kv_cache) != layers \
                or kv_cache[-1][1].data_ptr() != base[-1, 1].data_ptr():
            raise ValueError("kv_cache: the fused CPU decode needs the views of one [layers, 2, ...] cache tensor "
                             "(ModelRunner.kv_views)")
        whole = base
    if not whole.is_contiguous():
        raise ValueError(f"kv_cache: must be contiguous; got strides {whole.stride()}")
    return whole
