// The C entry points of an emulated kernel library (loaded by tests/cuda_emu/runtime.py).
//
// The generated source includes cuda_emu.h, the kernel translation unit, then this
// file, then a table `kKernels` built with emu::kernel(name, &instance) for every
// name expression it was asked for. Each entry carries the instance's parameter
// list as the compiler sees it (size and kind of every argument), so the Python
// launcher checks arguments against the real C++ signature.
#pragma once

namespace emu {

struct KernelInfo {
  const char* name;
  void* fn;
  void (*invoke)(void* fn, void** args);
  int nargs;
  int sizes[32];
  char kinds[32];  // 'p' pointer, 'i' signed integer, 'u' unsigned integer, 'f' floating point
};

template <typename A>
constexpr char kind_of() {
  return std::is_pointer<A>::value ? 'p' : std::is_floating_point<A>::value ? 'f' : std::is_signed<A>::value ? 'i' : 'u';
}

template <typename... A, size_t... I>
void call(void (*fn)(A...), void** args, std::index_sequence<I...>) {
  fn(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <typename... A>
void invoke(void* fn, void** args) {
  call(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
}

template <typename... A>
KernelInfo kernel(const char* name, void (*fn)(A...)) {
  static_assert(sizeof...(A) <= 32, "too many kernel parameters");
  KernelInfo k{name, reinterpret_cast<void*>(fn), &invoke<A...>, static_cast<int>(sizeof...(A)), {}, {}};
  int i = 0;
  ((k.sizes[i] = static_cast<int>(sizeof(A)), k.kinds[i] = kind_of<A>(), ++i), ...);
  return k;
}

inline std::mutex g_launch_mutex;  // ctypes releases the GIL; launches still run one at a time

}  // namespace emu

extern const emu::KernelInfo kKernels[];
extern const int kNumKernels;

extern "C" {

__attribute__((visibility("default"))) int emu_num_kernels() { return kNumKernels; }

__attribute__((visibility("default"))) const char* emu_kernel_name(int i) { return kKernels[i].name; }

// Writes the argument sizes and kinds of kernel i; returns the argument count.
__attribute__((visibility("default"))) int emu_kernel_signature(int i, int* sizes, char* kinds) {
  for (int a = 0; a < kKernels[i].nargs; ++a) {
    sizes[a] = kKernels[i].sizes[a];
    kinds[a] = kKernels[i].kinds[a];
  }
  return kKernels[i].nargs;
}

// Size in bytes of the __shared__ section (what is poisoned before every block).
__attribute__((visibility("default"))) long emu_shared_bytes() {
  return __start_pagedrs_emu_shared ? __stop_pagedrs_emu_shared - __start_pagedrs_emu_shared : 0;
}

// Runs kernel i over the whole grid. Returns 0, or 1 with a message in `error`.
__attribute__((visibility("default"))) int emu_launch(int i, const unsigned* grid, const unsigned* block_dim,
                                                      void** args, int schedule, unsigned long long seed, char* error,
                                                      int error_size) {
  std::lock_guard<std::mutex> lock(emu::g_launch_mutex);
  static emu::Block b;  // stacks are mapped once and reused
  const int nthreads = static_cast<int>(block_dim[0] * block_dim[1] * block_dim[2]);
  b.reserve(nthreads);
  b.fibers.assign(nthreads, emu::Fiber{});
  b.nthreads = nthreads;
  b.body = kKernels[i].invoke;
  b.fn = kKernels[i].fn;
  b.args = args;
  b.error.clear();
  emu::g_block = &b;
  emu::g_idx.grid_dim = dim3(grid[0], grid[1], grid[2]);
  emu::g_idx.block_dim = dim3(block_dim[0], block_dim[1], block_dim[2]);
  std::mt19937_64 rng(seed);
  for (int t = 0; t < nthreads; ++t) {
    const unsigned t32 = static_cast<unsigned>(t);
    b.fibers[t].idx = uint3{t32 % block_dim[0], t32 / block_dim[0] % block_dim[1], t32 / (block_dim[0] * block_dim[1])};
  }
  for (unsigned z = 0; z < grid[2]; ++z)
    for (unsigned y = 0; y < grid[1]; ++y)
      for (unsigned x = 0; x < grid[0]; ++x) {
        if (__start_pagedrs_emu_shared)
          std::memset(__start_pagedrs_emu_shared, 0xff, __stop_pagedrs_emu_shared - __start_pagedrs_emu_shared);
        emu::g_idx.block = uint3{x, y, z};
        for (int t = 0; t < nthreads; ++t) b.start(t);
        if (!b.run(schedule, rng)) {
          std::snprintf(error, error_size, "%s, block (%u, %u, %u): %s", kKernels[i].name, x, y, z, b.error.c_str());
          emu::g_block = nullptr;
          return 1;
        }
      }
  emu::g_block = nullptr;
  return 0;
}

}  // extern "C"
