// Stand-in for MLX's Metal utility header, so a kernel source assembled as MLX
// assembles it compiles as C++17 and runs on the CPU.
//
// Execution model: the threads of one threadgroup are fibers (ucontext) run
// round-robin; threadgroups run one after another. `threadgroup` arrays become
// function statics, so they are shared by the threadgroup's fibers exactly as
// threadgroup memory is (and, like it, hold stale values when a group starts).
// A barrier blocks a fiber until every thread of its threadgroup has reached it;
// a simd collective until every live lane of its simdgroup of 32 has, lane by
// lane. A barrier that not every thread reaches, or lanes that reach different
// collectives, leaves no fiber able to run: that is reported as an error
// instead of hanging or silently passing.
//
// Not emulated: atomics, simdgroup matrices, textures, quadgroup collectives,
// memory ordering beyond barriers (fibers never interleave between
// synchronisation points), half/bfloat arithmetic (float16_t is _Float16, no
// bfloat16_t), Metal's fast-math precision.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#define device
#define constant
#define thread
#define threadgroup static

typedef unsigned int uint;
typedef _Float16 float16_t;
struct uint3 {
  uint x, y, z;
};

template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To out;
  std::memcpy(&out, &x, sizeof(To));
  return out;
}

namespace emu {

struct ThreadAttrs {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size, grid_origin;
  uint3 dispatch_threads_per_threadgroup;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup;
  uint thread_execution_width, thread_index_in_quadgroup, quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

enum Wait { NONE, SIMD, GROUP };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  ThreadAttrs attrs;
  bool done = false;
  Wait wait = NONE;
  long simd_syncs = 0, group_syncs = 0, slot_gen = -1;
  unsigned char slot[16];
};

inline std::vector<Fiber> fibers;
inline size_t current = 0;
inline ucontext_t scheduler;
inline const std::function<void(const ThreadAttrs&)>* body = nullptr;
constexpr size_t STACK = 256 * 1024;
constexpr uint SIMD_WIDTH = 32;

inline Fiber& me() { return fibers[current]; }

inline void block(Wait w) {
  Fiber& f = me();
  f.wait = w;
  if (w == SIMD) f.simd_syncs++;
  if (w == GROUP) f.group_syncs++;
  swapcontext(&f.ctx, &scheduler);
}

inline bool same_simdgroup(const Fiber& a, const Fiber& b) {
  return a.attrs.simdgroup_index_in_threadgroup == b.attrs.simdgroup_index_in_threadgroup;
}

inline bool released(const Fiber& f) {
  for (const Fiber& p : fibers) {
    if (f.wait == GROUP && p.group_syncs < f.group_syncs) return false;  // an exited thread never will
    if (f.wait == SIMD && same_simdgroup(f, p) && !p.done && p.simd_syncs < f.simd_syncs) return false;
  }
  return true;
}

inline void entry() {
  (*body)(me().attrs);
  me().done = true;
}

// Runs one threadgroup's threads to completion; false on a barrier or collective
// that can never be satisfied.
inline bool run_group(const std::vector<ThreadAttrs>& threads) {
  fibers.assign(threads.size(), Fiber());
  for (size_t i = 0; i < threads.size(); i++) {
    Fiber& f = fibers[i];
    f.attrs = threads[i];
    f.stack.resize(STACK);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = &scheduler;
    makecontext(&f.ctx, entry, 0);
  }
  for (;;) {
    bool progress = false, all_done = true;
    for (size_t i = 0; i < fibers.size(); i++) {
      Fiber& f = fibers[i];
      if (f.done) continue;
      all_done = false;
      if (f.wait != NONE && !released(f)) continue;
      f.wait = NONE;
      current = i;
      swapcontext(&scheduler, &f.ctx);
      progress = true;
    }
    if (all_done) return true;
    if (!progress) return false;
  }
}

// MLX's dispatch: `grid` counts threads, groups are `tg` (clipped to the grid).
inline int run_grid(const unsigned* grid, const unsigned* tg,
                    const std::function<void(const ThreadAttrs&)>& kernel) {
  body = &kernel;
  uint3 g{grid[0], grid[1], grid[2]};
  uint3 t{std::min(tg[0], grid[0]), std::min(tg[1], grid[1]), std::min(tg[2], grid[2])};
  uint3 groups{(g.x + t.x - 1) / t.x, (g.y + t.y - 1) / t.y, (g.z + t.z - 1) / t.z};
  for (uint gz = 0; gz < groups.z; gz++)
    for (uint gy = 0; gy < groups.y; gy++)
      for (uint gx = 0; gx < groups.x; gx++) {
        std::vector<ThreadAttrs> threads;
        uint n = t.x * t.y * t.z;
        for (uint i = 0; i < n; i++) {
          uint3 local{i % t.x, (i / t.x) % t.y, i / (t.x * t.y)};
          uint3 pos{gx * t.x + local.x, gy * t.y + local.y, gz * t.z + local.z};
          if (pos.x >= g.x || pos.y >= g.y || pos.z >= g.z) continue;
          ThreadAttrs a{};
          a.thread_position_in_grid = pos;
          a.thread_position_in_threadgroup = local;
          a.threadgroup_position_in_grid = {gx, gy, gz};
          a.threads_per_threadgroup = a.dispatch_threads_per_threadgroup = t;
          a.threadgroups_per_grid = groups;
          a.threads_per_grid = a.grid_size = g;
          a.grid_origin = {0, 0, 0};
          a.thread_index_in_threadgroup = i;
          a.thread_index_in_simdgroup = i % SIMD_WIDTH;
          a.simdgroup_index_in_threadgroup = i / SIMD_WIDTH;
          a.simdgroups_per_threadgroup = a.dispatch_simdgroups_per_threadgroup = (n + SIMD_WIDTH - 1) / SIMD_WIDTH;
          a.threads_per_simdgroup = a.thread_execution_width = SIMD_WIDTH;
          a.thread_index_in_quadgroup = i % 4;
          a.quadgroup_index_in_threadgroup = i / 4;
          a.quadgroups_per_threadgroup = a.dispatch_quadgroups_per_threadgroup = (n + 3) / 4;
          threads.push_back(a);
        }
        if (!run_group(threads)) return 1;
      }
  return 0;
}

// A simd collective: every lane deposits its value, waits for its simdgroup,
// reads the lanes it needs (in lane order), and waits again so no lane
// overwrites its slot before all have read.
template <typename T, typename Combine>
inline T collective(T x, Combine combine) {
  static_assert(sizeof(T) <= 16, "collective values up to 16 bytes");
  Fiber& self = me();
  std::memcpy(self.slot, &x, sizeof(T));
  self.slot_gen = self.simd_syncs + 1;
  block(SIMD);
  std::vector<T> lanes;
  std::vector<uint> ids;
  for (const Fiber& p : fibers) {
    if (same_simdgroup(self, p) && p.slot_gen == self.slot_gen) {
      T v;
      std::memcpy(&v, p.slot, sizeof(T));
      lanes.push_back(v);
      ids.push_back(p.attrs.thread_index_in_simdgroup);
    }
  }
  T out = combine(lanes, ids, self.attrs.thread_index_in_simdgroup);
  block(SIMD);
  return out;
}

}  // namespace emu

namespace metal {

using std::ceil;
using std::exp;
using std::floor;
using std::isinf;
using std::isnan;
using std::log;
using std::sqrt;

template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
template <typename T>
inline T fmax(T a, T b) { return std::fmax(a, b); }
template <typename T>
inline T fmin(T a, T b) { return std::fmin(a, b); }

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
inline void threadgroup_barrier(mem_flags) { emu::block(emu::GROUP); }
inline void simdgroup_barrier(mem_flags) { emu::block(emu::SIMD); }

template <typename T>
inline T simd_sum(T x) {
  return emu::collective(x, [](const std::vector<T>& v, const std::vector<uint>&, uint) {
    T s = 0;
    for (T e : v) s += e;
    return s;
  });
}
template <typename T>
inline T simd_max(T x) {
  return emu::collective(x, [](const std::vector<T>& v, const std::vector<uint>&, uint) {
    return *std::max_element(v.begin(), v.end());
  });
}
template <typename T>
inline T simd_min(T x) {
  return emu::collective(x, [](const std::vector<T>& v, const std::vector<uint>&, uint) {
    return *std::min_element(v.begin(), v.end());
  });
}
template <typename T>
inline T simd_prefix_exclusive_sum(T x) {
  return emu::collective(x, [](const std::vector<T>& v, const std::vector<uint>& ids, uint lane) {
    T s = 0;
    for (size_t i = 0; i < v.size(); i++)
      if (ids[i] < lane) s += v[i];
    return s;
  });
}
template <typename T>
inline T simd_shuffle(T x, uint from) {
  return emu::collective(x, [from](const std::vector<T>& v, const std::vector<uint>& ids, uint) {
    for (size_t i = 0; i < v.size(); i++)
      if (ids[i] == from) return v[i];
    return T(0);
  });
}

}  // namespace metal
