// A persistent thread pool: n - 1 workers plus the calling thread. Workers spin briefly
// after a job (decode calls come every ~100 us per layer) and then sleep on a condition
// variable, so an idle pool costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ft {

// Polls until f is non-zero (acquire), with the pool's spin policy: for waits of microseconds
// inside a pool run (the workers are all busy, so nothing is gained by sleeping).
void wait_until_set(const std::atomic<int>& f);

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  // fn(tid) once on each thread, tid in [0, size()); tid 0 is the caller. Returns when done.
  void run_per_thread(const std::function<void(int)>& fn);

  // fn(item) for item in [0, n_items), items claimed dynamically in increasing order.
  // NOTE: results must not depend on which thread ran an item (determinism).
  void run(int64_t n_items, const std::function<void(int64_t)>& fn);

  // fn(item, tid) for the items of up to kMaxPhases phases run one after another: phase p is
  // items [b_p, b_p + sizes[p]), b_p = sizes[0] + ... + sizes[p - 1]. Each phase's items are
  // cut into size() contiguous ranges, one per thread. A thread runs its own range in
  // increasing order (claims on its own cache line, so they cost no contention, and its items
  // are neighbours in memory when the caller's are), then takes what is left of the others'
  // ranges (the next thread's first), and enters the next phase only when every item of this
  // one is claimed: an item of phase p + 1 may wait for items of phase p (they are all running).
  // `first(tid)`, when given, runs on each thread before it claims any item.
  static constexpr int kMaxPhases = 2;
  void run_phases(const int64_t* sizes, int nphases, const std::function<void(int64_t, int)>& fn,
                  const std::function<void(int)>* first = nullptr);

 private:
  void worker(int tid);
  void signal_all(uint64_t g);

  int n_;
  std::vector<std::thread> threads_;
  // Start and end of a run, per worker on lines of their own: the caller stores the run's
  // number in each worker's `go` and polls each `done`; a worker polls its own `go` and stores
  // its `done`. One counter that every worker polls and then decrements costs a transfer of
  // that line per worker, one after another (~15 x 0.1-0.2 us at 15 threads, at the start and
  // again at the end of every layer); these transfers overlap.
  struct alignas(64) Flag {
    std::atomic<uint64_t> v{0};
  };
  std::unique_ptr<Flag[]> go_, done_;
  uint64_t gen_ = 0;               // the last run's number (the caller's)
  std::mutex mu_;                  // sleeping workers wait on cv_ under it
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* job_ = nullptr;

  struct alignas(64) Cursor {  // one thread's range of one phase
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::unique_ptr<Cursor[]> cursors_;  // [kMaxPhases][n_] (declared after n_)
};

}  // namespace ft
