#include "thread_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <cstdlib>

namespace ft {

constexpr int kSpinIters = 20000;  // ~50-100 us of pause before sleeping

// Worker t runs on the t-th CPU the process may use, so the OS does not migrate it mid-layer
// (its L1/L2 and the prefetchers' streams stay put). The caller (tid 0) is left alone. Skipped
// when there are fewer allowed CPUs than threads, or with FREETOKEN_CPU_MOE_PIN=0.
static void pin_workers(std::vector<std::thread>& threads) {
  const char* env = std::getenv("FREETOKEN_CPU_MOE_PIN");
  if (env && env[0] == '0') return;
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (cpus.size() < threads.size() + 1) return;
  for (size_t t = 0; t < threads.size(); ++t) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[t + 1], &one);
    pthread_setaffinity_np(threads[t].native_handle(), sizeof(one), &one);  // best effort
  }
}

ThreadPool::ThreadPool(int num_threads) : n_(num_threads < 1 ? 1 : num_threads) {
  for (int t = 1; t < n_; ++t) threads_.emplace_back([this, t] { worker(t); });
  pin_workers(threads_);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
    gen_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& th : threads_) th.join();
}

void ThreadPool::worker(int tid) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g = gen_.load(std::memory_order_acquire);
    for (int i = 0; g == seen && i < kSpinIters; ++i) {
      _mm_pause();
      g = gen_.load(std::memory_order_acquire);
    }
    if (g == seen) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
      g = gen_.load(std::memory_order_acquire);
    }
    seen = g;
    if (stop_.load()) return;
    (*job_)(tid);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run_per_thread(const std::function<void(int)>& fn) {
  if (n_ == 1) {
    fn(0);
    return;
  }
  job_ = &fn;
  pending_.store(n_ - 1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(mu_);
    gen_.fetch_add(1, std::memory_order_acq_rel);
  }
  cv_.notify_all();
  fn(0);
  while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
}

void ThreadPool::run(int64_t n_items, const std::function<void(int64_t)>& fn) {
  if (n_items <= 0) return;
  if (n_ == 1 || n_items == 1) {
    for (int64_t i = 0; i < n_items; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  run_per_thread([&](int) {
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) fn(i);
  });
}

}  // namespace ft
