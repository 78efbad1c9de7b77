"""Cascade attention for decode steps whose sequences share prefix pages (torch backend, CPU).

Sequences that share a system prompt, a conversation's history or a parent's prompt (n > 1,
beam search) point at the same physical pages. The padded attention of the torch backend
gathers every sequence's pages into its own rows, so 32 chats behind one 600-token prompt
copy those 600 tokens' K/V 32 times per layer and read them 32 times more. Here the shared
pages are attended once per group, with every sequence's query heads stacked into one
query block, and each sequence attends only to its own remaining pages; the two partial
results are merged exactly with their log-sum-exps (FlashInfer's cascade inference, and
vLLM's cascade attention, do the same on GPUs)::

    o = (o_shared * e^(lse_shared - m) + o_own * e^(lse_own - m)) / (e^(lse_shared - m) + e^(lse_own - m))

with m the larger of the two lse. Only pages wholly before each member's last token are
shared here (full pages, all visible to a decode query), so every sequence keeps at least
its last page of its own, and no mask is needed on the shared part.

Planned once per step (``plan_cascade``) from the host copy of the block tables; used only
for decode-only buckets without a sliding window, on the CPU (``aten::_scaled_dot_product_
flash_attention_for_cpu`` returns the log-sum-exp the merge needs), and only when it saves
at least a quarter of the pages the padded path would gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrs.attention.stale_keys import stale_rows, zero_stale

# Below this share of gathered pages saved, the extra calls cost more than they save.
MIN_SAVED_FRACTION = 0.25


@dataclass(frozen=True)
class SharedPrefix:
    """Sequences (positions in their bucket) whose tables all begin with ``blocks``."""

    seqs: torch.Tensor  # int64 [G], G >= 2
    blocks: torch.Tensor  # int64 [P], P >= 1


@dataclass(frozen=True)
class OwnPages:
    """Sequences (positions in the step's decode set) of similar own length, and their own pages."""

    seqs: torch.Tensor  # int64 [S']
    tables: torch.Tensor  # int64 [S', B]  each sequence's pages after its group's shared ones, padded
    mask: torch.Tensor  # float [S', 1, 1, B * block_size]  0 = may attend, -inf = padding or past the end
    stale: torch.Tensor | None = None  # int64 [N]  gathered key rows past the end, zeroed (stale_keys); None: none


@dataclass(frozen=True)
class Cascade:
    num_seqs: int
    groups: list[SharedPrefix]
    own: list[OwnPages]  # every sequence in exactly one, bucketed within 2x of own length


def plan_cascade(tables: list[list[int]], seq_lens: list[int], block_size: int, device: torch.device) -> Cascade | None:
    """The cascade plan of a step's decode sequences, or None when sharing would not pay.

    ``tables[s]`` are the pages sequence ``s`` reads (as many as its length needs).
    Sequences are grouped by their first page; a group shares the longest run of leading
    pages all its members have, cut to pages wholly before each member's last token.
    Each sequence's own pages are then attended in buckets of own lengths within 2x of
    each other (the padding bound of the padded path, applied to the part still padded).
    """
    by_first: dict[int, list[int]] = {}
    for s, table in enumerate(tables):
        if table[0] >= 0:  # a window's released pages (-1) are never read here, nor shared
            by_first.setdefault(table[0], []).append(s)
    shared_len = [0] * len(tables)
    groups: list[tuple[list[int], list[int]]] = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min((seq_lens[s] - 1) // block_size for s in members)
        first = tables[members[0]]
        run = 0
        while run < limit and all(tables[s][run] == first[run] for s in members):
            run += 1
        if run == 0:
            continue
        groups.append((members, first[:run]))
        for s in members:
            shared_len[s] = run
    total = sum(len(t) for t in tables)
    saved = sum((len(members) - 1) * len(blocks) for members, blocks in groups)
    if not groups or saved < MIN_SAVED_FRACTION * total:
        return None
    by_length: dict[int, list[int]] = {}
    for s, table in enumerate(tables):
        by_length.setdefault((len(table) - shared_len[s]).bit_length(), []).append(s)
    own = []
    for seqs in by_length.values():
        pages = [tables[s][shared_len[s]:] for s in seqs]
        width = max(len(p) for p in pages)
        k_pos = torch.arange(width * block_size, device=device)[None, :]
        own_len = torch.tensor([seq_lens[s] - shared_len[s] * block_size for s in seqs], device=device)[:, None]
        past_end = k_pos >= own_len
        mask = torch.zeros(len(seqs), width * block_size, device=device).masked_fill_(past_end, float("-inf"))
        own.append(OwnPages(
            seqs=torch.tensor(seqs, device=device),
            tables=torch.tensor([p + [p[0]] * (width - len(p)) for p in pages], dtype=torch.int64, device=device),
            mask=mask[:, None, None, :],
            stale=stale_rows(~past_end),
        ))
    return Cascade(
        num_seqs=len(tables),
        groups=[SharedPrefix(torch.tensor(m, device=device), torch.tensor(b, device=device)) for m, b in groups],
        own=own,
    )


def attend_cascade(
    query: torch.Tensor,  # [T, h, d]: the whole step's queries
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    value_cache: torch.Tensor,
    rows: torch.Tensor,  # int64 [S]: each sequence's (single) query row
    cascade: Cascade,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an fp8 cache's (k_scale, v_scale) (kv_quant)
) -> torch.Tensor:  # [S, h, d]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    num_seqs = cascade.num_seqs
    block_size, kv_heads, head_dim = key_cache.shape[1:]
    heads = query.shape[1]
    group = heads // kv_heads
    # A decode query is one row: its `group` heads per KV head take the place of query rows.
    q = query[rows].view(num_seqs, kv_heads, group, head_dim)
    out = q.new_empty(num_seqs, kv_heads, group, head_dim)
    lse = q.new_empty(num_seqs, kv_heads, group, dtype=torch.float32)

    def pages(cache: torch.Tensor, index: torch.Tensor, which: int) -> torch.Tensor:
        got = cache[index]
        if kv_scales is not None:  # fp8: widen what is read
            return got.to(query.dtype).mul_(kv_scales[which])
        return got if got.dtype == query.dtype else got.to(query.dtype)  # bfloat16 pages of a float32 model

    for part in cascade.own:
        n, keys = part.seqs.shape[0], part.tables.shape[1] * block_size
        k = pages(key_cache, part.tables, 0).view(n, keys, kv_heads, head_dim)
        v = pages(value_cache, part.tables, 1).view(n, keys, kv_heads, head_dim)
        zero_stale(k, v, part.stale)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        o, part_lse = flash(q[part.seqs], k, v, 0.0, False, attn_mask=part.mask, scale=scale)  # [n, kvh, g, d], [n, kvh, g]
        out[part.seqs] = o
        lse[part.seqs] = part_lse
    for shared in cascade.groups:
        members = shared.seqs.shape[0]
        length = shared.blocks.shape[0] * block_size
        ks = pages(key_cache, shared.blocks, 0).view(1, length, kv_heads, head_dim).transpose(1, 2)
        vs = pages(value_cache, shared.blocks, 1).view(1, length, kv_heads, head_dim).transpose(1, 2)
        qs = q[shared.seqs].permute(1, 0, 2, 3).reshape(1, kv_heads, members * group, head_dim)
        o_shared, lse_shared = flash(qs, ks, vs, 0.0, False, scale=scale)
        o_shared = o_shared.view(kv_heads, members, group, head_dim).permute(1, 0, 2, 3)
        lse_shared = lse_shared.view(kv_heads, members, group).permute(1, 0, 2)
        o_own, lse_own = out[shared.seqs], lse[shared.seqs]
        top = torch.maximum(lse_shared, lse_own)
        w_shared, w_own = torch.exp(lse_shared - top), torch.exp(lse_own - top)
        merged = (o_shared * w_shared[..., None] + o_own * w_own[..., None]) / (w_shared + w_own)[..., None]
        out[shared.seqs] = merged.to(out.dtype)
    return out.reshape(num_seqs, heads, head_dim)
