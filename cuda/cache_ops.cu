// Cache writes and block copies: the memory traffic the scheduler asks for.
//
// reshape_and_cache_kernel scatters a step's new K/V rows into their slots.
// copy_blocks_kernel copies whole blocks of every layer, K and V, in one launch;
// it is dtype-agnostic (16-byte words) and serves copy-on-write inside the
// device cache. Swaps between the device cache and the pinned host mirror do
// not use a kernel: they run on the copy engines (cudaMemcpy2DAsync, one call
// per run of consecutive blocks), see python/pagedrs/kernels/ops.py.
#include "dtype.cuh"

namespace pagedrs {

// grid (num_tokens), block 128. Tokens whose slot is negative (padding) are skipped.
// C == T: rows are copied as 16-byte words (bit-exact). C an 8-bit type: each element is
// stored as from_float<C>(x / scale), rounded to nearest even and saturated (dtype.cuh).
template <typename T, typename C>
__global__ void __launch_bounds__(128) reshape_and_cache_kernel(
    C* __restrict__ key_cache,               // [num_blocks, block_size, num_kv_heads, head_size]
    C* __restrict__ value_cache,             // [num_blocks, block_size, num_kv_heads, head_size]
    const T* __restrict__ key,               // [num_tokens, num_kv_heads, head_size], token stride key_stride
    const T* __restrict__ value,             // [num_tokens, num_kv_heads, head_size], token stride value_stride
    const long long* __restrict__ slot_mapping,  // [num_tokens] block * block_size + offset
    long long key_stride, long long value_stride, int row_elems /* num_kv_heads * head_size */,
    const float* __restrict__ k_scale,       // [1] per-tensor scales of this layer's K and V (1 for C == T)
    const float* __restrict__ v_scale) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  constexpr int VEC = Vec16<T>::N;
  const uint4* k = reinterpret_cast<const uint4*>(key + blockIdx.x * key_stride);
  const uint4* v = reinterpret_cast<const uint4*>(value + blockIdx.x * value_stride);
  if constexpr (SameType<T, C>::value) {
    uint4* kc = reinterpret_cast<uint4*>(key_cache + slot * row_elems);
    uint4* vc = reinterpret_cast<uint4*>(value_cache + slot * row_elems);
    for (int i = threadIdx.x; i < row_elems / VEC; i += blockDim.x) {
      kc[i] = k[i];
      vc[i] = v[i];
    }
  } else {
    using CV = CacheVec<C, VEC>;
    auto* kc = reinterpret_cast<typename CV::raw_t*>(key_cache + slot * row_elems);
    auto* vc = reinterpret_cast<typename CV::raw_t*>(value_cache + slot * row_elems);
    const float ks = *k_scale, vs = *v_scale;
    for (int i = threadIdx.x; i < row_elems / VEC; i += blockDim.x) {
      float kf[VEC], vf[VEC];
      vec_to_float<T>(k[i], kf);
      vec_to_float<T>(v[i], vf);
      CV kq, vq;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        kq.elems[e] = from_float<C>(kf[e] / ks);
        vq.elems[e] = from_float<C>(vf[e] / vs);
      }
      kc[i] = kq.raw;
      vc[i] = vq.raw;
    }
  }
}

// grid (num_pairs, num_layers * 2), block 256. Destination blocks must not also be
// sources in the same launch (the block manager's copy-on-write pairs never are).
__global__ void __launch_bounds__(256) copy_blocks_kernel(
    uint4* __restrict__ dst,            // [num_layers * 2, dst_num_blocks, block_words]
    const uint4* __restrict__ src,      // [num_layers * 2, src_num_blocks, block_words]
    const long long* __restrict__ pairs,  // [num_pairs, 2] (src_block, dst_block)
    long long block_words, long long src_num_blocks, long long dst_num_blocks) {
  const long long plane = blockIdx.y;  // layer * 2 + (0 for K, 1 for V)
  const uint4* s = src + (plane * src_num_blocks + pairs[2 * blockIdx.x]) * block_words;
  uint4* d = dst + (plane * dst_num_blocks + pairs[2 * blockIdx.x + 1]) * block_words;
  for (long long i = threadIdx.x; i < block_words; i += blockDim.x) d[i] = s[i];
}

}  // namespace pagedrs
