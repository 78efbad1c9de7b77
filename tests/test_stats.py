"""Typed stats: every counter the server exports is a field of EngineStats, and stats() is its dict view."""

from __future__ import annotations

from dataclasses import fields

from pagedrs import Engine, EngineArgs
from pagedrs.server import metrics
from pagedrs.stats import EngineStats

CONTRACT_KEYS = {"num_gpu_blocks", "num_free_gpu_blocks", "num_preemptions", "prefix_queries", "prefix_hits",
                 "num_running", "num_waiting"}  # DESIGN.md: tests outside this repository read these


def test_every_metric_reads_a_field_of_engine_stats():
    names = {f.name for f in fields(EngineStats)}
    keys = {key for key, _ in metrics._GAUGES.values()}
    keys |= {k for ks, _ in metrics._COUNTERS.values() for k in ks}
    keys |= {k for _, ks, _ in [*metrics._LABELED_GAUGES.values(), *metrics._LABELED_COUNTERS.values()] for k in ks.values()}
    keys |= {k for _, label_key, key, _ in metrics._COUNTERS_BY_STRING.values() for k in (label_key, key)}
    assert keys - names <= metrics.OPTIONAL_KEYS, f"metrics read keys EngineStats lacks: {sorted(keys - names)}"
    assert CONTRACT_KEYS <= names


def test_stats_is_the_dict_view_of_typed_stats(tiny_llama_dir):
    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=16, max_model_len=32))
    typed = engine.typed_stats()
    assert engine.stats() == typed.as_dict()
    assert typed.num_gpu_blocks == typed.num_free_gpu_blocks == 16 and typed.kv_layout == "paged"


def test_metrics_export_tiers_and_the_memory_breakdown(tiny_llama_dir):
    from pagedrs import SamplingParams

    engine = Engine(EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=16, max_model_len=32))
    for i in range(2):  # the second request hits the first one's prefix pages
        engine.add_request(f"r{i}", list(range(5, 17)), SamplingParams(max_tokens=2))
        while engine.has_unfinished():
            engine.step()
    m = metrics.ServerMetrics()
    m.update_from_stats(engine.stats())
    text = m.render().decode()
    stats = engine.stats()
    assert f'pagedrs_prefix_tier_hits_total{{tier="device"}} {float(stats["prefix_hits_device"])}' in text
    assert stats["prefix_hits_device"] > 0
    weights = stats["memory_weights_bytes"]
    model = engine.loaded.model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied embeddings counted once
    assert weights == sum(t.numel() * t.element_size() for t in tensors.values())
    assert f'pagedrs_memory_bytes{{part="weights"}} {float(weights)}' in text
    assert stats["memory_kv_pool_bytes"] == 16 * stats["kv_bytes_per_block"]
    assert stats["memory_rss_bytes"] > weights


def test_a_gguf_models_weights_count_its_matrices_and_tables():
    """``memory_weights_bytes`` of a model on the Rust GEMV counts the matrices' tiles and a block embedding's
    own blocks, which live outside torch (it reported the norms alone: 0.14 MB of SmolLM2's ~96 MB); a tied
    head's table read from the head's matrix is counted once, with the head."""
    from pagedrs.models.embedding import BlockEmbedding

    engine = Engine(EngineArgs(model="smollm2-135m", weight_dtype="gguf", num_gpu_blocks=16, max_model_len=64))
    try:
        model = engine.loaded.model
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        in_torch = sum(t.numel() * t.element_size() for t in tensors.values())
        matrices = {id(m.gguf_matrix): m.gguf_matrix for m in model.modules() if getattr(m, "gguf_matrix", None)}
        assert len(matrices) == 4 * model.config.num_hidden_layers + 1  # qkv, o, gate_up, down; the head
        table = model.model.embed_tokens
        assert isinstance(table, BlockEmbedding) and table.head is model.lm_head.gguf_matrix and table.weight_bytes() == 0
        weights = engine.stats()["memory_weights_bytes"]
        assert weights == in_torch + sum(m.weight_bytes for m in matrices.values())
        assert weights >= model.weight_bytes() > 90 * 2**20  # every product's bytes, at least
    finally:
        engine.shutdown()
