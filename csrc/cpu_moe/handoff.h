// The CPU side of the expert-cache hand-off (freetoken/moe/handoff.py): a thread that waits
// for jobs in pinned host memory, computes each job's CPU routes with the executor and
// signals the result back, with no Python and no CUDA call on the way, so the GPU side can
// sit inside a CUDA graph (its kernels write the job and a `go` number, then poll `done`).
//
// Buffer (one pinned allocation; byte offsets given at construction, see HandoffLayout):
//   go    uint32  the job's number (written last by the producer, release)
//   done  uint32  the number of the last job answered (written by this thread, release)
//   live  int32   real tokens of the step (rows >= live are a CUDA graph's padding)
//   error int32   non-zero after a job failed (the message: last_error()); its out is zeros
//   job   int32 layer, T rows written, activation, x dtype (0 f32, 1 bf16, 2 f16), then
//         ids int32 [T, k], weights fp32 [T, k], map int32 [E] (expert -> slot, -1: the
//         CPU's), x [T, H]
//   out   fp32 [T, H]: the CPU routes' weighted sum per row (zeros where it has none)
//   hint  int32 tag, layer, misses, 0, then ids [hint_max]: the experts the next MoE layer is
//         predicted to route to and the device not to hold (`misses` of them, the first
//         hint_max listed), in the slot plan's fetch order (most-routed first, then the lower
//         id), written by the producer while job `tag` runs (tag last, release); optional
//         (offset 0: none)
//   ahead two areas of int32 tag, layer, n, 0, then (expert, slot) int32 pairs [ahead_max]:
//         list a (a = 1, 2, ...) in area a & 1, the experts of MoE layer `layer` that the
//         device gave slots ahead of that layer's call (fetching ahead), tag written last
//         (release); optional (offset 0: none)
//   ahead_done uint32 the number of the last list whose copies are complete
// A route is the CPU's when its row is live and map[id] < 0.
//
// Copies ahead (set_copier): the worker serves the ahead lists in order (skipping one the
// device overwrote before it was served, after a wait that timed out), after the job it
// answers (the device then runs attention and the router, and the host's memory and the
// copy engine are idle): each listed expert's parts are copied from the layer's host bank
// into its slot. On a GPU by the driver's cuMemcpyHtoDAsync on a copy stream, then
// cuStreamWriteValue32 sets ahead_done = a on that stream once they are complete (the device
// waits for it before the layer reads those slots); the driver's entry points, its context
// and the stream come from the caller, so this library links no CUDA. With the CPU standing
// in as the device (no entry points), memcpy and then ahead_done = a (release).
//
// Warming (set_prefetch): after answering job n, if the hint's tag is n, the worker drops the
// hint's first F experts (F = the fetch table at its `misses`: those the device will fetch;
// where hits on slots filled ahead count as fetches (set_prefetch's ahead_counts: hybrid's
// split) and the worker served that layer's ahead list of a experts after job n, F(misses +
// a) - a, as the slot plan takes it) and has the executor's threads read their shares of the
// rest into their caches (Executor::warm) until job n + 1 is posted: between two jobs the CPU
// otherwise waits for the device's layer (attention and the router), tens of microseconds in
// which DRAM is idle.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "executor.h"

namespace ft {

struct HandoffLayout {
  int64_t go = 0, done = 0, live = 0, error = 0, job = 0, ids = 0, weights = 0, map = 0,
          x = 0, out = 0, hint = 0, hint_max = 0, ahead = 0, ahead_max = 0, ahead_done = 0;
  int64_t max_tokens = 0, top_k = 0, num_experts = 0, hidden = 0;
};

class HandoffWorker {
 public:
  // `ex` must outlive the worker and be used by no other thread while it runs.
  HandoffWorker(Executor* ex, uint8_t* buf, const HandoffLayout& lay, int64_t spin_us);
  ~HandoffWorker();

  // Layer `layer`'s host banks (the executor's layout) and its [E, 4] scales.
  void set_layer(int64_t layer, const Bank& w13, const Bank& w2, const float* scales);
  // Producer side from the host (the CPU standing in as the device, tests): post job n
  // (the job already written), and wait for done == n (returns false on a worker error or
  // after timeout_s without an answer; last_error() says which).
  void post(uint32_t n);
  bool wait(uint32_t n, double timeout_s);
  std::string last_error() const;
  int64_t jobs() const { return jobs_.load(std::memory_order_relaxed); }
  // Warming on or off; fetch_table[M]: how many of M missing experts the device fetches
  // (the policy's table, capped; empty: none). Call it while no job runs.
  // ahead_counts: the plan counts hits on slots filled ahead against its fetches (warming)
  void set_prefetch(bool on, const std::vector<int32_t>& fetch_table, bool ahead_counts);
  // Since the worker started: {hints (jobs after which it warmed), experts warmed fully,
  // warmed experts the next job of that layer computed, CPU experts of those next jobs}.
  std::vector<int64_t> prefetch_stats() const;
  // Copies ahead (see above). pool: the slots' base address, slot_bytes apart; the driver's
  // context and cuCtxSetCurrent / cuMemcpyHtoDAsync_v2 / cuStreamWriteValue32_v2 and a
  // stream (all 0: host memcpy). Call it before the first list is posted.
  void set_copier(uint64_t pool, int64_t slot_bytes, uint64_t ctx, uint64_t set_ctx,
                  uint64_t memcpy_h2d, uint64_t write_value, uint64_t stream);
  // Layer `layer`'s parts as (host address of expert 0, its bytes per expert, offset in a
  // slot) triples: expert e's part is at address + e * bytes.
  void set_copy_layer(int64_t layer, const std::vector<int64_t>& parts);
  // Producer side from the host: wait until ahead_done reaches list a (false after
  // timeout_s; last_error() says so).
  bool wait_ahead(uint32_t a, double timeout_s);
  // Ahead lists served and experts copied since the worker started.
  std::vector<int64_t> ahead_stats() const;
  // Serve no ahead list until `us` microseconds after an answer (0: at once): the device's
  // receive reads the answer over the link the copies would fill. Call it while no job runs.
  void set_ahead_delay(int64_t us);
  // Job timing for profiles: while on, each job appends {go seen, forward start, forward
  // end, done set (steady-clock us), rows computed, routes computed, free: the ahead copies
  // queued and the warming done after the answer (us)} (up to kTraceCap jobs).
  // Turning it on clears the record; read it only while no job runs (after a step's sync).
  static constexpr size_t kTraceCap = 1 << 16, kTraceFields = 7;
  void set_trace(bool on);
  std::vector<int64_t> trace() const;

 private:
  void loop(uint32_t last);
  void run_job();
  void warm_next(uint32_t n);
  void count_warmed(const int32_t* ids, const int32_t* map, int64_t live);
  void serve_ahead();
  void fail(const std::string& what);  // the error (last_error), then the buffer's error word

  Executor* ex_;
  uint8_t* buf_;
  HandoffLayout lay_;
  int64_t spin_us_;
  struct LayerBanks {
    Bank w13, w2;
    const float* scales = nullptr;
    bool set = false;
  };
  std::vector<LayerBanks> layers_;
  // the compacted job: rows with a CPU route, their x (fp32), ids and weights
  std::vector<int64_t> rows_;
  std::vector<float> xc_, wc_, yc_;
  std::vector<int32_t> idc_;
  mutable std::mutex err_mu_;
  std::string err_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> jobs_{0};
  std::atomic<bool> tracing_{false};
  std::atomic<bool> prefetch_{false};
  std::vector<int32_t> fetch_table_;
  std::vector<int32_t> warmed_ids_;  // the experts of layer warmed_layer_ warmed fully
  std::vector<uint8_t> seen_;        // [E] scratch of count_warmed
  int64_t warmed_layer_ = -1;
  bool ahead_counts_ = false;
  int64_t served_layer_ = -1, served_n_ = 0;  // the last ahead list served (every call posts one)
  std::atomic<int64_t> stats_[4] = {};
  std::vector<int64_t> trace_;  // kTraceFields per job, reserved when tracing starts
  int64_t t_fwd0_ = 0, t_fwd1_ = 0, routes_ = 0;  // the current job's, for the trace
  int64_t ahead_delay_us_ = 0, answered_at_ = 0;  // set_ahead_delay; the last answer's time
  struct Copier {
    uint64_t pool = 0, ctx = 0, set_ctx = 0, memcpy_h2d = 0, write_value = 0, stream = 0;
    int64_t slot_bytes = 0;
  } copier_;
  std::atomic<bool> copier_on_{false};
  bool ctx_set_ = false;
  std::vector<std::vector<int64_t>> copy_parts_;  // per layer: (address, bytes, offset) triples
  uint32_t ahead_last_ = 0;                      // the last list served
  std::atomic<int64_t> ahead_stats_[2] = {};
  std::thread thread_;
};

}  // namespace ft
