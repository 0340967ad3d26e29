// Host C++ dialect: runs the shared kernel bodies on the CPU to check their logic where
// no GPU is present. Every GPU thread of a group is a fiber (ucontext); the fibers of a
// group take turns cooperatively in one OS thread, so barriers and warp sums are exact
// and deterministic. Groups run one after another, which lets `static` stand in for
// group-shared memory. For tests only: slow by design.
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#define DEVICE_FN inline
#define SHARED static
#define BARRIER() emu::barrier()
#define EXP(x) std::exp(x)
#define FMAX(a, b) std::fmax((a), (b))
#define NEG_INF (-INFINITY)
#define TO_F32(x) static_cast<float>(x)
#define FROM_F32(T, x) static_cast<T>(x)

namespace emu {

constexpr int WARP = 32;
constexpr int MAX_WARPS = 32;
constexpr size_t STACK_BYTES = 64 * 1024;  // the bodies keep a few small arrays

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  bool done = false;
};

struct Group {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0;
  int group_y = 0, group_z = 0, n_groups_z = 1;
  int arrived = 0;
  long generation = 0;
  int warp_arrived[MAX_WARPS] = {};
  long warp_generation[MAX_WARPS] = {};
  float warp_values[MAX_WARPS][WARP] = {};
  std::function<void()> body;
};

inline Group* group = nullptr;

inline void yield() {
  swapcontext(&group->fibers[group->current].context, &group->scheduler);
}

inline void barrier() {
  const long generation = group->generation;
  if (++group->arrived == int(group->fibers.size())) {
    group->arrived = 0;
    group->generation++;
    return;
  }
  while (group->generation == generation) {
    yield();
  }
}

inline void warp_barrier(int w) {
  const long generation = group->warp_generation[w];
  if (++group->warp_arrived[w] == WARP) {
    group->warp_arrived[w] = 0;
    group->warp_generation[w]++;
    return;
  }
  while (group->warp_generation[w] == generation) {
    yield();
  }
}

inline void fiber_entry() {
  group->body();
  group->fibers[group->current].done = true;  // returning resumes the scheduler (uc_link)
}

// Run `body` once per thread of every group (groups_y x groups_z), threads fibers each.
inline void run(int threads, int groups_y, int groups_z, std::function<void()> body) {
  Group g;
  g.fibers.resize(threads);
  g.body = std::move(body);
  g.n_groups_z = groups_z;
  group = &g;
  for (int z = 0; z < groups_z; z++) {
    for (int y = 0; y < groups_y; y++) {
      g.group_y = y;
      g.group_z = z;
      for (Fiber& f : g.fibers) {
        f.stack.resize(STACK_BYTES);
        f.done = false;
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.data();
        f.context.uc_stack.ss_size = f.stack.size();
        f.context.uc_link = &g.scheduler;
        makecontext(&f.context, fiber_entry, 0);
      }
      // Round robin until every fiber has finished.
      for (int live = threads; live > 0;) {
        live = 0;
        for (int t = 0; t < threads; t++) {
          if (!g.fibers[t].done) {
            g.current = t;
            swapcontext(&g.scheduler, &g.fibers[t].context);
            live += !g.fibers[t].done;
          }
        }
      }
    }
  }
  group = nullptr;
}

inline int thread_id() {
  return group->current;
}

}  // namespace emu

// Every lane receives the same sum, added in lane order.
DEVICE_FN float warp_sum(float x) {
  const int tid = emu::thread_id();
  const int w = tid / emu::WARP;
  emu::group->warp_values[w][tid % emu::WARP] = x;
  emu::warp_barrier(w);
  float total = 0.0f;
  for (int i = 0; i < emu::WARP; i++) {
    total += emu::group->warp_values[w][i];
  }
  emu::warp_barrier(w);
  return total;
}
