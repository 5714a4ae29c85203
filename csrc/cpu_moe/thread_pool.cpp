#include "thread_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>

namespace ft {

// Spin policy, read once per process: FREETOKEN_CPU_MOE_SPIN_US (default 1000) is how long an
// idle worker polls before it sleeps (decode calls come every ~100 us per layer; a pause costs
// ~140 cycles on Sapphire/Emerald Rapids, so a count of pauses is no measure of time), and
// FREETOKEN_CPU_MOE_SPIN_PAUSE=N (default 1) executes one pause every N polls, 0 = never (in
// a KVM guest, back-to-back pauses can trigger pause-loop exits, which add latency).
struct SpinPolicy {
  int64_t spin_ns = 1000 * 1000;
  int pause_every = 1;
};

static int64_t env_int(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !v[0]) return dflt;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return (end && *end == 0 && x >= 0) ? x : dflt;
}

static const SpinPolicy& spin_policy() {
  static const SpinPolicy p{env_int("FREETOKEN_CPU_MOE_SPIN_US", 1000) * 1000,
                            static_cast<int>(env_int("FREETOKEN_CPU_MOE_SPIN_PAUSE", 1))};
  return p;
}

static inline void relax(uint64_t i, int pause_every) {
  if (pause_every > 0 && i % static_cast<uint64_t>(pause_every) == 0) _mm_pause();
}

void wait_until_set(const std::atomic<int>& f) {
  const int pe = spin_policy().pause_every;
  for (uint64_t i = 0; !f.load(std::memory_order_acquire); ++i) relax(i, pe);
}

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

ThreadPool::ThreadPool(int num_threads)
    : n_(num_threads < 1 ? 1 : num_threads),
      go_(new Flag[n_]),
      done_(new Flag[n_]),
      cursors_(new Cursor[kMaxPhases * n_]) {
  for (int t = 1; t < n_; ++t) threads_.emplace_back([this, t] { worker(t); });
  pin_workers(threads_);
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  signal_all(++gen_);
  for (auto& th : threads_) th.join();
}

// Publishes run g (and job_, written before) to every worker, and wakes the sleeping ones.
// Dekker with a worker going to sleep: it counts itself in sleepers_ and then reads its go;
// this stores every go and then reads sleepers_ (all seq_cst), so one of the two sees the
// other's write: the worker does not sleep, or this notifies it (under the mutex, which the
// worker holds from its check to its wait).
void ThreadPool::signal_all(uint64_t g) {
  for (int t = 1; t < n_; ++t) go_[t].v.store(g, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> lk(mu_); }
    cv_.notify_all();
  }
}

void ThreadPool::worker(int tid) {
  uint64_t seen = 0;
  const SpinPolicy& sp = spin_policy();
  using Clock = std::chrono::steady_clock;
  std::atomic<uint64_t>& go = go_[tid].v;
  for (;;) {
    uint64_t g = go.load(std::memory_order_acquire);
    const auto t0 = Clock::now();
    for (uint64_t i = 1; g == seen; ++i) {  // the clock is read every 256 polls
      if (i % 256 == 0 && std::chrono::duration_cast<std::chrono::nanoseconds>(
                                Clock::now() - t0).count() >= sp.spin_ns)
        break;
      relax(i, sp.pause_every);
      g = go.load(std::memory_order_acquire);
    }
    if (g == seen) {
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait(lk, [&] { return go.load(std::memory_order_seq_cst) != seen; });
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      g = go.load(std::memory_order_acquire);
    }
    seen = g;
    if (stop_.load()) return;
    (*job_)(tid);
    done_[tid].v.store(g, std::memory_order_release);
  }
}

void ThreadPool::run_per_thread(const std::function<void(int)>& fn) {
  if (n_ == 1) {
    fn(0);
    return;
  }
  job_ = &fn;
  const uint64_t g = ++gen_;
  signal_all(g);
  fn(0);
  const int pe = spin_policy().pause_every;
  for (int t = 1; t < n_; ++t)
    for (uint64_t i = 0; done_[t].v.load(std::memory_order_acquire) != g; ++i) relax(i, pe);
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

void ThreadPool::run_phases(const int64_t* sizes, int nphases,
                            const std::function<void(int64_t, int)>& fn,
                            const std::function<void(int)>* first) {
  if (nphases < 1 || nphases > kMaxPhases) throw std::invalid_argument("run_phases: 1 or 2 phases");
  int64_t total = 0;
  for (int p = 0; p < nphases; ++p) total += sizes[p];
  if (total <= 0) return;
  if (n_ == 1) {
    if (first) (*first)(0);
    for (int64_t i = 0; i < total; ++i) fn(i, 0);
    return;
  }
  for (int p = 0; p < nphases; ++p)
    for (int t = 0; t < n_; ++t) {  // published to the workers by run_per_thread's release
      Cursor& c = cursors_[p * n_ + t];
      c.next.store(sizes[p] * t / n_, std::memory_order_relaxed);
      c.end = sizes[p] * (t + 1) / n_;
    }
  run_per_thread([&](int tid) {
    if (first) (*first)(tid);
    int64_t base = 0;
    for (int p = 0; p < nphases; ++p) {
      Cursor* cs = &cursors_[p * n_];
      for (int v = 0; v < n_; ++v) {  // own range first, then the others' in thread order
        Cursor& c = cs[(tid + v) % n_];
        // Another thread's range, most often used up when this thread gets to it: a plain
        // load says so without a locked update of a line that thread holds (the updates run
        // one after another, ~0.1-0.2 us each across cores; the loads overlap).
        if (v && c.next.load(std::memory_order_relaxed) >= c.end) continue;
        for (int64_t i = c.next.fetch_add(1, std::memory_order_relaxed); i < c.end;
             i = c.next.fetch_add(1, std::memory_order_relaxed))
          fn(base + i, tid);
      }
      base += sizes[p];
    }
  });
}

}  // namespace ft
