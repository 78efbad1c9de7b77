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
HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 128, 256)
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32)

# Attention kernels of cuda/paged_attention.cu: "v1" (paged_attention_kernel, tiles through
# shared memory, 16 rows a block) and "v2" (paged_attention_v2_kernel, independent warps with
# pipelined register loads, 4 rows a block). Both serve every entry of the table.
VARIANTS: tuple[str, ...] = ("v1", "v2")

COPY_BLOCKS = "pagedrs::copy_blocks_kernel"  # dtype-agnostic, one instance for every entry


@dataclass(frozen=True)
class KernelEntry:
    """The template instances serving one (dtype, head_size, block_size)."""

    dtype: str
    head_size: int
    block_size: int

    @property
    def cuda_type(self) -> str:
        return CUDA_TYPES[self.dtype]

    @property
    def attention(self) -> str:
        return f"pagedrs::paged_attention_kernel<{self.cuda_type}, {self.head_size}, {self.block_size}>"

    @property
    def attention_v2(self) -> str:
        return f"pagedrs::paged_attention_v2_kernel<{self.cuda_type}, {self.head_size}, {self.block_size}>"

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
        return f"pagedrs::reshape_and_cache_kernel<{self.cuda_type}>"

    @property
    def name_expressions(self) -> tuple[str, ...]:
        return (self.attention, self.attention_v2, self.reduce, self.reshape_and_cache, COPY_BLOCKS)


SUPPORTED: dict[tuple[str, int, int], KernelEntry] = {
    (dtype, head, block): KernelEntry(dtype, head, block)
    for dtype, head, block in product(CUDA_TYPES, HEAD_SIZES, BLOCK_SIZES)
}


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def lookup(dtype: object, head_size: int, block_size: int) -> KernelEntry:
    """The entry for a cache geometry; ValueError listing the supported values otherwise."""
    key = (dtype_name(dtype), int(head_size), int(block_size))
    entry = SUPPORTED.get(key)
    if entry is None:
        raise ValueError(
            f"no CUDA attention kernel for dtype={key[0]}, head_size={key[1]}, block_size={key[2]}; "
            f"supported: dtype in {list(CUDA_TYPES)}, head_size in {list(HEAD_SIZES)}, "
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
