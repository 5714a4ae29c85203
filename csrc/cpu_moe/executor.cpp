#include "executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

#include "cpu_features.h"

namespace ft {

// ============================================================================
// helpers
// ============================================================================
int64_t Bank::expert_bytes() const {
  int64_t n = N * row_bytes;
  if (fmt == Fmt::NVFP4) n += N * (K / 16);
  if (fmt == Fmt::MXFP4) n += N * (K / 32);
  if (fmt == Fmt::FP8_BLOCK) n += ((N + 127) / 128) * ((K + 127) / 128) * 4;
  return n;
}

int64_t act_stride(const Kernels& k, Fmt fmt, int64_t K) {
  return (k.fmt[static_cast<int>(fmt)].act_bytes(K) + 63) / 64 * 64;
}

constexpr int64_t kReduceRows = 128;  // output rows per reduction block

static std::atomic<uint64_t> g_sink{0};  // keeps streaming reads alive

using Clock = std::chrono::steady_clock;
static double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ============================================================================
// Executor
// ============================================================================
Executor::Executor(int num_threads, const std::string& isa, bool no_vnni, bool no_avx512vnni)
    : pool_(num_threads), k_(&select_tier(isa, no_vnni, no_avx512vnni)) {}

// Small batches (T * K <= 8192: about 3 us of SIMD quant, measured ~0.35 us per 1k values on
// one core) run on the caller: a pool run would cost a barrier for about that much work.
void Executor::prep_tokens(const Bank& w, const float* x, int64_t T, int64_t K, uint8_t* out,
                           int64_t stride) {
  const PrepFn prep = k_->fmt[static_cast<int>(w.fmt)].prep;
  if (T * K <= 8192) {
    for (int64_t t = 0; t < T; ++t) prep(x + t * K, K, out + t * stride);
    return;
  }
  pool_.run(T, [&](int64_t t) { prep(x + t * K, K, out + t * stride); });
}

// Work units of the DRAM dot and the streaming ceiling: kUnitsPerThread runs of rows per
// thread, in contiguous ranges per thread (ThreadPool::run_phases), so a thread streams one
// long run of rows and scales and the dots' prefetch past a unit's end lands on the thread's
// next unit; the units a range has are the slack for threads that run slower (a neighbour on
// their core): they finish their range late and the others take its last units.
constexpr int64_t kUnitsPerThread = 8;

// The rows of each active expert of a layer, cut into one slot per thread (at multiples of 4
// rows) and each slot into `units` work items of about kUnitBytes. Items are numbered slot-
// major, then expert, then unit: item i is unit i % units of expert (i / units) % nact in slot
// i / (units * nact), so thread t's range of a pool run (ThreadPool::run_phases) is slot t:
// its share of every expert, expert after expert, each share one contiguous run of rows.
// Every thread thus finishes expert e's gate/up share at about (e + 1) / nact of the phase, so
// experts become ready in order while the phase runs (the down phase starts on ready experts),
// and the thread that computes a slot's down rows for every expert also reduces them (the
// rows of all experts for its output rows are in its own cache). A dot's prefetch may run to
// the end of its expert's share and on into the thread's share of the next expert (ReadNext),
// not into the next slot's rows.
constexpr int64_t kUnitBytes = 32 << 10;

struct SlotSplit {
  int64_t rows, nact, slots, units;
  // bound[t * units + u]: the first row of unit u of slot t; bound[slots * units] = rows
  // (a table filled once per call: a work item reads it instead of dividing ~10 times).
  const int64_t* bound;
  int64_t items() const { return slots * nact * units; }
  // First row of unit u of slot t (u == units: the slot's end).
  int64_t row(int64_t t, int64_t u) const { return bound[t * units + u]; }
  void item(int64_t i, int64_t& t, int64_t& ei, int64_t& u) const {
    t = i / (nact * units);
    ei = i / units % nact;
    u = i % units;
  }
};

// Thread `t`'s slot of a SlotSplit over `rows` rows for `threads` threads: rows [a, b)
// (slot_split's boundaries; a == b past its last slot).
static void slot_rows(int64_t rows, int threads, int64_t t, int64_t& a, int64_t& b) {
  const int64_t slots = std::max<int64_t>(1, std::min<int64_t>(threads, rows / 4));
  if (t >= slots) {
    a = b = rows;
    return;
  }
  a = rows * t / slots / 4 * 4;
  b = t + 1 == slots ? rows : rows * (t + 1) / slots / 4 * 4;
}

// Slots at [rows * t / slots] and units at [(b - a) * u / units] inside them, all rounded down
// to 4 rows; `bound` receives slots * units + 1 entries.
static SlotSplit slot_split(int64_t rows, int64_t row_bytes, int64_t nact, int threads,
                            int64_t* bound) {
  const int64_t slots = std::max<int64_t>(1, std::min<int64_t>(threads, rows / 4));
  const int64_t units = std::max<int64_t>(
      1, std::min<int64_t>(rows / slots / 4, (rows / slots * row_bytes + kUnitBytes / 2) / kUnitBytes));
  for (int64_t t = 0; t < slots; ++t) {
    int64_t a, b;
    slot_rows(rows, threads, t, a, b);
    for (int64_t u = 0; u < units; ++u) bound[t * units + u] = a + (b - a) * u / units / 4 * 4;
  }
  bound[slots * units] = rows;
  return SlotSplit{rows, nact, slots, units, bound};
}

// Entries slot_split may write for `threads` threads.
static int64_t slot_split_bound_size(int64_t rows, int threads) {
  const int64_t slots = std::max<int64_t>(1, std::min<int64_t>(threads, rows / 4));
  return slots * std::max<int64_t>(1, rows / slots / 4) + 1;
}

// y[t, c0:c1] = sum_j route[t, j] * d[p(t, j), c0:c1] * s_down, in j order (fixed order).
static void reduce_rows(const LayerArgs& a, const std::vector<int64_t>& pidx, const float* d,
                        int64_t c0, int64_t c1) {
  const int64_t H = a.w2.N;
  for (int64_t t = 0; t < a.T; ++t) {
    // The k rows were written by other threads: request all their lines at once instead of
    // one expert's after another (a cross-core transfer each).
    for (int64_t j = 0; j < a.k; ++j)
      prefetch_lines(reinterpret_cast<const uint8_t*>(d + pidx[t * a.k + j] * H + c0),
                     static_cast<int>(((c1 - c0) * 4 + 63) / 64));
    float acc[kReduceRows] = {};
    for (int64_t j = 0; j < a.k; ++j) {
      const int64_t i = t * a.k + j;
      const float sd = a.scales[a.ids[i] * 4 + 2], r = a.route[i];
      const float* dp = d + pidx[i] * H;
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += r * (dp[c] * sd);
    }
    if (a.out_bf16) {
      auto* o = static_cast<uint16_t*>(a.out) + t * H;
      for (int64_t c = c0; c < c1; ++c) o[c] = f32_to_bf16(acc[c - c0]);
    } else {
      auto* o = static_cast<float*>(a.out) + t * H;
      for (int64_t c = c0; c < c1; ++c) o[c] = acc[c - c0];
    }
  }
}

// Both halves of a layer in one pool run (one barrier, no gap between them), as two phases
// of ThreadPool::run_phases over SlotSplit items. Phase 1: the experts' 2I gate/up rows,
// h[p] = [x W_g^T | x W_u^T]; the thread whose rows complete an expert applies the GLU to
// h[p][:I] for that expert's pairs, prepares the down input aq[p] and marks the expert ready.
// Phase 2: the experts' H down rows, d[p, rows] = aq[p] W_d[e, rows]^T, each item waiting until
// its expert is ready; when a thread takes a phase-2 item every phase-1 item is already
// running on some thread and none of those waits (no deadlock, on one thread too). The items
// of a slot's unit u (one per expert) count down; the thread that completes the last reduces
// the unit's output rows, y[t, rows] = sum_j route[t, j] * d[p(t, j), rows] * s_down in j order.
// All of this is the same arithmetic whichever thread does it: results do not depend on the
// thread count.
void Executor::layer(const LayerArgs& a, const Routing& rt, const uint8_t* const* acts, float* h,
                     uint8_t* aq, int64_t as, const uint8_t* const* acts2, float* d,
                     const InputPrep* in) {
  const int64_t N = a.w13.N, I = N / 2, H = a.w2.N, nact = static_cast<int64_t>(rt.experts.size());
  const int64_t nb1 = slot_split_bound_size(N, pool_.size());
  int64_t* bound = bounds_.get(nb1 + slot_split_bound_size(H, pool_.size()));
  const SlotSplit sp1 = slot_split(N, a.w13.expert_bytes() / N, nact, pool_.size(), bound);
  const SlotSplit sp2 = slot_split(H, a.w2.expert_bytes() / H, nact, pool_.size(), bound + nb1);
  const DotFn dot1 = k_->fmt[static_cast<int>(a.w13.fmt)].dot;
  const DotFn dot2 = k_->fmt[static_cast<int>(a.w2.fmt)].dot;
  const PrepFn prep2 = k_->fmt[static_cast<int>(a.w2.fmt)].prep;
  // Counters on their own cache lines (threads update them at once), reused across calls.
  ExpertSync* sync = sync_.get(nact);
  const int64_t nunits = sp2.slots * sp2.units;
  Counter* unit_done = unit_done_.get(nunits);
  for (int64_t i = 0; i < nact; ++i) {
    sync[i].shares_done.store(0, std::memory_order_relaxed);
    sync[i].ready.store(0, std::memory_order_relaxed);
  }
  // Phase-1 units done per (slot, expert), a slot's counters on lines of their own: a unit's
  // thread counts it there; the one that completes a share counts the share for its expert
  // (one update of the expert's line per slot instead of one per unit).
  const int64_t lines = (nact + 15) / 16;
  CounterLine* share = share_.get(sp1.slots * lines);
  for (int64_t i = 0; i < sp1.slots * lines; ++i)
    for (auto& c : share[i].v) c.store(0, std::memory_order_relaxed);
  for (int64_t b = 0; b < nunits; ++b) unit_done[b].v.store(0, std::memory_order_relaxed);
  // What the thread of slot `slot` reads after rows [.., r1) of expert ei (bank w, split sp):
  // the rest of its share, then its share of the next expert; after the last expert's gate/up
  // share, its first down share (its own range in run_phases when slots == threads).
  auto read_next = [&](const SlotSplit& sp, const Bank& w, int64_t slot, int64_t ei, int64_t r1) {
    ReadNext n{sp.row(slot, sp.units) - r1};
    const SlotSplit* ns = &sp;
    const Bank* nw = &w;
    int64_t ne = ei + 1;
    if (ne == nact) {
      if (&sp == &sp2 || slot >= sp2.slots) return n;
      ns = &sp2;
      nw = &a.w2;
      ne = 0;
    }
    n.w = nw;
    n.e = rt.experts[ne];
    n.r0 = ns->row(slot, 0);
    n.nrows = ns->row(slot, ns->units) - n.r0;
    return n;
  };
  // Before its first item, each thread requests the head of its first share (nothing led a
  // prefetch into it), and the caller prepares the layer input when that is left to the run
  // (small batches: the workers wake, and fetch, while it quantizes); gate/up items wait for it.
  std::atomic<int>& input_ready = input_ready_.v;
  input_ready.store(in ? 0 : 1, std::memory_order_relaxed);
  const PrepFn prep1 = k_->fmt[static_cast<int>(a.w13.fmt)].prep;
  // Profiling: from the run's start to the thread's first item (`start`), and from its last
  // item to the run's end (`end`); lap(field) below adds the time since the last lap.
  const bool prof = profiling_;
  const auto t0 = prof ? Clock::now() : Clock::time_point{};
  const std::function<void(int)> first = [&](int tid) {
    if (tid == 0 && in) {
      for (int64_t t = 0; t < in->T; ++t) prep1(in->x + t * in->K, in->K, in->out + t * in->stride);
      input_ready.store(1, std::memory_order_release);
    }
    if (tid < sp1.slots && nact > 0 && prefetch_l2_bytes() > 0) {
      const int64_t r0 = sp1.row(tid, 0);
      prefetch_head_l2(a.w13, rt.experts[0], r0, sp1.row(tid, sp1.units) - r0, prefetch_l2_bytes());
    }
    if (prof) {
      prof_last_[tid] = Clock::now();
      prof_[tid].start += std::chrono::duration<double>(prof_last_[tid] - t0).count();
    }
  };
  auto body = [&](int64_t item, int tid) {
    LayerProfile* pr = prof ? &prof_[tid] : nullptr;
    Clock::time_point t = prof ? Clock::now() : Clock::time_point{};
    auto lap = [&](double LayerProfile::*field) {
      if (!pr) return;
      const auto t2 = Clock::now();
      pr->*field += std::chrono::duration<double>(t2 - t).count();
      t = t2;
    };
    if (pr) pr->items++;
    int64_t slot, ei, u;
    if (item < sp1.items()) {
      sp1.item(item, slot, ei, u);
      const int64_t r0 = sp1.row(slot, u), r1 = sp1.row(slot, u + 1);
      const int64_t p0 = rt.p0[ei], p1 = rt.p0[ei + 1], e = rt.experts[ei];
      if (r1 > r0) {
        if (!input_ready.load(std::memory_order_acquire)) {
          wait_until_set(input_ready);
          lap(&LayerProfile::wait);
        }
        dot1(a.w13, e, r0, r1 - r0, acts + p0, static_cast<int>(p1 - p0), h + p0 * 2 * I + r0,
             2 * I, read_next(sp1, a.w13, slot, ei, r1));
        lap(&LayerProfile::gate_up);
      }
      std::atomic<int32_t>& units_done = share[slot * lines + ei / 16].v[ei % 16];
      if (units_done.fetch_add(1, std::memory_order_acq_rel) + 1 != sp1.units) return;
      if (sync[ei].shares_done.fetch_add(1, std::memory_order_acq_rel) + 1 != sp1.slots) return;
      const float* s = a.scales + e * 4;
      for (int64_t p = p0; p < p1; ++p) {
        float* g = h + p * 2 * I;
        k_->glu(g, g + I, I, s[0], s[1], static_cast<int>(a.act));
        prep2(g, I, aq + p * as);
      }
      sync[ei].ready.store(1, std::memory_order_release);
      lap(&LayerProfile::glu);
      return;
    }
    sp2.item(item - sp1.items(), slot, ei, u);
    const int64_t r0 = sp2.row(slot, u), r1 = sp2.row(slot, u + 1);
    if (r1 > r0) {
      wait_until_set(sync[ei].ready);
      lap(&LayerProfile::wait);
      const int64_t p0 = rt.p0[ei];
      dot2(a.w2, rt.experts[ei], r0, r1 - r0, acts2 + p0, static_cast<int>(rt.p0[ei + 1] - p0),
           d + p0 * H + r0, H, read_next(sp2, a.w2, slot, ei, r1));
      lap(&LayerProfile::down);
    }
    if (unit_done[slot * sp2.units + u].v.fetch_add(1, std::memory_order_acq_rel) + 1 == nact) {
      for (int64_t c0 = r0; c0 < r1; c0 += kReduceRows)
        reduce_rows(a, rt.pidx, d, c0, std::min(r1, c0 + kReduceRows));
      lap(&LayerProfile::reduce);
    }
  };
  auto item_fn = [&](int64_t item, int tid) {
    body(item, tid);
    if (prof) prof_last_[tid] = Clock::now();
  };
  const int64_t phases[2] = {sp1.items(), sp2.items()};
  pool_.run_phases(phases, 2, item_fn, &first);
  if (prof) {
    const auto t1 = Clock::now();
    prof_span_ += std::chrono::duration<double>(t1 - t0).count();
    prof_calls_++;
    for (int t = 0; t < pool_.size(); ++t)
      prof_[t].end += std::chrono::duration<double>(t1 - prof_last_[t]).count();
  }
}

void Executor::set_profiling(bool on) {
  profiling_ = on;
  prof_.assign(pool_.size(), LayerProfile{});
  prof_last_.assign(pool_.size(), Clock::time_point{});
  prof_span_ = 0;
  prof_calls_ = 0;
}

// Block-scale bytes of rows [r0, r1) of expert e (their start in *p); 0 for formats whose
// scales are inside the rows or too small to matter (FP8's one float per 128 x 128 block).
static int64_t scale_span(const Bank& w, int64_t e, int64_t r0, int64_t r1, const uint8_t** p) {
  const int64_t per_row = w.fmt == Fmt::NVFP4 ? w.K / 16 : w.fmt == Fmt::MXFP4 ? w.K / 32 : 0;
  if (!per_row || !w.scales) return 0;
  *p = w.scales + (e * w.N + r0) * per_row;
  return (r1 - r0) * per_row;
}

// Reads [p, p + n) a cache line at a time with the dots' prefetch distances (prefetch_bytes()
// ahead into L1, prefetch_l2_bytes() into L2: one line each per line read, as a dot streams a
// row), in pieces of kWarmChunk bytes, stopping between pieces once *stop != v. Returns false
// if it stopped.
constexpr int64_t kWarmChunk = 8 << 10;
static bool warm_span(const uint8_t* p, int64_t n, const uint32_t* stop, uint32_t v,
                      uint64_t& sink) {
  const int64_t pf = prefetch_bytes(), far = prefetch_l2_bytes();
  if (far > 0) prefetch_lines_l2(p, static_cast<int>((std::min(n, far) + 63) / 64));
  for (int64_t c = 0; c < n; c += kWarmChunk) {
    if (__atomic_load_n(stop, __ATOMIC_RELAXED) != v) return false;
    const int64_t end = std::min(n, c + kWarmChunk);
    for (int64_t i = c; i < end; i += 64) {
      if (pf > 0 && i + pf < n) prefetch_lines(p + i + pf, 1);
      if (far > 0 && i + far < n) prefetch_lines_l2(p + i + far, 1);
      sink ^= *reinterpret_cast<const volatile uint64_t*>(p + i);
    }
  }
  return true;
}

int64_t Executor::warm(const Bank& w13, const Bank& w2, const int32_t* experts, int64_t n,
                       const uint32_t* stop, uint32_t stop_value) {
  if (n <= 0) return 0;
  const int threads = pool_.size();
  std::vector<int64_t> done(threads, 0);
  pool_.run_per_thread([&](int tid) {
    uint64_t sink = 0;
    int64_t i = 0;
    for (; i < n; ++i) {
      const int64_t e = experts[i];
      if (e < 0 || e >= w13.E) continue;
      bool go_on = true;
      for (const Bank* w : {&w13, &w2}) {
        int64_t a, b;
        slot_rows(w->N, threads, tid, a, b);
        if (a >= b) continue;
        const uint8_t* sp = nullptr;
        const int64_t ns = scale_span(*w, e, a, b, &sp);
        go_on = warm_span(w->row(e, a), (b - a) * w->row_bytes, stop, stop_value, sink) &&
                (ns == 0 || warm_span(sp, ns, stop, stop_value, sink));
        if (!go_on) break;
      }
      if (!go_on) break;
    }
    done[tid] = i;
    g_sink.fetch_xor(sink, std::memory_order_relaxed);
  });
  return *std::min_element(done.begin(), done.end());
}

// Pairs (t, j) sorted by expert (stable): one expert's tokens are contiguous.
void Executor::route(const LayerArgs& a) {
  const int64_t P = a.T * a.k;
  Routing& rt = rt_;
  rt.experts.clear();
  rt.p0.clear();
  rt.pidx.resize(P);
  rt.order.resize(P);
  for (int64_t i = 0; i < P; ++i) rt.order[i] = i;
  std::stable_sort(rt.order.begin(), rt.order.end(),
                   [&](int64_t u, int64_t v) { return a.ids[u] < a.ids[v]; });
  for (int64_t p = 0; p < P; ++p) {
    rt.pidx[rt.order[p]] = p;
    if (p == 0 || a.ids[rt.order[p]] != a.ids[rt.order[p - 1]]) {
      rt.experts.push_back(a.ids[rt.order[p]]);
      rt.p0.push_back(p);
    }
  }
  rt.p0.push_back(P);
}

void Executor::forward(const LayerArgs& a) {
  const int64_t E = a.w13.E, H = a.w13.K, I = a.w13.N / 2, P = a.T * a.k;
  for (int64_t i = 0; i < P; ++i)
    if (a.ids[i] < 0 || a.ids[i] >= E)
      throw std::invalid_argument("expert_ids[" + std::to_string(i / a.k) + ", " +
                                  std::to_string(i % a.k) + "] = " + std::to_string(a.ids[i]) +
                                  " is outside [0, " + std::to_string(E) + ")");
  route(a);
  const Routing& rt = rt_;

  // 1. the layer input, once per token, in the w13 format's activation layout: on the pool
  //    first when large; at small batches (T * H <= 8192) the caller does it inside the
  //    layer's pool run (see layer())
  const int64_t xs = act_stride(*k_, a.w13.fmt, H);
  uint8_t* xq = xq_.get(a.T * xs);
  const InputPrep in{a.x, a.T, H, xq, xs};
  const bool inline_prep = a.T * H <= 8192;
  if (!inline_prep) prep_tokens(a.w13, a.x, a.T, H, xq, xs);
  auto** ptr = reinterpret_cast<const uint8_t**>(ptrs_.get(P * sizeof(void*)));
  for (int64_t p = 0; p < P; ++p) ptr[p] = xq + (rt.order[p] / a.k) * xs;

  // 2. gate/up -> GLU -> the down input aq[p] ([P, 2I] h), then down d[p] ([P, H]) and
  //    y[t] = sum_j route[t, j] * d[p(t, j)] * s_down, in one pool run
  float* h = reinterpret_cast<float*>(h_.get(P * 2 * I * 4));
  const int64_t as = act_stride(*k_, a.w2.fmt, I);
  uint8_t* aq = aq_.get(P * as);
  auto** ptr2 = reinterpret_cast<const uint8_t**>(ptrs2_.get(P * sizeof(void*)));
  for (int64_t p = 0; p < P; ++p) ptr2[p] = aq + p * as;
  float* d = reinterpret_cast<float*>(d_.get(P * H * 4));
  layer(a, rt, ptr, h, aq, as, ptr2, d, inline_prep ? &in : nullptr);
}

// ============================================================================
// test and benchmark hooks
// ============================================================================
std::vector<uint8_t> Executor::prep(Fmt fmt, const float* x, int64_t K) const {
  const FormatKernels& f = k_->fmt[static_cast<int>(fmt)];
  std::vector<uint8_t> out(f.act_bytes(K) + 64);
  // The 64-byte aligned copy is not needed by prep; keep the plain vector.
  f.prep(x, K, out.data());
  out.resize(f.act_bytes(K));
  return out;
}

void Executor::dot(const Bank& w, int64_t e, const float* x, int64_t T, float* out,
                   int threads) {
  const int64_t xs = act_stride(*k_, w.fmt, w.K);
  uint8_t* xq = xq_.get(T * xs);
  prep_tokens(w, x, T, w.K, xq, xs);
  auto** ptr = reinterpret_cast<const uint8_t**>(ptrs_.get(T * sizeof(void*)));
  for (int64_t t = 0; t < T; ++t) ptr[t] = xq + t * xs;
  const DotFn dot = k_->fmt[static_cast<int>(w.fmt)].dot;
  // kUnitsPerThread runs of rows (and of their scales) per thread, rows
  // [N * i / n, N * (i + 1) / n) rounded to 4 rows (a row's result does not depend on it),
  // in contiguous ranges per thread (ThreadPool::run_phases).
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, pool_.size()));
  const int64_t n = nt == 1 ? 1 : nt * kUnitsPerThread;
  auto run = [&](int64_t i, int) {
    const int64_t r0 = w.N * i / n / 4 * 4, r1 = i + 1 == n ? w.N : w.N * (i + 1) / n / 4 * 4;
    if (r1 > r0) dot(w, e, r0, r1 - r0, ptr, static_cast<int>(T), out + r0, w.N, ReadNext{w.N - r1});
  };
  if (n == 1) {
    run(0, 0);
  } else {
    pool_.run_phases(&n, 1, run);
  }
}

// Work items of about kDequantBytes of fp32 output each (one row at least), in contiguous
// ranges per thread (run_phases) so each thread streams one run of rows.
constexpr int64_t kDequantBytes = 64 << 10;

void Executor::dequant(const Bank& w, int64_t e, int64_t r0, int64_t r1, float* out) {
  const DequantFn f = k_->fmt[static_cast<int>(w.fmt)].dequant;
  if (!f) throw std::invalid_argument(std::string("no row decoder for this format in tier ") + k_->name);
  const int64_t per = std::max<int64_t>(1, kDequantBytes / (4 * w.K));
  const int64_t n = (r1 - r0 + per - 1) / per;
  auto run = [&](int64_t i, int) {
    for (int64_t r = r0 + i * per; r < std::min(r1, r0 + (i + 1) * per); ++r)
      f(w, e, r, out + (r - r0) * w.K);
  };
  if (n <= 1 || pool_.size() == 1) {
    for (int64_t i = 0; i < n; ++i) run(i, 0);
  } else {
    pool_.run_phases(&n, 1, run);
  }
}

double Executor::time_forward(LayerArgs a, const int32_t* ids, const float* route,
                              int64_t iters) {
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    a.ids = ids + i * a.T * a.k;
    a.route = route + i * a.T * a.k;
    forward(a);
  }
  return seconds_since(t0);
}

double Executor::time_dot(const Bank& w, int64_t e, const float* x, int64_t iters,
                          int threads) {
  std::vector<float> out(w.N);
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) dot(w, e, x, 1, out.data(), threads);
  return seconds_since(t0);
}

std::pair<double, int64_t> Executor::time_stream(const uint8_t* p, int64_t n, int64_t iters,
                                                 int threads, int64_t dist, int64_t far) {
  threads = std::max(1, std::min(threads, pool_.size()));
  // On the whole pool, kUnitsPerThread slices per thread in contiguous ranges, as the dots
  // and layers split their rows; on fewer threads, one slice each.
  const int64_t items = threads == pool_.size() && threads > 1 ? threads * kUnitsPerThread : threads;
  const int64_t slice = n / items / 256 * 256;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    if (items > threads) {
      pool_.run_phases(&items, 1, [&](int64_t it, int) {
        g_sink.fetch_xor(k_->stream_read(p + it * slice, slice, dist, far));
      });
    } else {
      pool_.run_per_thread([&](int tid) {
        if (tid < threads) g_sink.fetch_xor(k_->stream_read(p + tid * slice, slice, dist, far));
      });
    }
  }
  return {seconds_since(t0), iters * items * slice};
}

}  // namespace ft
