"""The one table from runtime values to compiled template instances.

Head size and block size must be compile-time constants in the attention kernel
(register arrays and shifts are sized by them), so every supported combination is
listed here, and nowhere else. Anything missing fails with the list of what exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

# dtype name (torch.dtype without the "torch." prefix) -> C++ storage type in cuda/dtype.cuh
CUDA_TYPES: dict[str, str] = {"float16": "pagedrs::half_t", "bfloat16": "pagedrs::bf16_t", "float32": "float"}
# 8-bit KV cache storage (EngineArgs.kv_cache_dtype fp8_e4m3 / fp8_e5m2) -> its C++ type
FP8_CACHE_TYPES: dict[str, str] = {"float8_e4m3fn": "pagedrs::fp8_e4m3_t", "float8_e5m2": "pagedrs::fp8_e5m2_t"}
# Query dtypes an fp8 cache is built for: the GPU's 16-bit model dtypes (a float32 model with an fp8
# cache runs on the PyTorch backend; every instance costs NVRTC time in `--check`).
FP8_QUERY_DTYPES: tuple[str, ...] = ("float16", "bfloat16")
HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 128, 256)
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32)

# Attention kernels of cuda/paged_attention.cu: "v1" (paged_attention_kernel, tiles through
# shared memory, 16 rows a block) and "v2" (paged_attention_v2_kernel, independent warps with
# pipelined register loads, 4 rows a block). Both serve every entry of the table.
VARIANTS: tuple[str, ...] = ("v1", "v2")

COPY_BLOCKS = "pagedrs::copy_blocks_kernel"  # dtype-agnostic, one instance for every entry


@dataclass(frozen=True)
class KernelEntry:
    """The template instances serving one (dtype, cache dtype, head_size, block_size).

    ``dtype`` is the queries' and the output's; ``cache_dtype`` the KV cache's storage (the
    same, or an fp8 type of ``FP8_CACHE_TYPES``)."""

    dtype: str
    head_size: int
    block_size: int
    cache_dtype: str = ""  # "" = dtype

    @property
    def cache(self) -> str:
        """The cache's dtype name."""
        return self.cache_dtype or self.dtype

    @property
    def cuda_type(self) -> str:
        return CUDA_TYPES[self.dtype]

    @property
    def cache_cuda_type(self) -> str:
        return FP8_CACHE_TYPES.get(self.cache) or CUDA_TYPES[self.cache]

    @property
    def is_fp8(self) -> bool:
        return self.cache in FP8_CACHE_TYPES

    @property
    def _types(self) -> str:
        return f"{self.cuda_type}, {self.cache_cuda_type}"

    @property
    def attention(self) -> str:
        return f"pagedrs::paged_attention_kernel<{self._types}, {self.head_size}, {self.block_size}>"

    @property
    def attention_v2(self) -> str:
        return f"pagedrs::paged_attention_v2_kernel<{self._types}, {self.head_size}, {self.block_size}>"

    def attention_kernel(self, variant: str) -> str:
        """The attention instance of ``variant`` (see ``VARIANTS``)."""
        if variant not in VARIANTS:
            raise ValueError(f"attention kernel variant={variant!r}; expected one of {list(VARIANTS)}")
        return self.attention if variant == "v1" else self.attention_v2

    @property
    def reduce(self) -> str:
        return f"pagedrs::attention_reduce_kernel<{self.cuda_type}>"

    @property
    def reshape_and_cache(self) -> str:
        return f"pagedrs::reshape_and_cache_kernel<{self._types}>"

    @property
    def name_expressions(self) -> tuple[str, ...]:
        return (self.attention, self.attention_v2, self.reduce, self.reshape_and_cache, COPY_BLOCKS)


# (query dtype, cache dtype, head_size, block_size) -> its instances
SUPPORTED: dict[tuple[str, str, int, int], KernelEntry] = {
    (dtype, dtype, head, block): KernelEntry(dtype, head, block)
    for dtype, head, block in product(CUDA_TYPES, HEAD_SIZES, BLOCK_SIZES)
}
SUPPORTED.update({
    (dtype, cache, head, block): KernelEntry(dtype, head, block, cache)
    for dtype, cache, head, block in product(FP8_QUERY_DTYPES, FP8_CACHE_TYPES, HEAD_SIZES, BLOCK_SIZES)
})


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def lookup(dtype: object, head_size: int, block_size: int, cache_dtype: object = None) -> KernelEntry:
    """The entry for a cache geometry (``cache_dtype`` None: the cache holds ``dtype``);
    ValueError listing the supported values otherwise."""
    name = dtype_name(dtype)
    cache = name if cache_dtype is None else dtype_name(cache_dtype)
    key = (name, cache, int(head_size), int(block_size))
    entry = SUPPORTED.get(key)
    if entry is None:
        cache_part = "" if cache == name else f", cache dtype={cache}"
        raise ValueError(
            f"no CUDA attention kernel for dtype={name}{cache_part}, head_size={key[2]}, block_size={key[3]}; "
            f"supported: dtype in {list(CUDA_TYPES)} with a cache of the same dtype, or dtype in "
            f"{list(FP8_QUERY_DTYPES)} with a cache in {list(FP8_CACHE_TYPES)}; head_size in {list(HEAD_SIZES)}, "
            f"block_size in {list(BLOCK_SIZES)} (PAGEDRS_ATTENTION_BACKEND=torch runs any geometry)"
        )
    return entry


def all_name_expressions() -> list[str]:
    """Every distinct instance in the table, in a stable order (for one-TU compiles)."""
    seen: dict[str, None] = {}
    for entry in SUPPORTED.values():
        for expr in entry.name_expressions:
            seen.setdefault(expr, None)
    return list(seen)
