// Shared by multilora's CPU kernels: spreading work items over XLA's CPU thread pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace multilora {

// Runs fn(item) for every item, spread over the XLA CPU thread pool and the calling thread.
// The caller claims items too and waits only for items already claimed by a running helper, so
// a busy pool (other ops of the step running on its threads) costs parallelism, never a
// deadlock; a helper that starts after the last item is claimed touches only the shared counter.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

constexpr int64_t kSpinsBeforeYield = 1 << 16;  // ~1-2 ms of pause instructions

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

template <typename Item, typename Fn>
void parallel_items(xla::ffi::ThreadPool& pool, const std::vector<Item>& items, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  if (helpers <= 0) {
    for (const Item& it : items) fn(it);
    return;
  }
  auto shared = std::make_shared<Shared>();
  const Item* data = items.data();
  const Fn* f = &fn;
  for (int64_t w = 0; w < helpers; ++w)
    pool.Schedule([shared, data, f, n]() {
      for (int64_t i; (i = shared->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        (*f)(data[i]);
        shared->finished.fetch_add(1, std::memory_order_release);
      }
    });
  for (int64_t i; (i = shared->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
    fn(items[i]);
    shared->finished.fetch_add(1, std::memory_order_release);
  }
  // Spin a while before yielding: a helper's last item usually ends within microseconds, and a
  // yield hands the core to whatever else is runnable (an adapter read on a SCHED_IDLE thread
  // included) until the next scheduler tick, a millisecond or more that the step then waits.
  for (int64_t spins = 0; shared->finished.load(std::memory_order_acquire) < n; ++spins) {
    if (spins < kSpinsBeforeYield)
      cpu_relax();
    else
      std::this_thread::yield();
  }
}

// A layer index from an operand, clamped into [0, L).
inline int64_t clamp_layer(int32_t layer, int64_t L) { return layer < 0 ? 0 : (layer >= L ? L - 1 : layer); }

}  // namespace multilora
