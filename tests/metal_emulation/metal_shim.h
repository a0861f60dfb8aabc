// The Metal names our kernels use, for compiling the source MLX generates as C++20 and running it on the
// CPU. It stands in for the `metal_stdlib` + MLX `utils.h` prelude that MLX puts before a custom kernel.
//
// Every thread of a threadgroup is a ucontext fiber on one OS thread, so a run is deterministic:
//  - threadgroup_barrier parks the fiber; the group moves on when every live thread is parked there.
//    A barrier some threads skip (they returned) or a barrier/SIMD mix that can never resolve is an error.
//  - SIMD operations run in lock-step: each lane parks with its operand, and once every live lane of the
//    SIMD group (32 lanes; lanes that returned are inactive, as on the GPU) waits at the same operation,
//    all results are computed together.
//  - Between those points a fiber runs alone, threads in index order or in reverse. SIMD groups are
//    released one at a time, the first in that order first, so each SIMD group runs as far ahead of the
//    others as the barriers let it: code that relies on an ordering the barriers do not give reads stale
//    or poisoned data in at least one of the two orders.
//  - Threadgroup arrays are filled with 0xFF bytes (NaN for floats) at the start of every threadgroup;
//    the caller poisons output buffers the same way.
// The harness rewrites each `threadgroup T name[N];` declaration to
// `static T name[N]; metal_emu::threadgroup_memory(name, sizeof(name));`: the fibers of a group then
// share one array, as on the GPU. Threadgroups run one after another.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

// -- Metal types (after the standard headers: `thread` and friends are empty macros below) ----------------
struct uint3 {
  uint x, y, z;
};

using float16_t = _Float16;
using half = _Float16;

struct bfloat16_t {  // float32's top half, rounded to nearest even on the way in (as Metal and MLX)
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40u)
                                           : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
}  // namespace metal

// -- the scheduler ---------------------------------------------------------------------------------------
namespace metal_emu {

constexpr int SIMD_WIDTH = 32;
constexpr size_t STACK_BYTES = 64 * 1024;
constexpr int MAX_THREADGROUP_ARRAYS = 16;

enum class Wait { Running, Barrier, Simd, Done };

struct Ids {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
      threads_per_threadgroup, threadgroups_per_grid, threads_per_grid;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
};

struct Thread;
using Combine = void (*)(Thread* const* lanes, int count);  // the live lanes of one SIMD group, in order

struct Thread {
  ucontext_t context;
  Wait wait;
  Combine combine;     // the SIMD operation this lane waits at
  ushort operand_lane;  // simd_shuffle's source lane / simd_shuffle_xor's mask
  alignas(16) unsigned char in[16], out[16];
  Ids ids;
};

inline Thread* threads;
inline int current;
inline ucontext_t scheduler;
inline void (*run_thread)(const Ids&);
inline unsigned long epoch;  // one per threadgroup
inline struct {
  void* address;
  unsigned long epoch;
} arrays[MAX_THREADGROUP_ARRAYS];

[[noreturn]] inline void fail(const char* what, int a = 0, int b = 0) {
  std::fprintf(stderr, "metal emulation error: ");
  std::fprintf(stderr, what, a, b);
  std::fprintf(stderr, "\n");
  std::exit(3);
}

inline void park(Wait wait) {
  threads[current].wait = wait;
  swapcontext(&threads[current].context, &scheduler);
}

inline void threadgroup_memory(void* address, size_t bytes) {  // poison once per threadgroup
  for (auto& a : arrays) {
    if (a.address == address || a.address == nullptr) {
      if (a.epoch != epoch) {
        std::memset(address, 0xFF, bytes);
        a = {address, epoch};
      }
      return;
    }
  }
  fail("more than %d threadgroup arrays", MAX_THREADGROUP_ARRAYS);
}

template <class T>
T simd_operation(T value, Combine combine, ushort operand_lane = 0) {
  static_assert(sizeof(T) <= 16 && std::is_trivially_copyable_v<T>);
  Thread& me = threads[current];
  std::memcpy(me.in, &value, sizeof(T));
  me.combine = combine;
  me.operand_lane = operand_lane;
  park(Wait::Simd);
  T result;
  std::memcpy(&result, threads[current].out, sizeof(T));
  return result;
}

template <class T>
T operand(const Thread* lane) {
  T v;
  std::memcpy(&v, lane->in, sizeof(T));
  return v;
}

template <class T>
void give(Thread* lane, T v) {
  std::memcpy(lane->out, &v, sizeof(T));
}

struct Add {
  template <class T>
  T operator()(T a, T b) const { return a + b; }
};
struct Max {
  template <class T>
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) return std::fmax(a, b);
    else return a > b ? a : b;
  }
};
struct Min {
  template <class T>
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) return std::fmin(a, b);
    else return a < b ? a : b;
  }
};

template <class T, class Op>
void reduce(Thread* const* lanes, int count) {  // over the active lanes, in lane order
  T total = operand<T>(lanes[0]);
  for (int i = 1; i < count; ++i) total = Op{}(total, operand<T>(lanes[i]));
  for (int i = 0; i < count; ++i) give(lanes[i], total);
}

template <class T, bool XOR>
void shuffle(Thread* const* lanes, int count) {  // reading an inactive lane gives poison
  for (int i = 0; i < count; ++i) {
    const uint source = XOR ? lanes[i]->ids.thread_index_in_simdgroup ^ lanes[i]->operand_lane
                            : lanes[i]->operand_lane;
    std::memset(lanes[i]->out, 0xFF, sizeof(T));
    for (int j = 0; j < count; ++j) {
      if (lanes[j]->ids.thread_index_in_simdgroup == source) give(lanes[i], operand<T>(lanes[j]));
    }
  }
}

inline void fiber() {
  run_thread(threads[current].ids);
  threads[current].wait = Wait::Done;
}

// Runs one threadgroup to the end: `size` threads at `group` (a partial group at the grid's edge is smaller).
inline void run_threadgroup(uint3 group, uint3 size, uint3 full, uint3 groups, uint3 grid, bool reverse,
                            char* stacks) {
  ++epoch;
  const int n = int(size.x * size.y * size.z);
  const uint simdgroups = uint((n + SIMD_WIDTH - 1) / SIMD_WIDTH);
  for (int i = 0; i < n; ++i) {
    Thread& t = threads[i];
    const uint3 local = {uint(i) % size.x, uint(i) / size.x % size.y, uint(i) / (size.x * size.y)};
    t.ids = {{group.x * full.x + local.x, group.y * full.y + local.y, group.z * full.z + local.z},
             local, group, size, groups, grid,
             uint(i), uint(i % SIMD_WIDTH), uint(i / SIMD_WIDTH), simdgroups, SIMD_WIDTH, SIMD_WIDTH};
    t.wait = Wait::Running;
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = stacks + size_t(i) * STACK_BYTES;
    t.context.uc_stack.ss_size = STACK_BYTES;
    t.context.uc_link = &scheduler;
    makecontext(&t.context, fiber, 0);
  }
  for (;;) {
    for (int k = 0; k < n; ++k) {
      current = reverse ? n - 1 - k : k;
      if (threads[current].wait == Wait::Running) swapcontext(&scheduler, &threads[current].context);
    }
    int done = 0, at_barrier = 0;
    bool released = false;
    for (uint k = 0; k < simdgroups && !released; ++k) {
      const uint s = reverse ? simdgroups - 1 - k : k;
      Thread* lanes[SIMD_WIDTH];
      int live = 0, waiting = 0;
      for (int i = int(s) * SIMD_WIDTH; i < n && i < int(s + 1) * SIMD_WIDTH; ++i) {
        if (threads[i].wait == Wait::Done) continue;
        lanes[live++] = &threads[i];
        waiting += threads[i].wait == Wait::Simd;
      }
      if (live == 0 || waiting < live) continue;
      for (int i = 1; i < live; ++i) {
        if (lanes[i]->combine != lanes[0]->combine) fail("SIMD group %d: lanes wait at different SIMD operations", s);
      }
      lanes[0]->combine(lanes, live);
      for (int i = 0; i < live; ++i) lanes[i]->wait = Wait::Running;
      released = true;
    }
    if (released) continue;
    for (int i = 0; i < n; ++i) {
      done += threads[i].wait == Wait::Done;
      at_barrier += threads[i].wait == Wait::Barrier;
    }
    if (done == n) return;
    if (at_barrier + done < n) fail("deadlock: %d threads at a barrier, the others at SIMD operations", at_barrier);
    if (done > 0) fail("threadgroup_barrier reached by %d threads after %d returned", at_barrier, done);
    for (int i = 0; i < n; ++i) threads[i].wait = Wait::Running;
  }
}

inline char* buffers[64];

inline char* load(const char* path, long* bytes) {
  FILE* f = std::fopen(path, "rb");
  if (!f) fail("cannot read a buffer file");
  std::fseek(f, 0, SEEK_END);
  *bytes = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  char* data = static_cast<char*>(std::malloc(*bytes > 0 ? *bytes : 1));
  if (*bytes > 0 && std::fread(data, 1, *bytes, f) != size_t(*bytes)) fail("short read of a buffer file");
  std::fclose(f);
  return data;
}

// argv: DIR gx gy gz tx ty tz reverse. Buffer i is DIR/i.bin; the outputs come back as DIR/i.out.
inline int main(int argc, char** argv, int count, const bool* is_output, void (*thread)(const Ids&)) {
  if (argc != 9) fail("usage: runner DIR gx gy gz tx ty tz reverse");
  long bytes[64];
  char path[4096];
  for (int i = 0; i < count; ++i) {
    std::snprintf(path, sizeof(path), "%s/%d.bin", argv[1], i);
    buffers[i] = load(path, &bytes[i]);
  }
  const uint3 grid = {uint(std::atoi(argv[2])), uint(std::atoi(argv[3])), uint(std::atoi(argv[4]))};
  // MLX dispatches min(threadgroup, grid) threads per group in each dimension
  const uint3 full = {std::min(uint(std::atoi(argv[5])), grid.x), std::min(uint(std::atoi(argv[6])), grid.y),
                      std::min(uint(std::atoi(argv[7])), grid.z)};
  const bool reverse = std::atoi(argv[8]) != 0;
  const uint3 groups = {(grid.x + full.x - 1) / full.x, (grid.y + full.y - 1) / full.y,
                        (grid.z + full.z - 1) / full.z};
  const size_t per_group = size_t(full.x) * full.y * full.z;
  threads = new Thread[per_group];
  char* stacks = new char[per_group * STACK_BYTES];
  run_thread = thread;
  const long total = long(groups.x) * groups.y * groups.z;
  for (long k = 0; k < total; ++k) {
    const long g = reverse ? total - 1 - k : k;
    const uint3 group = {uint(g % groups.x), uint(g / groups.x % groups.y), uint(g / (long(groups.x) * groups.y))};
    const uint3 size = {std::min(full.x, grid.x - group.x * full.x), std::min(full.y, grid.y - group.y * full.y),
                        std::min(full.z, grid.z - group.z * full.z)};
    run_threadgroup(group, size, full, groups, grid, reverse, stacks);
  }
  for (int i = 0; i < count; ++i) {
    if (!is_output[i]) continue;
    std::snprintf(path, sizeof(path), "%s/%d.out", argv[1], i);
    FILE* f = std::fopen(path, "wb");
    if (!f || std::fwrite(buffers[i], 1, bytes[i], f) != size_t(bytes[i])) fail("cannot write an output");
    std::fclose(f);
  }
  return 0;
}

}  // namespace metal_emu

// -- Metal functions -------------------------------------------------------------------------------------
namespace metal {

inline void threadgroup_barrier(mem_flags) { metal_emu::park(metal_emu::Wait::Barrier); }

template <class T>
T simd_sum(T v) { return metal_emu::simd_operation(v, &metal_emu::reduce<T, metal_emu::Add>); }
template <class T>
T simd_max(T v) { return metal_emu::simd_operation(v, &metal_emu::reduce<T, metal_emu::Max>); }
template <class T>
T simd_min(T v) { return metal_emu::simd_operation(v, &metal_emu::reduce<T, metal_emu::Min>); }
template <class T>
T simd_shuffle(T v, ushort lane) { return metal_emu::simd_operation(v, &metal_emu::shuffle<T, false>, lane); }
template <class T>
T simd_shuffle_xor(T v, ushort mask) { return metal_emu::simd_operation(v, &metal_emu::shuffle<T, true>, mask); }

}  // namespace metal

using namespace metal;

#define device
#define constant
#define thread
#define threadgroup
