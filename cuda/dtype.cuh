// Storage types of the KV cache and their float conversions.
//
// Self-contained on purpose: no cuda_fp16.h / cuda_bf16.h, so the same source
// compiles under NVRTC on every toolkit (12.x, 13.x) without include paths.
// All arithmetic is fp32; these types are only loaded, converted and stored.
//
// The three conversions are one PTX instruction each on the device. Any other
// compiler (the CPU emulation in tests/cuda_emu, or NVRTC given
// -DPAGEDRS_PORTABLE_CONVERSIONS) gets the same round-to-nearest-even results
// from plain integer code; tests/test_kernels_emulated.py checks every half and a
// sweep of floats against torch, and NVRTC compiles both paths.
#if defined(__CUDA_ARCH__) && !defined(PAGEDRS_PORTABLE_CONVERSIONS)
#define PAGEDRS_PTX_CONVERSIONS 1
#endif
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
#ifdef PAGEDRS_PTX_CONVERSIONS
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
#else
  const unsigned sign = static_cast<unsigned>(x.bits & 0x8000u) << 16;
  const unsigned exp = (x.bits >> 10) & 0x1fu, mant = x.bits & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return __uint_as_float(__float_as_uint(mag) | sign);
  }
  if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (mant << 13));  // inf, NaN (payload kept)
  return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
#endif
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
#ifdef PAGEDRS_PTX_CONVERSIONS
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#else
  const unsigned u = __float_as_uint(f), sign = (u >> 16) & 0x8000u, mag = u & 0x7fffffffu;
  const unsigned e = mag >> 23;  // biased fp32 exponent
  unsigned q;
  if (mag > 0x7f800000u) {
    q = 0x7fffu;  // NaN: the canonical NaN cvt.rn.f16.f32 returns
  } else if (e >= 143) {
    q = 0x7c00u;  // >= 2^16 (inf included): overflow
  } else if (e >= 113) {  // normal half: keep 10 mantissa bits, round the 13 dropped ones to even
    q = ((e - 112) << 10) | ((mag >> 13) & 0x3ffu);
    const unsigned rest = mag & 0x1fffu;
    q += rest > 0x1000u || (rest == 0x1000u && (q & 1u));  // a carry may reach the exponent, or inf
  } else if (e >= 102) {  // subnormal half: value = m * 2^(e - 150), unit 2^-24
    const unsigned m = (mag & 0x7fffffu) | 0x800000u, s = 126 - e;
    q = m >> s;
    const unsigned rest = m & ((1u << s) - 1), half = 1u << (s - 1);
    q += rest > half || (rest == half && (q & 1u));
  } else {
    q = 0;  // below half the smallest subnormal
  }
  h.bits = static_cast<unsigned short>(sign | q);
#endif
  return h;
}
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
  bf16_t h;
#ifdef PAGEDRS_PTX_CONVERSIONS
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));  // sm_80+
#else
  const unsigned u = __float_as_uint(f);
  h.bits = static_cast<unsigned short>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fffu  // canonical NaN
                                                                       : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
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
