"""The draft model of ``speculative_config={"method": "draft_model", ...}`` on the executor's
side: its weights, its KV pages, and its greedy proposals.

KV: the target's block tables, with the draft's layers added to each page. The draft has a
second set of KV tensors (device and host), of the same ``num_blocks`` and ``block_size`` as the
target's, indexed by the same block ids and slot mapping. Why this and not block tables of its
own: the Rust core's accounting stays exactly as it is (a page is a page, whatever layers it
holds), so everything it already gets right — copy-on-write, swap, prefix sharing, rollback of
rejected drafts by ``BlockManager.truncate`` — holds for the draft's pages too, with no second
allocator to keep in step. The price is that a page's bytes are the target's plus the draft's:
the pool sizing counts both (``LocalExecutor.plan_kv_memory``), or the engine would
over-allocate memory. The plan's tier transfers between device and host and its copy-on-write
copies are mirrored onto the draft's tensors (``mirror``); pages read back from the disk tier
are not (the store holds the target's layers only): their draft K/V is stale, which the core
side's rule (spec/draft.py) never relies on.

Proposing runs after the core's plan, on the plan's own slots: the core first reserved k
positions per speculating sequence (a proposal of reserved tokens), so every position the
draft writes belongs to that sequence alone (the append copied a shared page on write). The
first draft step feeds the positions the draft has not written yet (the last sampled token,
the bonus or correction of the step before, a prefill it has not seen), in chunks; each next
step feeds the previous draft token. Greedy (argmax) drafts: a deterministic proposal, which
is what keeps the verification exact (core/spec_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedrs.model_runner import ModelRunner
from pagedrs.models.kv_geometry import KvGeometry
from pagedrs.models.loader import LoadedModel, load_model
from pagedrs.step_input import StepInput


@dataclass(frozen=True)
class DraftFeed:
    """One speculating sequence's draft work: its tokens from ``start`` to its last sampled one."""

    table: np.ndarray  # int32 [max_blocks] its block table (the plan's row)
    start: int  # first position the draft feeds (everything before holds its K/V)
    tokens: list[int]  # the tokens at start .. L - 1 (L: its length before the drafts)
    k: int  # drafts to propose (the plan's count)


def load_draft(path: str, target: LoadedModel, *, dtype: str, weight_dtype: str) -> LoadedModel:
    """Loads the draft on the target's device and refuses one that cannot serve as its draft: it
    must load, and have the target's vocabulary (sizes of the config, the embedding and the
    tokenizer, and the ids of the special tokens). Errors name ``speculative_config.model``."""
    try:
        draft = load_model(path, dtype=dtype, device=target.device, weight_dtype=weight_dtype)
    except Exception as exc:  # noqa: BLE001 - whatever the loader's reason, it names the field here
        raise ValueError(f"speculative_config.model is {path!r}: it does not load as a draft model "
                         f"({type(exc).__name__}: {exc}); it must be a local Hugging Face folder or GGUF file "
                         "of the target's vocabulary") from exc
    differences = vocabulary_differences(draft, target)
    if differences:
        what, mine, theirs = differences[0]
        raise ValueError(f"speculative_config.model is {path!r}: its {what} is {mine}, the target's is {theirs}; "
                         "a draft model must have the target's vocabulary (the same tokenizer)")
    return draft


def vocabulary_differences(draft: LoadedModel, target: LoadedModel) -> list[tuple[str, object, object]]:
    """(what, draft's, target's) for every vocabulary trait in which the two differ."""
    def embedding_rows(m: LoadedModel) -> int:
        return int(m.model.model.embed_tokens.num_embeddings)

    traits: list[tuple[str, object, object]] = [
        ("config vocab_size", draft.config.vocab_size, target.config.vocab_size),
        ("embedding size (rows)", embedding_rows(draft), embedding_rows(target)),
        ("eos token ids", sorted(draft.tokenizer.eos_token_ids), sorted(target.tokenizer.eos_token_ids)),
    ]
    if draft.tokenizer.hf is not None and target.tokenizer.hf is not None:
        traits.append(("tokenizer size", len(draft.tokenizer.hf), len(target.tokenizer.hf)))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            traits.append((f"tokenizer {name}", getattr(draft.tokenizer.hf, name, None),
                           getattr(target.tokenizer.hf, name, None)))
    return [t for t in traits if t[1] != t[2]]


class DraftRunner:
    """The draft's weights, KV tensors (``init_kv_cache``) and proposals."""

    def __init__(self, loaded: LoadedModel, *, block_size: int, kv_cache_dtype: torch.dtype) -> None:
        self.loaded = loaded
        self.block_size = block_size
        self.kv_dtype = kv_cache_dtype
        self.runner: ModelRunner | None = None
        self._mirrored_step = -1  # the step whose transfers and copies the draft's tensors have had

    def bytes_per_token(self) -> int:
        """What the draft's layers add to each token of a page."""
        c = self.loaded.config
        return KvGeometry(c.num_hidden_layers, self.loaded.model.kv_heads_per_rank,
                          c.head_dim).bytes_per_element_token(self.kv_dtype.itemsize)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The draft's pools: as many pages as the target's, the same ids (no scratch page: the
        draft never runs padded)."""
        self.runner = ModelRunner(self.loaded, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                                  block_size=self.block_size, kv_cache_dtype=self.kv_dtype)

    def kv_bytes(self) -> tuple[int, int]:
        """(device, host) bytes of the draft's pools."""
        if self.runner is None:
            return 0, 0
        dev, host = self.runner.kv_cache, self.runner.cpu_cache
        return dev.numel() * dev.element_size(), host.numel() * host.element_size()

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("DraftRunner used before init_kv_cache")
        return self.runner

    @torch.inference_mode()
    def mirror(self, step: StepInput) -> None:
        """The step's device/host transfers and copy-on-write copies, on the draft's tensors, once
        per step (the proposal runs them before the target's forward does its own)."""
        if step.step_id == self._mirrored_step:
            return
        runner = self._runner()
        self._mirrored_step = step.step_id
        runner.run_transfers([t for t in step.transfers if "disk" not in (t.src, t.dst)])
        if len(step.copies):
            runner.backend.copy_blocks(runner.kv_cache, torch.from_numpy(step.copies).long().to(runner.device))

    @torch.inference_mode()
    def propose(self, feeds: list[DraftFeed], chunk: int) -> list[list[int]]:
        """``feed.k`` greedy draft tokens for each feed, batched across them: first the unwritten
        positions (at most ``chunk`` tokens of each sequence per forward), then one token a step."""
        runner = self._runner()
        drafts: list[list[int]] = [[] for _ in feeds]
        done = [0] * len(feeds)  # tokens of each feed's catch-up fed so far
        while True:  # the catch-up: its last forward gives each sequence its first draft
            live = [i for i, f in enumerate(feeds) if done[i] < len(f.tokens)]
            if not live:
                break
            rows = []
            for i in live:
                f = feeds[i]
                n = min(chunk, len(f.tokens) - done[i])
                rows.append((f.table, f.start + done[i], f.tokens[done[i]:done[i] + n]))
                done[i] += n
            logits = runner.execute(self._step(rows))
            best = logits.argmax(dim=-1).tolist()
            for row, i in enumerate(live):
                if done[i] == len(feeds[i].tokens):
                    drafts[i].append(int(best[row]))
        for j in range(1, max((f.k for f in feeds), default=0)):
            live = [i for i, f in enumerate(feeds) if f.k > j]
            rows = [(feeds[i].table, feeds[i].start + len(feeds[i].tokens) + j - 1, [drafts[i][-1]]) for i in live]
            best = runner.execute(self._step(rows)).argmax(dim=-1).tolist()
            for row, i in enumerate(live):
                drafts[i].append(int(best[row]))
        return drafts

    def _step(self, rows: list[tuple[np.ndarray, int, list[int]]]) -> StepInput:
        """A forward of the draft over ``(block table, first position, tokens)`` rows, writing each
        token's K/V at its slot of that table."""
        bs = self.block_size
        ids, positions, slots, q, lens = [], [], [], [0], []
        for table, first, tokens in rows:
            pos = np.arange(first, first + len(tokens), dtype=np.int64)
            ids.extend(tokens)
            positions.append(pos)
            slots.append(table[pos // bs].astype(np.int64) * bs + pos % bs)
            q.append(q[-1] + len(tokens))
            lens.append(first + len(tokens))
        width = max(len(t) for t, _, _ in rows)
        tables = np.stack([np.pad(t, (0, width - len(t))) for t, _, _ in rows]).astype(np.int32)
        return StepInput(input_ids=np.asarray(ids, dtype=np.int64), positions=np.concatenate(positions),
                         slot_mapping=np.concatenate(slots), query_start_loc=np.asarray(q, dtype=np.int32),
                         seq_lens=np.asarray(lens, dtype=np.int32), block_tables=tables)
