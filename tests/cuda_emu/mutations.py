"""Planted one-line kernel bugs: each must make the emulated kernel suite fail.

A harness that passes correct kernels proves little until it is seen failing
wrong ones. Every mutation replaces one exact line fragment (present once) of one
file, in memory (``pagedrs.kernels.sources.translation_unit(files)``); cuda/ is
never touched. The kinds are the ones a kernel author actually writes: a missing
barrier, an off-by-one in the causal or window mask or a split bound, a shuffle
only part of a warp reaches, a dropped rescale, a stride assumed instead of passed,
a block that reads the pages before its window.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedrs.kernels import sources


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str

    def apply(self, files: dict[str, str]) -> dict[str, str]:
        text = files[self.file]
        count = text.count(self.old)
        if count != 1:
            raise ValueError(f"mutation {self.name!r}: {self.old!r} occurs {count} times in {self.file}; expected once")
        return {**files, self.file: text.replace(self.old, self.new)}


PA, CO = "paged_attention.cu", "cache_ops.cu"
MUTATIONS: tuple[Mutation, ...] = (
    Mutation("missing barrier before the scores", PA,
             "__syncthreads();  // the previous tile is done", "//__syncthreads();  // the previous tile is done"),
    Mutation("missing barrier after staging V", PA,
             "    __syncthreads();\n    for (int r = warp; r < nrows; r += kWarps) {",
             "    for (int r = warp; r < nrows; r += kWarps) {"),
    Mutation("missing barrier before p @ V", PA,
             "    __syncthreads();\n\n    // 4. acc = acc * alpha + p @ V", "\n    // 4. acc = acc * alpha + p @ V"),
    Mutation("missing barrier before the slice reduction", PA,
             "    __syncthreads();\n    if (tid < items) {", "    if (tid < items) {"),
    Mutation("causal mask off by one", PA, "t <= last_s[r]", "t < last_s[r]"),
    Mutation("causal limit one too far", PA,
             "const int last = pos0 + (row0 + r) / group;", "const int last = pos0 + (row0 + r) / group + 1;"),
    Mutation("split bound one short", PA,
             "const int kend = min(kbeg + part_tokens, key_end);", "const int kend = min(kbeg + part_tokens - 1, key_end);"),
    Mutation("window mask off by one (one key too few)", PA, "t >= first_s[r]", "t > first_s[r]"),
    Mutation("window one key too wide for a chunk's later rows", PA,
             "max(0, last - window + 1)", "max(0, last - window)"),
    Mutation("block starts at position 0, reading the released pages", PA,
             "const int key_begin = window > 0 ? max(0, pos0 + row0 / group - window + 1) : 0;", "const int key_begin = 0;"),
    Mutation("block starts one key after its window", PA,
             "pos0 + row0 / group - window + 1)", "pos0 + row0 / group - window + 2)"),
    Mutation("split-K partitions counted from position 0", PA,
             "const int kbeg = key_begin + part * part_tokens;", "const int kbeg = part * part_tokens;"),
    Mutation("divergent shuffle in the softmax max", PA,
             "for (int off = 16; off > 0; off /= 2) mx = fmaxf", "for (int off = 16; off > 0 && lane < 31; off /= 2) mx = fmaxf"),
    Mutation("q.k reduction stops one step early", PA,
             "for (int off = TPT / 2; off > 0; off /= 2)", "for (int off = TPT / 2; off > 1; off /= 2)"),
    Mutation("running sum not rescaled", PA, "l_s[r] = l_s[r] * alpha + sum;", "l_s[r] = l_s[r] + sum;"),
    Mutation("query token stride ignored", PA,
             "query + (q_begin + grow / group) * q_token_stride", "query + (q_begin + grow / group) * num_heads * HEAD"),
    Mutation("reduce weights with the sign flipped", PA,
             "ml[2 * p + 1] * expf(ml[2 * p] - m)", "ml[2 * p + 1] * expf(m - ml[2 * p])"),
    Mutation("reduce reads the total before it is written", PA,
             "  __syncthreads();\n  const float* po", "  const float* po"),
    # paged_attention_v2_kernel
    Mutation("v2: butterfly keeps the wrong half", PA,
             "const bool upper = (gl & O) != 0;", "const bool upper = (gl & O) == 0;"),
    Mutation("v2: causal mask off by one", PA, "t >= my_first && t <= my_last", "t >= my_first && t < my_last"),
    Mutation("v2: window one key too wide", PA,
             "max(0, my_pos - window + 1)", "max(0, my_pos - window)"),
    Mutation("v2: last key of a partition read as zeros", PA, "if (t >= kend) return -1;", "if (t >= kend - 1) return -1;"),
    Mutation("v2: missing barrier before the warp merge", PA,
             "  __syncthreads();\n\n  // Merge the warps", "\n  // Merge the warps"),
    Mutation("v2: accumulators not rescaled", PA, "acc[r][v][e] *= a;", "acc[r][v][e] *= 1.f + 0.f * a;"),
    Mutation("v2: running sum not rescaled", PA, "l_run = l_run * alpha + p;", "l_run = l_run + p;"),
    Mutation("v2: chunk max over half the warp", PA,
             "for (int o = R; o < 32; o *= 2) mx = fmaxf", "for (int o = R; o < 16; o *= 2) mx = fmaxf"),
    Mutation("v2: row sum over half the warp", PA,
             "for (int o = R; o < 32; o *= 2) l_run +=", "for (int o = R; o < 16; o *= 2) l_run +="),
    Mutation("v2: key slices not summed", PA, "for (int o = L; o < 32; o *= 2)", "for (int o = 2 * L; o < 32; o *= 2)"),
    Mutation("v2: probabilities from the wrong slice", PA, "p, sl * L + j * R + r)", "p, j * R + r)"),
    Mutation("v2: the next chunk skips one", PA, "const int next = c + STRIDE;", "const int next = c + 2 * STRIDE;"),
    Mutation("v2: split-K max left in base 2", PA, "total > 0.f ? mx * kLn2 : kNegInf()", "total > 0.f ? mx : kNegInf()"),
    Mutation("v2: query token stride ignored", PA,
             "static_cast<long long>(q_begin + grow / group) * q_token_stride",
             "static_cast<long long>(q_begin + grow / group) * num_heads * HEAD"),
    # the fp8 cache (tests/test_fp8_kernels_emulated.py): a scale dropped is a wrong answer too
    Mutation("fp8: k_scale not folded into the query", PA,
             "const float q_scale = scale * *k_scale, out_scale", "const float q_scale = scale, out_scale"),
    Mutation("fp8: v_scale not applied to the output", PA,
             "const float inv = 1.f / l * out_scale;", "const float inv = 1.f / l;"),
    Mutation("v2: fp8 k_scale not folded into the query", PA,
             "const float q_scale = scale * kLog2e * *k_scale,", "const float q_scale = scale * kLog2e,"),
    Mutation("v2: fp8 v_scale not applied to the output", PA,
             "const float inv = 1.f / total * out_scale;", "const float inv = 1.f / total;"),
    Mutation("fp8: keys stored without their scale", CO,
             "kq.elems[e] = from_float<C>(kf[e] / ks);", "kq.elems[e] = from_float<C>(kf[e]);"),
    Mutation("slot 0 treated as padding", CO, "if (slot < 0) return;", "if (slot <= 0) return;"),
    Mutation("copy_blocks copies onto the source", CO,
             "pairs[2 * blockIdx.x + 1]) * block_words", "pairs[2 * blockIdx.x]) * block_words"),
)


def mutated_files(mutation: Mutation) -> dict[str, str]:
    return mutation.apply(sources.source_files())
