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
#include <memory>
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
    auto job = std::make_shared<Job>(fn, chunks);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job->work();
    for (int i = 0; job->done.load(std::memory_order_acquire) != chunks; ++i) {
      if (i < 4096) {
        MLXINFER_PAUSE();
      } else {
        std::this_thread::yield(); // the claimer of the last chunk may be descheduled
      }
    }
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(100);

  // One call's chunks. Shared with the workers, so one that picks it up late finds
  // nothing left to claim (and never runs `fn` after run() returned).
  struct Job {
    Job(const std::function<void(int)>& f, int n) : fn(f), chunks(n) {}
    const std::function<void(int)>& fn;
    const int chunks;
    std::atomic<int> next{0};
    std::atomic<int> done{0};

    void work() {
      for (int c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
        fn(c);
        done.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  };

  void start(int threads) {
    stopping_ = false;
    const uint64_t now = generation_.load();  // a worker's first job is the next one published
    for (int t = 1; t < threads; ++t) {
      workers_.emplace_back([this, now] { work(now); });
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& t : workers_) {
      t.join();
    }
    workers_.clear();
  }

  // The next job after generation `seen` (nullptr when stopping): spin, then sleep.
  std::shared_ptr<Job> await(uint64_t& seen) {
    auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0; generation_.load(std::memory_order_acquire) == seen; ++i) {
      MLXINFER_PAUSE();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) {
        break;
      }
    }
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return stopping_ || generation_.load(std::memory_order_relaxed) != seen; });
    seen = generation_.load(std::memory_order_relaxed);
    return stopping_ ? nullptr : job_;
  }

  void work(uint64_t seen) {
    while (auto job = await(seen)) {
      job->work();
    }
  }

  std::vector<std::thread> workers_;
  std::shared_ptr<Job> job_;  // guarded by mutex_
  bool stopping_ = false;      // guarded by mutex_
  std::atomic<uint64_t> generation_{0};
  std::mutex mutex_;
  std::mutex run_mutex_;
  std::condition_variable wake_;
};

} // namespace mlxinfer
