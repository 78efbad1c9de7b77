// The block scheduler of cuda_emu.h: fibers, barriers, warp shuffles and their strict checks.
// Included by cuda_emu.h after the CUDA types; see the model described there.
#pragma once

// ---------------------------------------------------------------- fibers

// void emu_switch(void** save_sp, void* next_sp): pushes the callee-saved registers,
// stores the stack pointer in *save_sp, loads next_sp and pops the other side's.
// A new fiber's stack is laid out so that the first switch "returns" into
// emu_fiber_entry (see Block::start). Sound because it is an ordinary call for the
// compiler: caller-saved registers are dead across it, memory is assumed clobbered,
// and the callee-saved ones are restored. MXCSR and the x87 control word are not
// switched: no kernel changes the rounding mode.
extern "C" void emu_switch(void** save_sp, void* next_sp);
asm(R"(
  .text
  .p2align 4
  .globl emu_switch
  .hidden emu_switch
  .type emu_switch, @function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch, .-emu_switch
)");

extern "C" char __start_pagedrs_emu_shared[] __attribute__((weak));
extern "C" char __stop_pagedrs_emu_shared[] __attribute__((weak));

namespace emu {

enum class Wait : uint8_t { kRunnable, kBarrier, kShuffle, kDone };
enum Schedule : int { kForward = 0, kReverse = 1, kWarpRandom = 2 };

struct Site {
  const char* file = "";
  int line = 0;
  const char* what = "";
  bool operator==(const Site& o) const { return line == o.line && std::strcmp(file, o.file) == 0; }
};

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable byte; a PROT_NONE guard page sits below it
  Wait wait = Wait::kRunnable;
  Site site;
  uint64_t shfl_value = 0, shfl_result = 0;  // what this lane offers; what it receives
  int shfl_src = 0;                           // lane (within the warp) it reads from
  uint3 idx{};
#ifdef EMU_ASAN
  void* fake_stack = nullptr;
#endif
};

struct Block;
inline Block* g_block = nullptr;
extern "C" void emu_fiber_entry();

// One thread block: its fibers and the scheduler that runs them.
struct Block {
  static constexpr size_t kStack = 256 * 1024;
  std::vector<Fiber> fibers;
  std::vector<char*> mappings;
  void* sched_sp = nullptr;
  int current = -1;
  int nthreads = 0;
  std::string error;
  void (*body)(void* fn, void** args) = nullptr;
  void* fn = nullptr;
  void** args = nullptr;
#ifdef EMU_ASAN
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  void* sched_fake_stack = nullptr;
#endif

  ~Block() {
    for (char* m : mappings) munmap(m, kStack + page());
  }
  static size_t page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

  void reserve(int n) {
    while (static_cast<int>(mappings.size()) < n) {
      void* m = mmap(nullptr, kStack + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) {
        std::fprintf(stderr, "cuda_emu: cannot map a %zu-byte fiber stack\n", kStack);
        std::abort();
      }
      mprotect(m, page(), PROT_NONE);  // overflow faults instead of corrupting the next stack
      mappings.push_back(static_cast<char*>(m));
    }
  }

  // A fresh stack whose first switch-in pops six zero registers and "returns" into
  // emu_fiber_entry with the stack aligned as after a call (rsp % 16 == 8).
  void start(int i) {
    Fiber& f = fibers[i];
    f.stack = mappings[i] + page();
    auto* top = reinterpret_cast<uintptr_t*>(f.stack + kStack);
    *--top = 0;  // fake return address of emu_fiber_entry
    *--top = reinterpret_cast<uintptr_t>(&emu_fiber_entry);
    for (int r = 0; r < 6; ++r) *--top = 0;
    f.sp = top;
    f.wait = Wait::kRunnable;
  }

  void resume(int i) {
    current = i;
    g_idx.thread = fibers[i].idx;
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(&sched_fake_stack, fibers[i].stack, kStack);
#endif
    emu_switch(&sched_sp, fibers[i].sp);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(sched_fake_stack, nullptr, nullptr);
#endif
    current = -1;
  }

  // From inside a fiber: back to the scheduler until it resumes this fiber.
  void yield() {
    Fiber& f = fibers[current];
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(f.wait == Wait::kDone ? nullptr : &f.fake_stack, sched_stack_bottom,
                                   sched_stack_size);
#endif
    emu_switch(&f.sp, sched_sp);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(f.fake_stack, &sched_stack_bottom, &sched_stack_size);
#endif
  }

  void fail(const std::string& message) {
    if (error.empty()) error = message;
  }

  int warp_begin(int tid) const { return tid / warpSize * warpSize; }
  int warp_end(int tid) const { return std::min(warp_begin(tid) + warpSize, nthreads); }

  // Called by the last lane to arrive: checks the warp agrees, then computes every
  // lane's result at once so that no lane can overwrite a value before it is read.
  void try_complete_shuffle(int tid) {
    const int b = warp_begin(tid), e = warp_end(tid);
    for (int l = b; l < e; ++l)
      if (fibers[l].wait != Wait::kShuffle) return;
    for (int l = b; l < e; ++l) {
      if (!(fibers[l].site == fibers[b].site)) {
        fail("divergent warp shuffle: lane " + std::to_string(l - b) + " of warp " + std::to_string(b / warpSize) +
             " is at " + where(fibers[l].site) + " while lane 0 is at " + where(fibers[b].site));
        return;
      }
    }
    for (int l = b; l < e; ++l) fibers[l].shfl_result = fibers[b + fibers[l].shfl_src].shfl_value;
    for (int l = b; l < e; ++l) fibers[l].wait = Wait::kRunnable;
  }

  static std::string where(const Site& s) { return std::string(s.what) + " at " + s.file + ":" + std::to_string(s.line); }

  // Threads grouped by where they wait: "threads 0-31: __shfl_xor_sync at f.cu:12; ...".
  std::string describe() const {
    std::string out;
    int i = 0;
    while (i < nthreads) {
      int j = i;
      auto same = [&](int a, int b) { return fibers[a].wait == fibers[b].wait && fibers[a].site == fibers[b].site; };
      while (j + 1 < nthreads && same(i, j + 1)) ++j;
      const Fiber& f = fibers[i];
      std::string state = f.wait == Wait::kDone ? "exited" : f.wait == Wait::kRunnable ? "runnable" : where(f.site);
      out += (out.empty() ? "" : "; ") + std::string("threads ") + std::to_string(i) + "-" + std::to_string(j) + ": " + state;
      i = j + 1;
    }
    return out;
  }

  // No thread can run: release a barrier every thread agrees on, or report why not.
  bool release_or_fail() {
    int done = 0, barrier = 0, first_barrier = -1;
    for (int i = 0; i < nthreads; ++i) {
      if (fibers[i].wait == Wait::kDone) ++done;
      if (fibers[i].wait == Wait::kBarrier) {
        ++barrier;
        if (first_barrier < 0) first_barrier = i;
      }
    }
    if (done == nthreads) return false;
    if (barrier == nthreads) {
      for (int i = 0; i < nthreads; ++i)
        if (!(fibers[i].site == fibers[first_barrier].site)) {
          fail("deadlock: divergent __syncthreads (threads wait at different barriers): " + describe());
          return false;
        }
      for (int i = 0; i < nthreads; ++i) fibers[i].wait = Wait::kRunnable;
      return true;
    }
    if (barrier + done == nthreads) {
      fail("deadlock: divergent __syncthreads (some threads exited, the others wait): " + describe());
    } else {
      fail("deadlock: divergent warp shuffle (some lanes of a warp never reach it): " + describe());
    }
    return false;
  }

  // Runs every thread of the block to completion under `schedule`; false on error.
  bool run(int schedule, std::mt19937_64& rng) {
    const int nwarps = (nthreads + warpSize - 1) / warpSize;
    std::vector<int> order;
    for (;;) {
      bool progressed = false;
      if (schedule == kWarpRandom) {
        std::vector<int> warps(nwarps);
        for (int w = 0; w < nwarps; ++w) warps[w] = w;
        std::shuffle(warps.begin(), warps.end(), rng);
        for (int w : warps) {
          std::vector<int> lanes;
          for (int t = w * warpSize; t < std::min((w + 1) * warpSize, nthreads); ++t) lanes.push_back(t);
          std::shuffle(lanes.begin(), lanes.end(), rng);
          for (bool more = true; more;) {  // this warp as far as it can go
            more = false;
            for (int t : lanes)
              if (fibers[t].wait == Wait::kRunnable) {
                resume(t);
                if (!error.empty()) return false;
                more = progressed = true;
              }
          }
        }
      } else {
        for (int k = 0; k < nthreads; ++k) {
          const int t = schedule == kReverse ? nthreads - 1 - k : k;
          if (fibers[t].wait == Wait::kRunnable) {
            resume(t);
            if (!error.empty()) return false;
            progressed = true;
          }
        }
      }
      if (!progressed && !release_or_fail()) return error.empty();
    }
  }
};

inline Block& block() { return *g_block; }
inline Fiber& self() { return g_block->fibers[g_block->current]; }

extern "C" void emu_fiber_entry() {
  Block& b = block();
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.sched_stack_bottom, &b.sched_stack_size);
#endif
  b.body(b.fn, b.args);
  self().wait = Wait::kDone;
  b.yield();  // never resumed
  __builtin_trap();
}

inline void syncthreads(const char* file, int line) {
  Fiber& f = self();
  f.site = Site{file, line, "__syncthreads"};
  f.wait = Wait::kBarrier;
  block().yield();
}

// Shuffles move up to 8 bytes of any trivially copyable type through the warp.
template <typename T>
inline T shuffle(const char* what, const char* file, int line, unsigned mask, T value, int src_lane) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of an unsupported type");
  Block& b = block();
  Fiber& f = self();
  const int tid = b.current, wb = b.warp_begin(tid), width = b.warp_end(tid) - wb;
  const unsigned full = width == 32 ? 0xffffffffu : (1u << width) - 1;
  f.site = Site{file, line, what};
  if (mask != full) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "partial shuffle mask 0x%08x (the warp has mask 0x%08x) in %s at %s:%d", mask, full,
                  what, file, line);
    b.fail(buf);
    f.wait = Wait::kDone;
    b.yield();
  }
  f.shfl_value = 0;
  std::memcpy(&f.shfl_value, &value, sizeof(T));
  f.shfl_src = src_lane < width ? src_lane : tid - wb;
  f.wait = Wait::kShuffle;
  b.try_complete_shuffle(tid);
  if (f.wait != Wait::kRunnable) b.yield();  // the last lane to arrive goes straight on
  T out;
  std::memcpy(&out, &f.shfl_result, sizeof(T));
  return out;
}

inline int lane_id() { return (block().current) % warpSize; }

template <typename T>
inline T shfl_xor(const char* file, int line, unsigned mask, T v, int lane_mask, int width = warpSize) {
  const int lane = lane_id(), src = lane ^ lane_mask, group = lane & ~(width - 1);
  return shuffle("__shfl_xor_sync", file, line, mask, v, src >= group + width ? lane : src);
}
template <typename T>
inline T shfl_down(const char* file, int line, unsigned mask, T v, unsigned delta, int width = warpSize) {
  const int lane = lane_id(), group = lane & ~(width - 1), src = lane + static_cast<int>(delta);
  return shuffle("__shfl_down_sync", file, line, mask, v, src >= group + width ? lane : src);
}
template <typename T>
inline T shfl_up(const char* file, int line, unsigned mask, T v, unsigned delta, int width = warpSize) {
  const int lane = lane_id(), group = lane & ~(width - 1), src = lane - static_cast<int>(delta);
  return shuffle("__shfl_up_sync", file, line, mask, v, src < group ? lane : src);
}
template <typename T>
inline T shfl_idx(const char* file, int line, unsigned mask, T v, int src_lane, int width = warpSize) {
  const int lane = lane_id(), group = lane & ~(width - 1);
  return shuffle("__shfl_sync", file, line, mask, v, group + (src_lane % width));
}

}  // namespace emu
