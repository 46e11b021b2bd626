// A small thread pool for splitting one matmul across the cores.
//
// Why not MLX's own pool or std::async: a decode step runs a few hundred matmuls of
// 20-500 microseconds each, so handing out work must cost far less than that. The
// work is cut into chunks that every thread (the caller included) claims from one
// atomic counter, so a worker the OS has not scheduled yet costs nothing: the others
// take its chunks. Workers spin briefly after a job (the next matmul usually follows
// within microseconds), then sleep on a condition variable.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MLXINFER_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define MLXINFER_PAUSE() asm volatile("yield")
#else
#define MLXINFER_PAUSE() ((void)0)
#endif

namespace mlxinfer {

class Pool {
 public:
  explicit Pool(int threads) {
    start(threads);
  }
  ~Pool() {
    stop();
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int size() const {
    return static_cast<int>(workers_.size()) + 1;
  }

  // Change the number of threads (the caller counts as one); waits for a running job.
  void resize(int threads) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    stop();
    start(threads);
  }

  // Run fn(chunk) for every chunk in [0, chunks) across the threads; returns when all
  // are done. A second caller arriving while a job runs (another CPU stream) runs its
  // chunks itself rather than wait.
  void run(int chunks, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> run_lock(run_mutex_, std::try_to_lock);
    if (!run_lock.owns_lock() || workers_.empty() || chunks < 2) {
      for (int c = 0; c < chunks; ++c) {
        fn(c);
      }
      return;
    }
    job_ = &fn;
    chunks_.store(chunks, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    uint64_t generation = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state_.store(generation << 32, std::memory_order_release);
    }
    wake_.notify_all();
    work_on(generation);
    for (int i = 0; done_.load(std::memory_order_acquire) != chunks; ++i) {
      if (i < 4096) {
        MLXINFER_PAUSE();
      } else {
        std::this_thread::yield(); // the claimer of the last chunk may be descheduled
      }
    }
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(100);

  // Claim and run chunks of job `generation` until none is left (or a newer job began).
  void work_on(uint64_t generation) {
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s >> 32) == generation && static_cast<int>(s & 0xffffffff) < chunks_.load(std::memory_order_relaxed)) {
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
        (*job_)(static_cast<int>(s & 0xffffffff));
        done_.fetch_add(1, std::memory_order_acq_rel);
        s = state_.load(std::memory_order_acquire);
      }
    }
  }

  void start(int threads) {
    stopping_.store(false);
    for (int t = 1; t < threads; ++t) {
      workers_.emplace_back([this] { work(); });
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_.store(true);
    }
    wake_.notify_all();
    for (auto& t : workers_) {
      t.join();
    }
    workers_.clear();
  }

  // The generation of the next job after `seen` (or `seen` when stopping): spin, then sleep.
  uint64_t await(uint64_t seen) {
    auto changed = [&] { return stopping_.load() || (state_.load(std::memory_order_acquire) >> 32) != seen; };
    auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0; !changed(); ++i) {
      MLXINFER_PAUSE();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, changed);
        break;
      }
    }
    return state_.load(std::memory_order_acquire) >> 32;
  }

  void work() {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
    while (true) {
      seen = await(seen);
      if (stopping_.load()) {
        return;
      }
      work_on(seen);
    }
  }

  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<int> chunks_{0};
  std::atomic<uint64_t> state_{0}; // job generation << 32 | next unclaimed chunk
  std::atomic<int> done_{0};
  std::atomic<bool> stopping_{false};
  std::mutex mutex_;
  std::mutex run_mutex_;
  std::condition_variable wake_;
};

} // namespace mlxinfer
