// CUDA on the CPU, for tests: lets g++ compile the unmodified kernel translation unit
// (the exact text NVRTC compiles, see pagedrs.kernels.sources) and run it.
//
// Model. Thread blocks run one at a time. The threads of a block are fibers: each
// has its own stack and runs until it reaches a __syncthreads, a warp shuffle or
// its end, then control returns to the block scheduler (emu::Block). That makes
// every interleaving the kernel can see explicit, and the scheduler strict:
//   * __syncthreads releases only when every thread of the block waits at the SAME
//     barrier (file:line); a thread that exited or waits elsewhere is an error.
//   * a shuffle completes when all 32 lanes of the warp wait at the same shuffle
//     with a full mask; a partial mask, or lanes elsewhere, is an error.
//   * nothing runnable and nothing releasable is a deadlock, reported with where
//     every thread waits.
// Errors stop the launch (the fibers are abandoned, the kernels hold only PODs) and
// come back to Python as a message; they never abort the interpreter.
//
// Schedules (which runnable thread goes next): forward (thread 0 first), reverse,
// and warp-random (warps in a seeded random order, each run as far as it can go
// before the next). A missing barrier reads poisoned or stale shared memory under
// at least one of them. __shared__ variables are statics in one linker section,
// filled with 0xff bytes (NaN in f32, f16 and bf16) before every block.
//
// The context switch is six callee-saved registers and a stack pointer (x86-64
// System V), about ten times faster than swapcontext, which makes a syscall per
// switch to save the signal mask.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif

#if !defined(__x86_64__)
#error "cuda_emu.h switches stacks with x86-64 assembly"
#endif

// ---------------------------------------------------------------- CUDA keywords

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static __attribute__((section("pagedrs_emu_shared")))

// ---------------------------------------------------------------- vector types, indices

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct __attribute__((aligned(16))) uint4 {
  unsigned x, y, z, w;
};
struct __attribute__((aligned(8))) uint2 {
  unsigned x, y;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(8))) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }

constexpr int warpSize = 32;

namespace emu {
struct Indices {
  uint3 thread, block;
  dim3 block_dim, grid_dim;
};
// One copy per loaded library: blocks and their threads run one at a time, and the
// scheduler sets `thread` before it switches to a fiber.
inline Indices g_idx;
}  // namespace emu

// Read-only for the kernels, as in CUDA.
static const uint3& threadIdx = emu::g_idx.thread;
static const uint3& blockIdx = emu::g_idx.block;
static const dim3& blockDim = emu::g_idx.block_dim;
static const dim3& gridDim = emu::g_idx.grid_dim;

// ---------------------------------------------------------------- math and bit casts

template <typename To, typename From>
inline To emu_bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit cast between different sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}
inline float __int_as_float(int x) { return emu_bit_cast<float>(x); }
inline float __uint_as_float(unsigned x) { return emu_bit_cast<float>(x); }
inline int __float_as_int(float x) { return emu_bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return emu_bit_cast<unsigned>(x); }
inline float __expf(float x) { return ::expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / ::sqrtf(x); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return ::fminf(a, b); }
inline float max(float a, float b) { return ::fmaxf(a, b); }

#include "cuda_emu_sched.h"

#define __syncthreads() ::emu::syncthreads(__FILE__, __LINE__)
#define __shfl_xor_sync(...) ::emu::shfl_xor(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::emu::shfl_down(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::emu::shfl_up(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_sync(...) ::emu::shfl_idx(__FILE__, __LINE__, __VA_ARGS__)
