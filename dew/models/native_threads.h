// Helper threads that share a native kernel's work with its caller (native_product.cc, native_attention.cc).
#ifndef DEW_NATIVE_THREADS_H_
#define DEW_NATIVE_THREADS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <sched.h>

namespace dew_native {

// Helper threads that share a kernel call's parts with its caller. XLA's intra-op pool wakes its
// threads too late for a call of a few hundred microseconds (a decode step runs one after the
// other), so the helpers wait for the next call awake for a while before they sleep. A call that
// finds the helpers taken by another (two lanes decoding at once) runs on its caller alone.
struct Job {
  std::function<void(int64_t)> run;  // one part of the work
  int64_t parts = 0;
  std::atomic<int64_t> next{0}, done{0};

  void Claim() {
    for (int64_t part; (part = next.fetch_add(1)) < parts;) {
      run(part);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Helpers {
 public:
  static Helpers& Get() {
    static Helpers* helpers = new Helpers();  // never destroyed: its threads outlive static destructors
    return *helpers;
  }

  int64_t threads() const { return static_cast<int64_t>(count_) + 1; }

  // Runs job->run(0 .. parts - 1) on the caller and the helpers; returns when every part is done.
  void Run(const std::shared_ptr<Job>& job) {
    bool expected = false;
    if (count_ > 0 && taken_.compare_exchange_strong(expected, true)) {
      {
        std::lock_guard<std::mutex> guard(mutex_);
        job_ = job;
      }
      generation_.fetch_add(1, std::memory_order_release);
      generation_.notify_all();
      job->Claim();
      while (job->done.load(std::memory_order_acquire) < job->parts) {
      }
      taken_.store(false, std::memory_order_release);
    } else {
      job->Claim();
    }
  }

 private:
  Helpers() {
    const char* env = std::getenv("DEW_NATIVE_THREADS");
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    count_ = std::max(0, (env ? std::atoi(env) : cpus) - 1);
    for (int i = 0; i < count_; ++i) std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now;
      const auto idle = std::chrono::steady_clock::now();
      std::chrono::steady_clock::duration waited{};
      for (int64_t spins = 0; (now = generation_.load(std::memory_order_acquire)) == seen; ++spins) {
        if (spins % 16 == 0) waited = std::chrono::steady_clock::now() - idle;
        if (waited < kPause)
          Pause();
        else if (waited < kYield)
          sched_yield();
        else
          generation_.wait(seen, std::memory_order_acquire);
      }
      seen = now;
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> guard(mutex_);
        job = job_;
      }
      if (job) job->Claim();
    }
  }

  static void Pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // A helper spins with pause for 50 us after a call, then yields its core (XLA's own threads run the
  // operations between kernel calls on these cores: a helper that kept spinning slowed them) for 3 ms, then sleeps.
  static constexpr auto kPause = std::chrono::microseconds(50);
  static constexpr auto kYield = std::chrono::microseconds(3000);
  int count_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> taken_{false};
  std::mutex mutex_;
  std::shared_ptr<Job> job_;
};

}  // namespace dew_native

#endif  // DEW_NATIVE_THREADS_H_
