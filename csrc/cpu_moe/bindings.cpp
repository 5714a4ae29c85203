// Python bindings (nanobind): raw pointers (ints) and shapes in, the GIL released around
// every call that computes. freetoken/moe/cpu_executor.py checks arguments before calling.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cpu_features.h"
#include "executor.h"
#include "handoff.h"

namespace nb = nanobind;
using ft::Bank;
using ft::Executor;

namespace ft {
void nvfp4_q8_prep_reference(const float* x, int64_t K, uint8_t* out, int lanes);
}

template <typename T>
static T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

static nb::bytes as_bytes(const std::vector<uint8_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

NB_MODULE(_cpu_moe, m) {
  m.doc() = "FreeToken CPU MoE executor (C++ SIMD expert kernels)";
  nb::class_<Bank>(m, "Bank")
      .def("__init__",
           [](Bank* b, int fmt, int64_t E, int64_t N, int64_t K, uintptr_t data,
              int64_t row_bytes, uintptr_t scales) {
             new (b) Bank{static_cast<ft::Fmt>(fmt), E, N, K, ptr<const uint8_t>(data),
                          row_bytes, ptr<const uint8_t>(scales)};
           })
      .def_prop_ro("expert_bytes", &Bank::expert_bytes);

  nb::class_<Executor>(m, "Executor")
      .def(nb::init<int, const std::string&, bool, bool>(), nb::arg("num_threads"),
           nb::arg("isa"), nb::arg("no_vnni"), nb::arg("no_avx512vnni"))
      .def_prop_ro("isa", [](const Executor& e) { return std::string(e.isa()); })
      .def_prop_ro("num_threads", &Executor::num_threads)
      .def(
          "forward",
          [](Executor& ex, uintptr_t x, int64_t T, int64_t k, uintptr_t ids, uintptr_t route,
             const Bank& w13, const Bank& w2, uintptr_t scales, int act, uintptr_t out,
             bool out_bf16) {
            ft::LayerArgs a{ptr<const float>(x), T, k, ptr<const int32_t>(ids),
                            ptr<const float>(route), w13, w2, ptr<const float>(scales),
                            static_cast<ft::Act>(act), ptr<void>(out), out_bf16};
            ex.forward(a);
          },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "time_forward",
          [](Executor& ex, uintptr_t x, int64_t T, int64_t k, uintptr_t ids, uintptr_t route,
             const Bank& w13, const Bank& w2, uintptr_t scales, int act, uintptr_t out,
             int64_t iters) {
            ft::LayerArgs a{ptr<const float>(x), T, k, nullptr, nullptr, w13, w2,
                            ptr<const float>(scales), static_cast<ft::Act>(act), ptr<void>(out),
                            false};
            return ex.time_forward(a, ptr<const int32_t>(ids), ptr<const float>(route), iters);
          },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "dot",
          [](Executor& ex, const Bank& w, int64_t e, uintptr_t x, int64_t T, uintptr_t out,
             int threads) { ex.dot(w, e, ptr<const float>(x), T, ptr<float>(out), threads); },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "dequant",
          [](Executor& ex, const Bank& w, int64_t e, int64_t r0, int64_t r1, uintptr_t out) {
            ex.dequant(w, e, r0, r1, ptr<float>(out));
          },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "time_dot",
          [](Executor& ex, const Bank& w, int64_t e, uintptr_t x, int64_t iters, int threads) {
            return ex.time_dot(w, e, ptr<const float>(x), iters, threads);
          },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "time_stream",
          [](Executor& ex, uintptr_t p, int64_t n, int64_t iters, int threads, int64_t dist,
             int64_t far) {
            return ex.time_stream(ptr<const uint8_t>(p), n, iters, threads, dist, far);
          },
          nb::arg("p"), nb::arg("n"), nb::arg("iters"), nb::arg("threads"), nb::arg("dist"),
          nb::arg("far") = 0, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "glu",
          [](const Executor& ex, uintptr_t g, uintptr_t u, int64_t n, float sg, float su,
             int act) { ex.glu(ptr<float>(g), ptr<const float>(u), n, sg, su, act); },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "rms_norm",
          [](Executor& ex, uintptr_t x, uintptr_t res, uintptr_t w, int64_t rows, int64_t n,
             float eps, uintptr_t y, uintptr_t sum) {
            ex.rms_norm(ptr<const float>(x), ptr<const float>(res), ptr<const float>(w), rows,
                        n, eps, ptr<float>(y), ptr<float>(sum));
          },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "decode_attention",
          [](Executor& ex, int64_t B, int64_t hq, int64_t hkv, int64_t d, uintptr_t qkv,
             uintptr_t cos, uintptr_t sin, uintptr_t q_norm, uintptr_t k_norm, float eps,
             uintptr_t cache, int64_t num_slots, int64_t page_size, uintptr_t slots,
             uintptr_t page_table, int64_t pt_width, uintptr_t seq_lens, float scale,
             float softcap, int64_t window, uintptr_t out, int64_t attend_only_row) {
            ft::DecodeAttnArgs a;
            a.B = B, a.hq = hq, a.hkv = hkv, a.d = d, a.qkv = ptr<float>(qkv);
            a.cos = ptr<const float>(cos), a.sin = ptr<const float>(sin);
            a.q_norm = ptr<const float>(q_norm), a.k_norm = ptr<const float>(k_norm);
            a.eps = eps, a.cache = ptr<float>(cache), a.num_slots = num_slots;
            a.page_size = page_size, a.slots = ptr<const int64_t>(slots);
            a.page_table = ptr<const int32_t>(page_table), a.pt_width = pt_width;
            a.seq_lens = ptr<const int32_t>(seq_lens), a.scale = scale, a.softcap = softcap;
            a.window = window, a.out = ptr<float>(out);
            if (attend_only_row > 0)
              ex.decode_attend(a, attend_only_row);
            else
              ex.decode_attention(a);
          },
          nb::arg("B"), nb::arg("hq"), nb::arg("hkv"), nb::arg("d"), nb::arg("qkv"),
          nb::arg("cos"), nb::arg("sin"), nb::arg("q_norm"), nb::arg("k_norm"), nb::arg("eps"),
          nb::arg("cache"), nb::arg("num_slots"), nb::arg("page_size"), nb::arg("slots"),
          nb::arg("page_table"), nb::arg("pt_width"), nb::arg("seq_lens"), nb::arg("scale"),
          nb::arg("softcap"), nb::arg("window"), nb::arg("out"),
          nb::arg("attend_only_row") = 0,
          nb::call_guard<nb::gil_scoped_release>())
      .def("set_profiling", &Executor::set_profiling)
      .def("layer_profile",
           [](const Executor& ex) {
             nb::list threads;
             for (const ft::LayerProfile& p : ex.layer_profile()) {
               nb::dict d;
               d["start"] = p.start, d["gate_up"] = p.gate_up, d["glu"] = p.glu;
               d["wait"] = p.wait, d["down"] = p.down, d["reduce"] = p.reduce, d["end"] = p.end;
               d["items"] = p.items;
               threads.append(d);
             }
             nb::dict out;
             out["threads"] = threads, out["span"] = ex.profile_span();
             out["calls"] = ex.profile_calls();
             return out;
           })
      .def("prep", [](const Executor& ex, int fmt, uintptr_t x, int64_t K) {
        return as_bytes(ex.prep(static_cast<ft::Fmt>(fmt), ptr<const float>(x), K));
      });

  nb::class_<ft::HandoffWorker>(m, "HandoffWorker")
      .def(
          "__init__",
          [](ft::HandoffWorker* w, Executor& ex, uintptr_t buf, const nb::dict& offsets,
             int64_t spin_us) {
            ft::HandoffLayout l;
            auto get = [&](const char* key) { return nb::cast<int64_t>(offsets[key]); };
            l.go = get("go"), l.done = get("done"), l.live = get("live");
            l.error = get("error"), l.job = get("job"), l.ids = get("ids");
            l.weights = get("weights"), l.map = get("map"), l.x = get("x"), l.out = get("out");
            l.max_tokens = get("max_tokens"), l.top_k = get("top_k");
            l.num_experts = get("num_experts"), l.hidden = get("hidden");
            if (offsets.contains("hint")) l.hint = get("hint"), l.hint_max = get("hint_max");
            if (offsets.contains("ahead"))
              l.ahead = get("ahead"), l.ahead_max = get("ahead_max"),
              l.ahead_done = get("ahead_done");
            new (w) ft::HandoffWorker(&ex, ptr<uint8_t>(buf), l, spin_us);
          },
          nb::keep_alive<1, 2>())
      .def(
          "set_layer",
          [](ft::HandoffWorker& w, int64_t layer, const Bank& w13, const Bank& w2,
             uintptr_t scales) { w.set_layer(layer, w13, w2, ptr<const float>(scales)); })
      .def("post", &ft::HandoffWorker::post)
      .def("wait", &ft::HandoffWorker::wait, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("last_error", &ft::HandoffWorker::last_error)
      .def_prop_ro("jobs", &ft::HandoffWorker::jobs)
      .def("set_trace", &ft::HandoffWorker::set_trace)
      .def("trace", &ft::HandoffWorker::trace)
      .def("set_prefetch", &ft::HandoffWorker::set_prefetch)
      .def("prefetch_stats", &ft::HandoffWorker::prefetch_stats)
      .def("set_copier", &ft::HandoffWorker::set_copier)
      .def("set_ahead_delay", &ft::HandoffWorker::set_ahead_delay)
      .def("set_copy_layer", &ft::HandoffWorker::set_copy_layer)
      .def("wait_ahead", &ft::HandoffWorker::wait_ahead, nb::call_guard<nb::gil_scoped_release>())
      .def("ahead_stats", &ft::HandoffWorker::ahead_stats);

  m.def("supported_tiers", &ft::supported_tiers);
  m.def("core_clock_ghz", &ft::core_clock_ghz, nb::arg("seconds") = 0.05,
        nb::call_guard<nb::gil_scoped_release>());
  m.def("nvfp4_q8_prep_reference", [](uintptr_t x, int64_t K, int lanes) {
    if (lanes != 16 && lanes != 8) throw std::invalid_argument("lanes must be 16 or 8");
    std::vector<uint8_t> v((lanes == 16 ? ft::kQ8x16 : ft::kQ8x8).bytes(K));
    ft::nvfp4_q8_prep_reference(ptr<const float>(x), K, v.data(), lanes);
    return as_bytes(v);
  });
  nb::dict fmts;
  static_assert(ft::kNumFmt == 15, "a name per ft::Fmt");
  const char* names[] = {"f32", "f16", "bf16", "nvfp4", "fp8_block", "mxfp4",
                         "Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "Q5_K",
                         "MXFP4"};  // "MXFP4": GGUF's blocks; "mxfp4": the HF layout
  for (int i = 0; i < ft::kNumFmt; ++i) fmts[names[i]] = i;
  m.attr("FORMATS") = fmts;
}
