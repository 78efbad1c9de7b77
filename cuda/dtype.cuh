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

// ---------------------------------------------------------------- 8-bit KV cache storage
// float8_e4m3fn (4 exponent bits, bias 7, 3 mantissa bits, no inf, max 448) and float8_e5m2
// (bias 15, 2 mantissa bits, max 57344), bit-compatible with torch.float8_e4m3fn / e5m2.
// Only the KV cache is stored in them (a cache of storage type C beside queries of T); a
// value x is stored as x / scale and read back as stored * scale (the kernels fold the
// scales into the query and the output, see paged_attention.cu).
//
// Stores round to nearest even and saturate to the largest finite value (vLLM's
// __NV_SATFINITE): an outlier past the range is clamped, never turned into NaN or inf.
// sm_89 and later convert in hardware (cvt ... e4m3x2 / e5m2x2); sm_80 has no fp8
// conversion instruction, so it and every other compiler (the CPU emulation) use the
// integer code below, which tests/test_kernels_emulated.py checks against torch for
// every one of the 256 codes and a sweep of floats.
struct fp8_e4m3_t {
  unsigned char bits;
};
struct fp8_e5m2_t {
  unsigned char bits;
};
#if defined(PAGEDRS_PTX_CONVERSIONS) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define PAGEDRS_PTX_FP8 1
#endif

__device__ __forceinline__ float to_float(fp8_e4m3_t x) {
#ifdef PAGEDRS_PTX_FP8
  unsigned h2;
  const unsigned short in = x.bits;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  return to_float(half_t{static_cast<unsigned short>(h2 & 0xffffu)});
#else
  const unsigned sign = static_cast<unsigned>(x.bits & 0x80u) << 24;
  const unsigned exp = (x.bits >> 3) & 0xfu, mant = x.bits & 0x7u;
  if (exp == 0) {  // zero or subnormal: mant * 2^-9, exact in fp32
    const float mag = static_cast<float>(mant) * 0.001953125f;
    return __uint_as_float(__float_as_uint(mag) | sign);
  }
  if (exp == 15 && mant == 7) return __uint_as_float(sign | 0x7fc00000u);  // the one NaN code (no inf)
  return __uint_as_float(sign | ((exp + 120u) << 23) | (mant << 20));
#endif
}
// e5m2 is the upper byte of an IEEE half: widening is exact.
__device__ __forceinline__ float to_float(fp8_e5m2_t x) {
  return to_float(half_t{static_cast<unsigned short>(static_cast<unsigned>(x.bits) << 8)});
}

// Round-to-nearest-even of a finite magnitude (fp32 bits) to MANT mantissa bits and
// exponent bias BIAS, saturated to MAX_CODE; the sign is the caller's.
template <int MANT, int BIAS, unsigned MAX_CODE>
__device__ __forceinline__ unsigned fp8_round(unsigned mag) {
  const unsigned e = mag >> 23;                    // biased fp32 exponent
  constexpr unsigned kMinNormal = 127 - BIAS + 1;  // fp32 exponent of the smallest normal code
  unsigned q;
  if (e >= kMinNormal) {  // normal: keep MANT bits, round the 23 - MANT dropped ones to even
    constexpr int kDrop = 23 - MANT;
    q = ((e - (kMinNormal - 1)) << MANT) | ((mag >> kDrop) & ((1u << MANT) - 1));
    const unsigned rest = mag & ((1u << kDrop) - 1), half = 1u << (kDrop - 1);
    q += rest > half || (rest == half && (q & 1u));  // a carry may reach the exponent
  } else {  // subnormal: value = m * 2^(e - 150) in units of 2^(1 - BIAS - MANT)
    const unsigned s = (kMinNormal - 1) + 24 - MANT - e;  // shift from m to units (>= 24 - MANT)
    if (s > 24) return 0;                                  // below half the smallest subnormal
    const unsigned m = (mag & 0x7fffffu) | 0x800000u;
    q = m >> s;
    const unsigned rest = m & ((1u << s) - 1), half = 1u << (s - 1);
    q += rest > half || (rest == half && (q & 1u));
  }
  return q > MAX_CODE ? MAX_CODE : q;
}

template <>
__device__ __forceinline__ fp8_e4m3_t from_float<fp8_e4m3_t>(float f) {
  fp8_e4m3_t r;
#ifdef PAGEDRS_PTX_FP8
  unsigned short packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(0.f), "f"(f));  // f in the low byte
  r.bits = static_cast<unsigned char>(packed & 0xffu);
#else
  const unsigned u = __float_as_uint(f), sign = (u >> 24) & 0x80u, mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) {
    r.bits = static_cast<unsigned char>(sign | 0x7fu);  // NaN
  } else {  // 0x7e = 448, the largest finite code; inf saturates too
    r.bits = static_cast<unsigned char>(sign | (mag >= 0x43e00000u ? 0x7eu : fp8_round<3, 7, 0x7eu>(mag)));
  }
#endif
  return r;
}
template <>
__device__ __forceinline__ fp8_e5m2_t from_float<fp8_e5m2_t>(float f) {
  fp8_e5m2_t r;
#ifdef PAGEDRS_PTX_FP8
  unsigned short packed;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(0.f), "f"(f));
  r.bits = static_cast<unsigned char>(packed & 0xffu);
#else
  const unsigned u = __float_as_uint(f), sign = (u >> 24) & 0x80u, mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) {
    r.bits = static_cast<unsigned char>(sign | 0x7fu);  // NaN
  } else {  // 0x7b = 57344, the largest finite code; inf saturates too
    r.bits = static_cast<unsigned char>(sign | (mag >= 0x47600000u ? 0x7bu : fp8_round<2, 15, 0x7bu>(mag)));
  }
#endif
  return r;
}

template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

// The raw register of N bytes: one global load or store.
template <int BYTES>
struct RawBytes;
template <>
struct RawBytes<16> {
  using type = uint4;
  __device__ static __forceinline__ uint4 zero() { return make_uint4(0, 0, 0, 0); }
};
template <>
struct RawBytes<8> {
  using type = uint2;
  __device__ static __forceinline__ uint2 zero() { return make_uint2(0, 0); }
};
template <>
struct RawBytes<4> {
  using type = unsigned;
  __device__ static __forceinline__ unsigned zero() { return 0u; }
};

// N consecutive elements of a cache of storage type C, loaded as one unit: the kernels
// keep the element layout of their 16-byte vectors of T (N = 16 / sizeof(T)), so a
// 16-bit cache moves 16 bytes a load and an 8-bit cache of the same elements 8.
template <typename C, int N>
struct CacheVec {
  using Raw = RawBytes<N * static_cast<int>(sizeof(C))>;
  using raw_t = typename Raw::type;
  union {
    raw_t raw;
    C elems[N];
  };
};

template <typename C, int N>
__device__ __forceinline__ void cache_to_float(const typename CacheVec<C, N>::raw_t& raw, float (&out)[N]) {
  CacheVec<C, N> v;
  v.raw = raw;
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(v.elems[i]);
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
