// The CPU MoE executor: one call computes a whole MoE layer for a batch of tokens.
//   y[t] += r * ((glu(x @ Wg[e]^T * s[e,0], x @ Wu[e]^T * s[e,1])) @ Wd[e]^T * s[e,2])
// for each token t and each of its k (expert e, routing weight r).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "thread_pool.h"

namespace ft {

enum class Act : int { SILU = 0, GELU_TANH = 1 };

struct LayerArgs {
  const float* x = nullptr;     // [T, H] fp32
  int64_t T = 0, k = 0;
  const int32_t* ids = nullptr; // [T, k]
  const float* route = nullptr; // [T, k]
  Bank w13;                     // [E, 2I, H]: rows 0..I-1 gate, I..2I-1 up
  Bank w2;                      // [E, H, I]
  const float* scales = nullptr; // [E, 4] fp32: gate, up, down, 1
  Act act = Act::SILU;
  void* out = nullptr;          // [T, H] fp32, or bf16 when out_bf16
  bool out_bf16 = false;
};

// 64-byte aligned growable scratch.
class Scratch {
 public:
  uint8_t* get(size_t n) {
    if (buf_.size() < n + 64) buf_.resize(n + 64);
    auto p = reinterpret_cast<uintptr_t>(buf_.data());
    return reinterpret_cast<uint8_t*>((p + 63) & ~uintptr_t{63});
  }

 private:
  std::vector<uint8_t> buf_;
};

// A growable array of T, reused across calls (T need not be movable: atomics).
template <class T>
class Slots {
 public:
  T* get(size_t n) {
    if (n > cap_) {
      p_.reset(new T[n]);
      cap_ = n;
    }
    return p_.get();
  }

 private:
  std::unique_ptr<T[]> p_;
  size_t cap_ = 0;
};

// Per active expert of a layer call: slots whose gate/up share is done (every thread updates
// it once per expert), and its down input ready (polled by the down items): each on its own
// cache line.
struct ExpertSync {
  alignas(64) std::atomic<int64_t> shares_done{0};
  alignas(64) std::atomic<int> ready{0};
};
struct alignas(64) Counter {
  std::atomic<int64_t> v{0};
};
// 16 counters on one cache line: a slot's counters of units done per expert, updated by the
// thread that owns the slot (and by one that takes its leftovers).
struct alignas(64) CounterLine {
  std::atomic<int32_t> v[16];
};

// Where the layers' time went on one thread (seconds summed over the profiled calls): from the
// pool run's start to its first item (waking, its first prefetches; on the caller, also the
// input's quantization at small batches), its gate/up dots, the GLU + down-input quant of the
// experts it completed, waiting (for the input or an expert's GLU output), its down dots, the
// output reductions it did, and from its last item to the run's end. The rest of `span` (the
// layers' pool runs, the same for every thread) is claiming work and the profiler's clock reads.
struct LayerProfile {
  double start = 0, gate_up = 0, glu = 0, wait = 0, down = 0, reduce = 0, end = 0;
  int64_t items = 0;
};

// One decode step's attention block (decode_ops.cpp): B sequences, one token each.
struct DecodeAttnArgs {
  int64_t B = 0, hq = 0, hkv = 0, d = 0;
  float* qkv = nullptr;          // [B, (hq + 2 hkv) d]: q, k normed and rotated in place
  const float* cos = nullptr;    // [B, d]
  const float* sin = nullptr;    // [B, d]
  const float* q_norm = nullptr; // [d] per-head RMSNorm weights of q and k, or null
  const float* k_norm = nullptr;
  float eps = 1e-6f;
  float* cache = nullptr;        // [2, num_slots, hkv, d] (pages x page_size slots)
  int64_t num_slots = 0, page_size = 0;
  const int64_t* slots = nullptr;     // [B] slot each token's k, v go to (< 0: none)
  const int32_t* page_table = nullptr;  // [B, pt_width]
  int64_t pt_width = 0;
  const int32_t* seq_lens = nullptr;  // [B] lengths after this token
  float scale = 1.0f, softcap = 0.0f;  // softcap 0: none
  int64_t window = 0;                  // 0: none; else the last `window` positions
  float* out = nullptr;                // [B, hq d]
};

class Executor {
 public:
  Executor(int num_threads, const std::string& isa, bool no_vnni, bool no_avx512vnni);

  const char* isa() const { return k_->name; }
  int num_threads() const { return pool_.size(); }

  // Throws std::invalid_argument on out-of-range expert ids. Not reentrant (one scratch).
  void forward(const LayerArgs& a);

  // A decode step's small fp32 operations (decode_ops.cpp). rms_norm: y = norm(x + res)
  // (sum written to `sum` when res is given) row by row; decode_attention: see DecodeAttnArgs.
  void rms_norm(const float* x, const float* res, const float* w, int64_t rows, int64_t n,
                float eps, float* y, float* sum);
  void decode_attention(const DecodeAttnArgs& a);
  // Its attention part alone: queries at a.qkv + b * row (already normed and rotated), the
  // cache already holding their keys and values.
  void decode_attend(const DecodeAttnArgs& a, int64_t row);

  // Brings into each pool thread's caches its own share of experts[0..n)'s w13 and w2 rows
  // (the rows forward()'s layer run gives that thread: one slot of SlotSplit) and their
  // block scales, expert after expert, w13 then w2, until *stop no longer equals stop_value
  // (checked every few KiB). Returns how many experts every thread finished. The hand-off
  // worker warms the experts the next layer is predicted to give the CPU while the device
  // works, so that their rows come from the cache instead of DRAM (handoff.h).
  int64_t warm(const Bank& w13, const Bank& w2, const int32_t* experts, int64_t n,
               const uint32_t* stop, uint32_t stop_value);

  // Hooks for tests and the benchmark.
  // out[t, n] = x[t] . W[e, n] for all rows n of expert e (the tier's activation prep
  // included); rows split over `threads` threads (<= num_threads).
  void dot(const Bank& w, int64_t e, const float* x, int64_t T, float* out, int threads);
  // Rows [r0, r1) of expert e as fp32 out[r1 - r0, K] (the prefill path's decode-then-GEMM),
  // bit for bit gguf-py's dequantize; split over the pool's threads.
  void dequant(const Bank& w, int64_t e, int64_t r0, int64_t r1, float* out);
  // The tier's prepared activation of one token for a format (bytes returned in `out`).
  std::vector<uint8_t> prep(Fmt fmt, const float* x, int64_t K) const;
  // Seconds for `iters` forward calls; call i routes by ids[i] / route[i] ([iters, T, k]).
  double time_forward(LayerArgs a, const int32_t* ids, const float* route, int64_t iters);
  // Seconds for `iters` dots of one token over all rows of expert e.
  double time_dot(const Bank& w, int64_t e, const float* x, int64_t iters, int threads);
  // The tier's GLU in place (see Kernels::glu).
  void glu(float* g, const float* u, int64_t n, float s_gate, float s_up, int act) const {
    k_->glu(g, u, n, s_gate, s_up, act);
  }
  // Per-thread time accounting of forward() (off by default: no clock reads when off).
  void set_profiling(bool on);
  std::vector<LayerProfile> layer_profile() const { return prof_; }
  double profile_span() const { return prof_span_; }
  int64_t profile_calls() const { return prof_calls_; }
  // (seconds, bytes read) for `iters` streaming reads of up to n bytes split over `threads`
  // threads, software-prefetching `dist` bytes ahead into L1 and `far` into L2 (0 = none).
  std::pair<double, int64_t> time_stream(const uint8_t* p, int64_t n, int64_t iters,
                                         int threads, int64_t dist, int64_t far);

 private:
  void prep_tokens(const Bank& w, const float* x, int64_t T, int64_t K, uint8_t* out,
                   int64_t stride);
  // Pairs sorted by expert: experts[i] has pairs p0[i] .. p0[i+1]-1; pidx[t*k + j] = its pair.
  // Reused across calls (no allocation per layer once grown).
  struct Routing {
    std::vector<int64_t> experts, p0, pidx, order;
  };
  void route(const LayerArgs& a);
  // The layer input's activation prep, when the layer's pool run does it (small batches).
  struct InputPrep {
    const float* x;
    int64_t T, K;
    uint8_t* out;
    int64_t stride;
  };
  void layer(const LayerArgs& a, const Routing& rt, const uint8_t* const* acts, float* h,
             uint8_t* aq, int64_t as, const uint8_t* const* acts2, float* d,
             const InputPrep* in);

  ThreadPool pool_;
  const Kernels* k_;
  Scratch xq_, h_, aq_, d_, ptrs_, ptrs2_;
  Slots<ExpertSync> sync_;
  Slots<Counter> unit_done_;
  Slots<CounterLine> share_;
  Slots<int64_t> bounds_;  // the layer's SlotSplit row tables
  Routing rt_;
  struct alignas(64) Flag {
    std::atomic<int> v{0};
  };
  Flag input_ready_;  // the layer input is prepared (set in the pool run at small batches)
  bool profiling_ = false;
  std::vector<LayerProfile> prof_;
  std::vector<std::chrono::steady_clock::time_point> prof_last_;  // a thread's last item's end
  double prof_span_ = 0;
  int64_t prof_calls_ = 0;
};

int64_t act_stride(const Kernels& k, Fmt fmt, int64_t K);

}  // namespace ft
