// Storage types of the KV cache and their float conversions.
//
// Self-contained on purpose: no cuda_fp16.h / cuda_bf16.h, so the same source
// compiles under NVRTC on every toolkit (12.x, 13.x) without include paths.
// All arithmetic is fp32; these types are only loaded, converted and stored.
#ifndef PAGEDRS_DTYPE_CUH
#define PAGEDRS_DTYPE_CUH

namespace pagedrs {

// -inf without math headers (INFINITY is not defined under bare NVRTC).
__device__ __forceinline__ float kNegInf() { return __int_as_float(0xff800000); }

struct half_t {
  unsigned short bits;
};
struct bf16_t {
  unsigned short bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bf16_t x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float f);
template <>
__device__ __forceinline__ float from_float<float>(float f) { return f; }
template <>
__device__ __forceinline__ half_t from_float<half_t>(float f) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
  bf16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));  // sm_80+
  return h;
}

// One 16-byte vector of T: the unit of every global load and store.
template <typename T>
struct Vec16 {
  static constexpr int N = 16 / static_cast<int>(sizeof(T));
  union {
    uint4 raw;
    T elems[N];
  };
};

template <typename T>
__device__ __forceinline__ void vec_to_float(const uint4& raw, float (&out)[16 / sizeof(T)]) {
  Vec16<T> v;
  v.raw = raw;
#pragma unroll
  for (int i = 0; i < Vec16<T>::N; ++i) out[i] = to_float(v.elems[i]);
}

template <typename T>
__device__ __forceinline__ uint4 float_to_vec(const float (&in)[16 / sizeof(T)]) {
  Vec16<T> v;
#pragma unroll
  for (int i = 0; i < Vec16<T>::N; ++i) v.elems[i] = from_float<T>(in[i]);
  return v.raw;
}
}  // namespace pagedrs

#endif  // PAGEDRS_DTYPE_CUH
