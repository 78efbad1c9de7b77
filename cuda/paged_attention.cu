// Paged attention over a block table: decode, chunked prefill and split-K in one kernel,
// causal or with a sliding window.
//
// The work of one thread block is a set of query "rows" that share one KV head:
// row = new_token * group + head_in_group, where group = num_heads / num_kv_heads.
// A decode step has one new token per sequence, so a block serves the `group`
// query heads of one KV head (GQA: each KV page is read once for all of them).
// A prefill chunk has q_len new tokens; each row sees the keys up to its own
// position (causal), i.e. the cached prefix pages plus the chunk itself, read
// straight from the pages (no gather into a contiguous tensor).
//
// Sliding window W (transformers' rule): the row at position p sees keys k with
// p - W < k <= p. A block starts at the first key its first row sees, so it never
// reads a block-table entry of a page wholly before that position (the core may
// release such pages and leave a placeholder id there), and its keys per row are
// bounded by W (plus the block's own rows for a prefill chunk), not by the context:
//
//   key position   0 ........ p0-W+1 ............ p0 ........ p_last
//   first row p0   [never read][------ W keys ------]
//   last row       [never read][ masked ][------ W keys -------]
//
// Per tile of TILE tokens (about 16 KiB of K and 16 KiB of V for one KV head):
//   1. every thread issues its 16-byte K and V loads (K to registers, V to registers)
//   2. groups of TPT lanes reduce q.k for every row        -> p_s[row][token]
//   3. V goes to shared memory; one warp per row updates the running max and sum
//      (online softmax) and turns scores into probabilities
//   4. threads own (row, 16-byte slice of head_dim) accumulators in fp32 and add p * v
// Split-K: gridDim.z partitions of `part_tokens` keys each (counted from the block's
// first key) write a normalized partial output and (max, sum); attention_reduce_kernel
// merges them.
//
// Cache storage type C: T (16-bit or float32, as the queries) or an 8-bit type of
// dtype.cuh (fp8 KV cache). Either way the kernels load the same elements per vector
// (16 / sizeof(T)), 16 bytes of T or 8 bytes of fp8, and compute in fp32. A stored key k
// means k * k_scale and a value v * v_scale: k_scale is folded into the scaled query
// (q . k k_scale = (q k_scale) . k) and v_scale into the normalized output, so the inner
// loops convert and never multiply by a scale. The scales are device pointers (read once
// per block), so a captured launch keeps reading the current value.
#include "dtype.cuh"

namespace pagedrs {

constexpr int kThreads = 128;      // threads per attention block (4 warps)
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRows = 16;       // query rows one block serves
constexpr int kTileBytes = 16384;  // bytes of K (and of V) per tile for one KV head
constexpr int kMaxParts = 1024;    // split-K partitions the reduce kernel accepts
constexpr int kMinBlocksPerSm = 4;  // caps registers at 128/thread: 16 warps per SM to hide load latency

__host__ __device__ constexpr int pow2_floor(int x) {
  int p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}
__host__ __device__ constexpr int pow2_ceil(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}
__host__ __device__ constexpr int clamp_int(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Compile-time geometry of one (dtype, head size) pair.
template <typename T, int HEAD>
struct AttnShape {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  static constexpr int NVEC = HEAD / VEC;                         // vectors per head row
  static constexpr int TPT = NVEC < 32 ? pow2_ceil(NVEC) : 32;    // lanes per token in q.k
  static constexpr int VPT = (NVEC + TPT - 1) / TPT;              // vectors per lane per token
  static constexpr int NGRP = kThreads / TPT;                     // tokens in flight in q.k
  static constexpr int TILE = clamp_int(pow2_floor(kTileBytes / (HEAD * static_cast<int>(sizeof(T)))), 16, 128);
  static constexpr int TOK_PER_GRP = TILE / NGRP;                 // tokens per lane group per tile
  static constexpr int V_PER_THREAD = TILE * NVEC / kThreads;     // V vectors loaded per thread per tile
  static constexpr int KMAX = (kMaxRows * NVEC + kThreads - 1) / kThreads;  // accumulators per thread
  static_assert(HEAD % VEC == 0, "head size must be a multiple of 16 bytes");
  static_assert(TILE % NGRP == 0, "tile must split evenly over lane groups");
  static_assert((TILE * NVEC) % kThreads == 0, "V tile must split evenly over threads");
};

template <typename C, int HEAD, int BLOCK>
__device__ __forceinline__ const C* kv_row(const C* __restrict__ cache, const int* __restrict__ table, int t,
                                           int num_kv_heads, int kv_head) {
  const long long block = table[t / BLOCK];
  return cache + ((block * BLOCK + t % BLOCK) * num_kv_heads + kv_head) * HEAD;
}

// The rows and keys of one thread block, for both attention kernels. Key range: from
// the first row's first visible key to the last row's causal limit; a partition is
// `part_tokens` of it (contexts < 2^30: no int overflow).
struct BlockWork {
  int seq, row0, q_begin, nrows;
  int pos0;        // position of the sequence's first new token
  int kbeg, kend;  // keys of this partition: [kbeg, kend)
};
__device__ __forceinline__ BlockWork block_work(const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
                                                const int* __restrict__ work_items, int group, int max_rows,
                                                int part_tokens, int window) {
  const int seq = work_items[2 * blockIdx.y];
  const int row0 = work_items[2 * blockIdx.y + 1];
  const int part = blockIdx.z;
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int ctx = seq_lens[seq];
  const int nrows = min(max_rows, q_len * group - row0);
  const int pos0 = ctx - q_len;
  const int key_begin = window > 0 ? max(0, pos0 + row0 / group - window + 1) : 0;
  const int key_end = pos0 + (row0 + nrows - 1) / group + 1;
  const int kbeg = key_begin + part * part_tokens;
  const int kend = min(kbeg + part_tokens, key_end);
  return BlockWork{seq, row0, q_begin, nrows, pos0, kbeg, kend};
}

// A partition with no key for any row of the block: (max, sum) = (-inf, 0) tells the
// reduce kernel to skip it.
__device__ __forceinline__ void mark_empty_partition(float* __restrict__ part_ml, const BlockWork& w, int group,
                                                     int num_heads, int kv_head) {
  for (int r = threadIdx.x; r < w.nrows; r += blockDim.x) {
    const int grow = w.row0 + r;
    const long long ml = ((static_cast<long long>(w.q_begin + grow / group) * num_heads + kv_head * group + grow % group) * gridDim.z + blockIdx.z) * 2;
    part_ml[ml] = kNegInf();
    part_ml[ml + 1] = 0.f;
  }
}

// grid (num_kv_heads, num_work_items, num_parts), block kThreads, static shared memory < 48 KiB.
template <typename T, typename C, int HEAD, int BLOCK>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) paged_attention_kernel(
    T* __restrict__ out,                      // [num_tokens, num_heads, HEAD]; written when num_parts == 1
    float* __restrict__ part_out,             // [num_tokens, num_heads, num_parts, HEAD]; when num_parts > 1
    float* __restrict__ part_ml,              // [num_tokens, num_heads, num_parts, 2] (max, sum); when > 1
    const T* __restrict__ query,              // [num_tokens, num_heads, HEAD], token stride q_token_stride
    const C* __restrict__ key_cache,          // [num_blocks, BLOCK, num_kv_heads, HEAD]
    const C* __restrict__ value_cache,        // [num_blocks, BLOCK, num_kv_heads, HEAD]
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,         // [num_seqs] context length including the new tokens
    const int* __restrict__ query_start_loc,  // [num_seqs + 1] seq i owns tokens [q[i], q[i+1])
    const int* __restrict__ work_items,       // [num_work_items, 2] (seq, first row of the block)
    int max_blocks_per_seq, int num_kv_heads, int group, long long q_token_stride, float scale,
    int part_tokens,                          // keys per split-K partition; one pass: 2^30 (any value >= the span)
    int window,                               // row at position p sees keys (p - window, p]; <= 0: all (causal)
    const float* __restrict__ k_scale,        // [1] a stored key k means k * k_scale (1 when C == T)
    const float* __restrict__ v_scale) {      // [1] a stored value v means v * v_scale
  using S = AttnShape<T, HEAD>;
  constexpr int VEC = S::VEC, NVEC = S::NVEC, TPT = S::TPT, TILE = S::TILE;
  using KV = CacheVec<C, VEC>;  // VEC elements of the cache: one load
  using raw_t = typename KV::raw_t;
  // V of a tile in the cache's type, and after the last tile the slice reduction's floats
  constexpr int kVBytes = TILE * HEAD * static_cast<int>(sizeof(C));
  constexpr int kRedBytes = kThreads * VEC * static_cast<int>(sizeof(float));

  __shared__ float q_s[kMaxRows][HEAD];    // scaled queries
  __shared__ float p_s[kMaxRows][TILE];    // scores, then probabilities, of the current tile
  __shared__ __align__(16) unsigned char v_s[kVBytes > kRedBytes ? kVBytes : kRedBytes];
  __shared__ float m_s[kMaxRows], l_s[kMaxRows], alpha_s[kMaxRows];
  __shared__ int first_s[kMaxRows], last_s[kMaxRows];  // key positions each row may see: [first, last]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int kv_head = blockIdx.x;
  const int part = blockIdx.z, num_parts = gridDim.z;
  const int num_heads = num_kv_heads * group;
  const BlockWork work = block_work(seq_lens, query_start_loc, work_items, group, kMaxRows, part_tokens, window);
  const int row0 = work.row0, q_begin = work.q_begin, nrows = work.nrows, pos0 = work.pos0, kbeg = work.kbeg, kend = work.kend;
  const int* table = block_tables + static_cast<long long>(work.seq) * max_blocks_per_seq;
  if (kbeg >= kend) {  // no key here for any row (uniform branch)
    mark_empty_partition(part_ml, work, group, num_heads, kv_head);
    return;
  }
  const float q_scale = scale * *k_scale, out_scale = *v_scale;

  for (int idx = tid; idx < nrows * NVEC; idx += kThreads) {
    const int r = idx / NVEC, vi = idx % NVEC, grow = row0 + r;
    const T* q = query + (q_begin + grow / group) * q_token_stride + (kv_head * group + grow % group) * HEAD;
    float f[VEC];
    vec_to_float<T>(reinterpret_cast<const uint4*>(q)[vi], f);
#pragma unroll
    for (int e = 0; e < VEC; ++e) q_s[r][vi * VEC + e] = f[e] * q_scale;
  }
  for (int r = tid; r < nrows; r += kThreads) {
    m_s[r] = kNegInf();
    l_s[r] = 0.f;
    const int last = pos0 + (row0 + r) / group;
    first_s[r] = window > 0 ? max(0, last - window + 1) : 0;
    last_s[r] = min(last, kend - 1);  // causal, and within the partition
  }

  // Accumulator ownership: item = (row, vector of head_dim); with few items,
  // `nslice` threads share an item and split the tile's tokens between them.
  const int items = nrows * NVEC;
  const int nslice = items >= kThreads ? 1 : kThreads / items;
  const int slice = items >= kThreads ? 0 : tid / items;
  const bool active = slice < nslice;
  float acc[S::KMAX][VEC];
#pragma unroll
  for (int k = 0; k < S::KMAX; ++k)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[k][e] = 0.f;

  const int grp = tid / TPT, glane = tid % TPT;
  for (int tile = kbeg; tile < kend; tile += TILE) {
    // 1. issue every load of the tile before using any of them
    raw_t kreg[S::TOK_PER_GRP][S::VPT];
#pragma unroll
    for (int i = 0; i < S::TOK_PER_GRP; ++i) {
      const int t = tile + i * S::NGRP + grp;
      const C* krow = t < kend ? kv_row<C, HEAD, BLOCK>(key_cache, table, t, num_kv_heads, kv_head) : nullptr;
#pragma unroll
      for (int j = 0; j < S::VPT; ++j) {
        const int vi = glane + j * TPT;
        kreg[i][j] = (krow != nullptr && vi < NVEC) ? reinterpret_cast<const raw_t*>(krow)[vi] : KV::Raw::zero();
      }
    }
    raw_t vreg[S::V_PER_THREAD];
#pragma unroll
    for (int j = 0; j < S::V_PER_THREAD; ++j) {
      const int idx = tid + j * kThreads, t = tile + idx / NVEC;
      vreg[j] = t < kend
                    ? reinterpret_cast<const raw_t*>(kv_row<C, HEAD, BLOCK>(value_cache, table, t, num_kv_heads, kv_head))[idx % NVEC]
                    : KV::Raw::zero();  // zeros, never garbage: p = 0 times NaN would poison the sum
    }
    __syncthreads();  // the previous tile is done with p_s, v_s, alpha_s; q_s, first_s and last_s are ready

    // 2. scores
#pragma unroll
    for (int i = 0; i < S::TOK_PER_GRP; ++i) {
      const int tl = i * S::NGRP + grp, t = tile + tl;
      float kf[S::VPT][VEC];
#pragma unroll
      for (int j = 0; j < S::VPT; ++j) cache_to_float<C, VEC>(kreg[i][j], kf[j]);
      for (int r = 0; r < nrows; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < S::VPT; ++j) {
          const int vi = glane + j * TPT;
          if (vi < NVEC) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) dot += kf[j][e] * q_s[r][vi * VEC + e];
          }
        }
#pragma unroll
        for (int off = TPT / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        if (glane == 0) p_s[r][tl] = (t >= first_s[r] && t <= last_s[r]) ? dot : kNegInf();
      }
    }
    // 3. stage V, then online softmax, one warp per row
#pragma unroll
    for (int j = 0; j < S::V_PER_THREAD; ++j) reinterpret_cast<raw_t*>(v_s)[tid + j * kThreads] = vreg[j];
    __syncthreads();
    for (int r = warp; r < nrows; r += kWarps) {
      float mx = kNegInf();
      for (int tl = lane; tl < TILE; tl += 32) mx = fmaxf(mx, p_s[r][tl]);
#pragma unroll
      for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = m_s[r], m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int tl = lane; tl < TILE; tl += 32) {
        const float p = m_new == kNegInf() ? 0.f : expf(p_s[r][tl] - m_new);
        p_s[r][tl] = p;
        sum += p;
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (lane == 0) {
        const float alpha = m_new == kNegInf() ? 1.f : expf(m_old - m_new);
        alpha_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();

    // 4. acc = acc * alpha + p @ V
    const int tile_len = min(TILE, kend - tile);
#pragma unroll
    for (int k = 0; k < S::KMAX; ++k) {
      const int item = nslice > 1 ? tid % items : tid + k * kThreads;
      if (!active || item >= items || (nslice > 1 && k > 0)) continue;
      const int r = item / NVEC, vi = item % NVEC;
      const float alpha = alpha_s[r];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[k][e] *= alpha;
      for (int tl = slice; tl < tile_len; tl += nslice) {
        const float p = p_s[r][tl];
        float vf[VEC];
        cache_to_float<C, VEC>(reinterpret_cast<const raw_t*>(v_s)[tl * NVEC + vi], vf);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[k][e] += p * vf[e];
      }
    }
  }
  __syncthreads();

  // Slices of one item add up through shared memory (v_s is free now).
  if (nslice > 1) {
    float* red = reinterpret_cast<float*>(v_s);  // [nslice, items, VEC], at most kThreads * VEC floats
    if (active && slice > 0) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) red[(slice * items + tid % items) * VEC + e] = acc[0][e];
    }
    __syncthreads();
    if (tid < items) {
      for (int s = 1; s < nslice; ++s)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[0][e] += red[(s * items + tid) * VEC + e];
    }
  }

  // Write: the final output (one pass) or a normalized partial with its (max, sum).
  if (num_parts > 1) {
    for (int r = tid; r < nrows; r += kThreads) {
      const int grow = row0 + r;
      const long long ml = ((static_cast<long long>(q_begin + grow / group) * num_heads + kv_head * group + grow % group) * num_parts + part) * 2;
      part_ml[ml] = m_s[r];
      part_ml[ml + 1] = l_s[r];
    }
  }
#pragma unroll
  for (int k = 0; k < S::KMAX; ++k) {
    const int item = tid + k * kThreads;
    if (item >= items || (nslice > 1 && k > 0)) continue;
    const int r = item / NVEC, vi = item % NVEC, grow = row0 + r;
    const float l = l_s[r];
    if (l == 0.f) continue;  // a row with no key in this partition; the reduce skips it
    const long long row = static_cast<long long>(q_begin + grow / group) * num_heads + kv_head * group + grow % group;
    const float inv = 1.f / l * out_scale;
    float o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] = acc[k][e] * inv;
    if (num_parts == 1) {
      reinterpret_cast<uint4*>(out + row * HEAD)[vi] = float_to_vec<T>(o);
    } else {
      float* dst = part_out + (row * num_parts + part) * HEAD + vi * VEC;
#pragma unroll
      for (int e = 0; e < VEC; e += 4) *reinterpret_cast<float4*>(dst + e) = make_float4(o[e], o[e + 1], o[e + 2], o[e + 3]);
    }
  }
}

// ---------------------------------------------------------------- v2: warps that never wait for each other
//
// paged_attention_v2_kernel: the same contract (arguments, work items of up to kRowsV2
// rows, split-K partials, causal and window masks), arranged for memory throughput.
// v1 above moves every tile through shared memory behind three block barriers and
// reduces each (token, row) dot product with log2(TPT) shuffles; at decode it reaches
// about a quarter of the memory bandwidth. Here:
//   * each warp owns every fourth chunk of CHUNK = 8 keys and keeps its own online
//     softmax (max, sum) and accumulators in registers: no block barrier until the
//     final merge of the four warps (one __syncthreads per block, not three per tile);
//   * a lane owns the same 16-byte slice (gl) of head_dim for every key, so the
//     scaled queries of all rows of that slice live in registers, and one converted
//     K or V element feeds kRowsV2 FMAs (v1: one converted V element per row);
//   * software pipeline, one chunk deep: V of chunk i is issued before the scores of
//     chunk i, K of chunk i + 1 before its softmax and p @ V, so loads are in flight
//     while the warp computes (v1 issues a tile's loads and then waits for them);
//   * the dot products of the SLOTS x kRowsV2 (key, row) pairs of a lane group are
//     reduced together by a transposing butterfly: L - 1 shuffles for L results
//     instead of log2(L) shuffles per result;
//   * optionally (prefetch_chunks > 0) the warp also asks the L2 for the chunk that
//     many past the next one: more bytes in flight per SM than registers could hold;
//   * scores are kept in base 2 (queries pre-scaled by log2(e)) so each
//     exponential is one exp2f; the split-K max is written back in base e.
// Lanes: L lanes per key read one key's row (VPT 16-byte vectors each, coalesced);
// S = 32 / L keys are read side by side; a lane reads SLOTS = L / kRowsV2 keys per chunk.
constexpr int kRowsV2 = 4;           // query rows of one v2 block (a decode token's group, up to 4)
constexpr int kMinBlocksPerSmV2 = 3;  // caps registers at 168/thread: 12 warps per SM
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T, int HEAD>
struct WarpShape {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  static constexpr int NVEC = HEAD / VEC;                         // vectors per head row
  static constexpr int L = NVEC < 32 ? pow2_ceil(NVEC) : 32;      // lanes per key
  static constexpr int VPT = (NVEC + L - 1) / L;                  // vectors per lane per key
  static constexpr int S = 32 / L;                                // keys read side by side
  static constexpr int SLOTS = L / kRowsV2;                       // keys per lane per chunk
  static constexpr int CHUNK = S * SLOTS;                         // keys per warp per chunk
  // V issued before the scores and the next K before the softmax (in flight longer),
  // unless K and V of a chunk would take more than 16 registers each (the L = 32
  // layouts: head 256, float32 heads >= 80): those issue V after the scores and the
  // next K after p @ V, so that at most one chunk's K or V is live at a time
  static constexpr bool EARLY_V = SLOTS * VPT <= 4;
  static_assert(HEAD % VEC == 0, "head size must be a multiple of 16 bytes");
  static_assert(L >= kRowsV2 && L % kRowsV2 == 0, "a lane group must hold one score per lane");
};

// Transposing butterfly over the L lanes of a group: on entry v[k] is this lane's part of
// value k (k < N == 2 * O at the first step); on exit v[0] is the whole value gl (the
// group's sum of every lane's v[gl]). Each step halves the values a lane holds: the
// lane whose bit O is set keeps the upper half and sends the lower one.
template <int O>
struct Butterfly {
  template <int N>
  __device__ static __forceinline__ void run(float (&v)[N], int gl) {
    const bool upper = (gl & O) != 0;
#pragma unroll
    for (int i = 0; i < O; ++i) {
      const float send = upper ? v[i] : v[i + O];
      const float keep = upper ? v[i + O] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    Butterfly<O / 2>::run(v, gl);
  }
};
template <>
struct Butterfly<0> {
  template <int N>
  __device__ static __forceinline__ void run(float (&)[N], int) {}
};

// Element offset of key t's row of kv_head in a cache; -1 past the partition (never read).
template <int HEAD, int BLOCK>
__device__ __forceinline__ long long kv_offset(const int* __restrict__ table, int t, int kend, int num_kv_heads,
                                               int kv_head) {
  if (t >= kend) return -1;
  const long long block = table[t / BLOCK];
  return ((block * BLOCK + t % BLOCK) * num_kv_heads + kv_head) * HEAD;
}

// This lane's vectors of its SLOTS keys; zeros where the key is past the partition (p = 0
// times garbage could be NaN) or the vector past head_dim.
template <typename T, typename C, int HEAD>
__device__ __forceinline__ void load_slots(
    typename CacheVec<C, WarpShape<T, HEAD>::VEC>::raw_t (&dst)[WarpShape<T, HEAD>::SLOTS][WarpShape<T, HEAD>::VPT],
    const C* __restrict__ cache, const long long (&off)[WarpShape<T, HEAD>::SLOTS], int gl) {
  using W = WarpShape<T, HEAD>;
  using KV = CacheVec<C, W::VEC>;
#pragma unroll
  for (int j = 0; j < W::SLOTS; ++j)
#pragma unroll
    for (int v = 0; v < W::VPT; ++v) {
      const int vi = gl + v * W::L;
      dst[j][v] = (off[j] >= 0 && vi < W::NVEC) ? reinterpret_cast<const typename KV::raw_t*>(cache + off[j])[vi]
                                                : KV::Raw::zero();
    }
}

// A hint that the line holding p will be read soon: the L2 fetches it from memory now, and
// the load that follows hits the L2. No register waits for it. A no-op off the GPU.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

// grid (num_kv_heads, num_work_items, num_parts), block kThreads; work items of up to kRowsV2 rows.
template <typename T, typename C, int HEAD, int BLOCK>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSmV2) paged_attention_v2_kernel(
    T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_ml, const T* __restrict__ query,
    const C* __restrict__ key_cache, const C* __restrict__ value_cache, const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc, const int* __restrict__ work_items,
    int max_blocks_per_seq, int num_kv_heads, int group, long long q_token_stride, float scale, int part_tokens,
    int window, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale,  // every argument so far as in paged_attention_kernel
    int prefetch_chunks) {  // > 0: also pull the chunk that many past the next one into L2 (no registers held)
  using W = WarpShape<T, HEAD>;
  constexpr int VEC = W::VEC, NVEC = W::NVEC, L = W::L, VPT = W::VPT, S = W::S, R = kRowsV2, SLOTS = W::SLOTS;
  constexpr int STRIDE = kWarps * W::CHUNK;  // keys between a warp's chunks
  using raw_t = typename CacheVec<C, VEC>::raw_t;  // VEC elements of the cache: one load

  __shared__ float acc_s[kWarps][R][HEAD];  // each warp's unnormalized output, for the final merge
  __shared__ float mw_s[kWarps][R], lw_s[kWarps][R];  // each warp's (max in base 2, sum) per row

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int sl = lane / L, gl = lane % L;  // key slice; lane within the key's group
  const int kv_head = blockIdx.x;
  const int part = blockIdx.z, num_parts = gridDim.z;
  const int num_heads = num_kv_heads * group;
  const BlockWork work = block_work(seq_lens, query_start_loc, work_items, group, R, part_tokens, window);
  const int row0 = work.row0, q_begin = work.q_begin, nrows = work.nrows, pos0 = work.pos0, kbeg = work.kbeg, kend = work.kend;
  const int* table = block_tables + static_cast<long long>(work.seq) * max_blocks_per_seq;
  if (kbeg >= kend) {  // no key here for any row (uniform branch)
    mark_empty_partition(part_ml, work, group, num_heads, kv_head);
    return;
  }

  // This lane's slice of every row's query, scaled into base 2 (and by k_scale); zeros for absent rows.
  const float q_scale = scale * kLog2e * *k_scale, out_scale = *v_scale;
  float q[R][VPT][VEC];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      const int vi = gl + v * L, grow = row0 + r;
      if (r < nrows && vi < NVEC) {
        const T* qrow = query + static_cast<long long>(q_begin + grow / group) * q_token_stride + (kv_head * group + grow % group) * HEAD;
        vec_to_float<T>(reinterpret_cast<const uint4*>(qrow)[vi], q[r][v]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) q[r][v][e] *= q_scale;
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) q[r][v][e] = 0.f;
      }
    }
  // After the butterfly this lane holds the score of (slot my_slot, row my_r); the keys that row sees.
  const int my_r = gl % R, my_slot = gl / R;
  const int my_pos = pos0 + (row0 + my_r) / group;
  const int my_first = window > 0 ? max(0, my_pos - window + 1) : 0;
  const int my_last = min(my_pos, kend - 1);  // an absent row (r >= nrows: zero query) is computed, never written

  float acc[R][VPT][VEC];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int v = 0; v < VPT; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[r][v][e] = 0.f;
  float m_run = kNegInf(), l_run = 0.f;  // my_r's running max (base 2, same in all its lanes); this lane's part of its sum

  long long off[SLOTS];
  raw_t kreg[SLOTS][VPT], vreg[SLOTS][VPT];
  int c = kbeg + warp * W::CHUNK;  // warp-uniform: every shuffle below is reached by the whole warp
  if (c < kend) {
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) off[j] = kv_offset<HEAD, BLOCK>(table, c + j * S + sl, kend, num_kv_heads, kv_head);
    load_slots<T, C, HEAD>(kreg, key_cache, off, gl);
  }
  for (; c < kend; c += STRIDE) {
    if (W::EARLY_V) load_slots<T, C, HEAD>(vreg, value_cache, off, gl);  // in flight during the scores

    float s[SLOTS * R];
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
      float kf[VPT][VEC];
#pragma unroll
      for (int v = 0; v < VPT; ++v) cache_to_float<C, VEC>(kreg[j][v], kf[v]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int v = 0; v < VPT; ++v)
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot += kf[v][e] * q[r][v][e];
        s[j * R + r] = dot;
      }
    }
    if (!W::EARLY_V) load_slots<T, C, HEAD>(vreg, value_cache, off, gl);  // K is dead now: fewer live registers
    const int next = c + STRIDE;  // the next chunk's K: in flight during the softmax and p @ V
    const int ahead = next + prefetch_chunks * STRIDE;  // warp-uniform; prefetches change no result
    if (prefetch_chunks > 0 && ahead < kend) {
#pragma unroll
      for (int j = 0; j < SLOTS; ++j) {
        const long long o = kv_offset<HEAD, BLOCK>(table, ahead + j * S + sl, kend, num_kv_heads, kv_head);
        if (o >= 0 && gl % 2 == 0 && gl < NVEC) {  // one lane per 32-byte sector of the row
          prefetch_l2(key_cache + o + gl * VEC);
          prefetch_l2(value_cache + o + gl * VEC);
        }
      }
    }
    if (W::EARLY_V && next < kend) {
#pragma unroll
      for (int j = 0; j < SLOTS; ++j) off[j] = kv_offset<HEAD, BLOCK>(table, next + j * S + sl, kend, num_kv_heads, kv_head);
      load_slots<T, C, HEAD>(kreg, key_cache, off, gl);
    }

    Butterfly<L / 2>::run(s, gl);
    const int t = c + my_slot * S + sl;
    const float score = (t >= my_first && t <= my_last) ? s[0] : kNegInf();
    float mx = score;  // max of my_r over the chunk: the lanes that differ in bits >= log2(R)
#pragma unroll
    for (int o = R; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_new = fmaxf(m_run, mx);
    const float alpha = m_new == kNegInf() ? 1.f : exp2f(m_run - m_new);
    const float p = score == kNegInf() ? 0.f : exp2f(score - m_new);
    l_run = l_run * alpha + p;
    m_run = m_new;

    // acc = acc * alpha + p @ V: alpha of row r from lane r, p of (slot j, row r) from lane j * R + r of this slice
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float a = __shfl_sync(0xffffffffu, alpha, r);
#pragma unroll
      for (int v = 0; v < VPT; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][v][e] *= a;
    }
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
      float vf[VPT][VEC];
#pragma unroll
      for (int v = 0; v < VPT; ++v) cache_to_float<C, VEC>(vreg[j][v], vf[v]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float pr = __shfl_sync(0xffffffffu, p, sl * L + j * R + r);
#pragma unroll
        for (int v = 0; v < VPT; ++v)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[r][v][e] += pr * vf[v][e];
      }
    }
    if (!W::EARLY_V && next < kend) {  // the L = 32 layouts load the next K only now, with V dead
#pragma unroll
      for (int j = 0; j < SLOTS; ++j) off[j] = kv_offset<HEAD, BLOCK>(table, next + j * S + sl, kend, num_kv_heads, kv_head);
      load_slots<T, C, HEAD>(kreg, key_cache, off, gl);
    }
  }

  // The warp's totals: sums over the lanes of a row, accumulators over the key slices.
#pragma unroll
  for (int o = R; o < 32; o *= 2) l_run += __shfl_xor_sync(0xffffffffu, l_run, o);
#pragma unroll
  for (int o = L; o < 32; o *= 2)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int v = 0; v < VPT; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[r][v][e] += __shfl_xor_sync(0xffffffffu, acc[r][v][e], o);
  if (lane < R) {  // lane r < L holds row r
    mw_s[warp][lane] = m_run;
    lw_s[warp][lane] = l_run;
  }
  if (sl == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int v = 0; v < VPT; ++v) {
        const int vi = gl + v * L;
        if (vi < NVEC) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc_s[warp][r][vi * VEC + e] = acc[r][v][e];
        }
      }
  }
  __syncthreads();

  // Merge the warps: o = sum_w 2^(m_w - M) acc_w / sum_w 2^(m_w - M) l_w; a warp with no key of a row has l_w = 0.
  for (int idx = tid; idx < nrows * NVEC; idx += kThreads) {
    const int r = idx / NVEC, vi = idx % NVEC, grow = row0 + r;
    float mx = kNegInf();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, mw_s[w][r]);
    float total = 0.f, o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = lw_s[w][r] > 0.f ? exp2f(mw_s[w][r] - mx) : 0.f;
      total += wt * lw_s[w][r];
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] += wt * acc_s[w][r][vi * VEC + e];
    }
    const long long row = static_cast<long long>(q_begin + grow / group) * num_heads + kv_head * group + grow % group;
    if (num_parts > 1 && vi == 0) {  // (max, sum) of the partition; sum 0: no key here, the reduce skips it
      part_ml[(row * num_parts + part) * 2] = total > 0.f ? mx * kLn2 : kNegInf();
      part_ml[(row * num_parts + part) * 2 + 1] = total;
    }
    if (total == 0.f) continue;
    const float inv = 1.f / total * out_scale;
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] *= inv;
    if (num_parts == 1) {
      reinterpret_cast<uint4*>(out + row * HEAD)[vi] = float_to_vec<T>(o);
    } else {
      float* dst = part_out + (row * num_parts + part) * HEAD + vi * VEC;
#pragma unroll
      for (int e = 0; e < VEC; e += 4) *reinterpret_cast<float4*>(dst + e) = make_float4(o[e], o[e + 1], o[e + 2], o[e + 3]);
    }
  }
}

// Merges split-K partials: out = sum_p w_p * o_p / sum_p w_p with w_p = l_p * exp(m_p - max_p m_p).
// grid (num_heads, num_tokens), block 128.
template <typename T>
__global__ void __launch_bounds__(128) attention_reduce_kernel(
    T* __restrict__ out,              // [num_tokens, num_heads, head_size]
    const float* __restrict__ part_out,  // [num_tokens, num_heads, num_parts, head_size]
    const float* __restrict__ part_ml,   // [num_tokens, num_heads, num_parts, 2] (max, sum); sum 0 = empty
    int num_parts, int head_size) {
  __shared__ float w_s[kMaxParts];
  __shared__ float inv_total_s;
  const long long row = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  const float* ml = part_ml + row * num_parts * 2;
  float m = kNegInf();
  for (int p = 0; p < num_parts; ++p)
    if (ml[2 * p + 1] > 0.f) m = fmaxf(m, ml[2 * p]);
  for (int p = threadIdx.x; p < num_parts; p += blockDim.x)
    w_s[p] = ml[2 * p + 1] > 0.f ? ml[2 * p + 1] * expf(ml[2 * p] - m) : 0.f;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int p = 0; p < num_parts; ++p) total += w_s[p];
    inv_total_s = 1.f / total;
  }
  __syncthreads();
  const float* po = part_out + row * num_parts * head_size;
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float o = 0.f;
    for (int p = 0; p < num_parts; ++p)
      if (w_s[p] > 0.f) o += w_s[p] * po[static_cast<long long>(p) * head_size + d];
    out[row * head_size + d] = from_float<T>(o * inv_total_s);
  }
}

}  // namespace pagedrs
