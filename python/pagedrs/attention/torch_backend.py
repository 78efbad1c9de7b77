"""TorchAttentionBackend: paged attention in plain PyTorch, on the CPU and on CUDA.

This is the reference the CUDA kernels are compared with, so it favours being
obviously right over being fast: K/V are scattered into their slots with one
``index_copy_``, and each sequence gathers its own pages through its block table
before a causal ``scaled_dot_product_attention``. Steps made only of decode
tokens take a batched path (pages of all sequences gathered at once, padded,
masked by length), which is where a serving loop spends most of its steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedrs.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        # [num_blocks, block_size, h, d] -> [num_slots, h, d]; slot = block * block_size + offset.
        num_kv_heads, head_dim = key_cache.shape[-2:]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value.to(value_cache.dtype))

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        block_size = key_cache.shape[1]
        starts = meta.query_start_loc_cpu
        # One-token rows (decodes, resumed sequences) attend to their whole context: batch
        # them, in buckets of similar length so that padding to the longest stays small.
        single = [i for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1]
        for bucket in _length_buckets(single, meta.seq_lens_cpu, block_size):
            rows = torch.tensor([starts[i] for i in bucket], device=query.device)
            index = torch.tensor(bucket, device=meta.block_tables.device)
            out[rows] = _attend_last_tokens(
                query[rows], key_cache, value_cache, meta.block_tables[index], meta.seq_lens[index],
                max(meta.seq_lens_cpu[i] for i in bucket), scale,
            )
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            q = query[starts[i] : starts[i + 1]]  # [q_len, h, d]
            q_len = q.shape[0]
            if q_len <= 1:
                continue  # empty, or done above
            k, v = _gather_pages(key_cache, value_cache, meta.block_tables[i], seq_len, block_size)
            # new tokens sit at positions seq_len - q_len .. seq_len - 1; token at p sees keys 0..p.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[starts[i] : starts[i + 1]] = o.transpose(0, 1)
        return out

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        pairs = pairs.to(kv_cache.device)
        # index_select makes a copy first, so a block that is both a source and a destination is safe.
        kv_cache.index_copy_(2, pairs[:, 1], kv_cache.index_select(2, pairs[:, 0]))

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        # Only a host-to-device copy may be asynchronous: a device-to-host one with
        # non_blocking=True could be read on the host before it has landed.
        moved = src_cache.index_select(2, pairs[:, 0].to(src_cache.device))
        moved = moved.to(dst_cache.device, non_blocking=dst_cache.device.type == "cuda")
        dst_cache.index_copy_(2, pairs[:, 1].to(dst_cache.device), moved)


def _length_buckets(seqs: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Groups sequences whose context lengths are within 2x of each other (in blocks).

    The batched path pads every sequence to its bucket's longest context; with long-tailed
    lengths one bucket would gather and attend over mostly padding. Doubling buckets keep
    the padded work under twice the real work for a handful of calls per layer.
    """
    buckets: dict[int, list[int]] = {}
    for i in seqs:
        blocks = -(-seq_lens[i] // block_size)
        buckets.setdefault(blocks.bit_length(), []).append(i)
    return [buckets[k] for k in sorted(buckets)]


def _attend_last_tokens(
    query: torch.Tensor,  # [S, h, d]: the last token of each sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, >= ceil(max_seq_len / block_size)]
    seq_lens: torch.Tensor,  # [S]
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [S, h, d]
    """One query per sequence, at its last position, over all its pages: one padded, masked SDPA."""
    num_seqs = query.shape[0]
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    num_blocks = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_blocks].long()  # [S, nb]
    k = key_cache[tables].view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    v = value_cache[tables].view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    k_pos = torch.arange(num_blocks * block_size, device=query.device)
    mask = k_pos[None, :] < seq_lens.to(query.device).long()[:, None]  # [S, L]; padding masked out
    o = F.scaled_dot_product_attention(
        query[:, :, None, :],  # [S, h, 1, d]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return o[:, :, 0, :]


def _gather_pages(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` keys and values of one sequence, in token order: [seq_len, kv_heads, d] each."""
    blocks = block_table[: -(-seq_len // block_size)].long()
    num_kv_heads, head_dim = key_cache.shape[-2:]
    k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return k, v
