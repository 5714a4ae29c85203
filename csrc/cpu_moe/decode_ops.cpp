// The small fp32 operations of a CPU decode step, one call each where torch takes a dozen
// dispatches: RMSNorm (with the residual add), and a decode attention block (per-head
// q/k RMSNorm, rotary, the KV store, and attention over the paged cache). A 30-layer model
// spends more time in those dispatches than in its weights at one token (SmolLM2-135M).
// Compiled for the baseline ISA (the compiler vectorizes the loops); the math is the torch
// reference's, in fp32, summed in a fixed order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "executor.h"

namespace ft {

namespace {

// x * rsqrt(mean(x^2) + eps) * w over n values (fp32, as torch's rms_norm).
void rms_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// One head of d values in place: optional RMSNorm (weight w), then rotary (rotate_half:
// out[i] = x[i] cos[i] - x[i + h] sin[i], out[i + h] = x[i + h] cos[i + h] + x[i] sin[i + h]).
void norm_rope(float* x, int64_t d, const float* w, float eps, const float* cos,
               const float* sin) {
  if (w) rms_row(x, w, d, eps, x);
  const int64_t h = d / 2;
  float tmp[1024];
  for (int64_t i = 0; i < h; ++i) {
    tmp[i] = x[i] * cos[i] + (-x[i + h]) * sin[i];
    tmp[i + h] = x[i + h] * cos[i + h] + x[i] * sin[i + h];
  }
  std::copy(tmp, tmp + d, x);
}

}  // namespace

void Executor::rms_norm(const float* x, const float* res, const float* w, int64_t rows,
                        int64_t n, float eps, float* y, float* sum) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    if (res) {
      float* s = sum + r * n;
      for (int64_t i = 0; i < n; ++i) s[i] = xr[i] + res[r * n + i];
      xr = s;
    }
    rms_row(xr, w, n, eps, y + r * n);
  }
}

void Executor::decode_attention(const DecodeAttnArgs& a) {
  const int64_t B = a.B, hq = a.hq, hkv = a.hkv, d = a.d;
  if (d > 1024 || d % 2 || hq % hkv) throw std::invalid_argument("decode_attention: bad heads");
  const int64_t row = (hq + 2 * hkv) * d;  // one token's qkv values
  const int64_t kv_half = a.num_slots * hkv * d;  // K then V in the cache
  // 1. q, k normed and rotated in place in qkv; k and v stored at the tokens' slots
  for (int64_t b = 0; b < B; ++b) {
    float* q = a.qkv + b * row;
    const float* cs = a.cos + b * d;
    const float* sn = a.sin + b * d;
    for (int64_t h = 0; h < hq + hkv; ++h)
      norm_rope(q + h * d, d, h < hq ? a.q_norm : a.k_norm, a.eps, cs, sn);
    const int64_t slot = a.slots[b];
    if (slot < 0) continue;
    std::copy(q + hq * d, q + (hq + hkv) * d, a.cache + slot * hkv * d);
    std::copy(q + (hq + hkv) * d, q + row, a.cache + kv_half + slot * hkv * d);
  }
  decode_attend(a, row);
}

// Step 2 of decode_attention alone: each sequence's query (a.qkv row b, its first hq heads,
// `row` values apart) against its cached positions. Also used for the one-token sequences of a
// step that mixes them with prefill chunks, so that a generated token's attention is the same
// computation whatever else its step holds.
void Executor::decode_attend(const DecodeAttnArgs& a, int64_t row) {
  const int64_t B = a.B, hq = a.hq, hkv = a.hkv, d = a.d;
  const int64_t kv_half = a.num_slots * hkv * d;
  const int64_t rep = hq / hkv;
  auto head = [&](int64_t item) {
    const int64_t b = item / hq, h = item % hq, g = h / rep;
    const int64_t len = a.seq_lens[b];
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
    const float* q = a.qkv + b * row + h * d;
    const int32_t* pages = a.page_table + b * a.pt_width;
    std::vector<float> s(static_cast<size_t>(len - lo));
    float m = -INFINITY;
    for (int64_t j = lo; j < len; ++j) {
      const int64_t slot = static_cast<int64_t>(pages[j / a.page_size]) * a.page_size + j % a.page_size;
      const float* k = a.cache + (slot * hkv + g) * d;
      float dot = 0.0f;
      for (int64_t i = 0; i < d; ++i) dot += q[i] * k[i];
      float v = dot * a.scale;
      if (a.softcap > 0) v = std::tanh(v / a.softcap) * a.softcap;
      s[j - lo] = v;
      m = std::max(m, v);
    }
    float* o = a.out + (b * hq + h) * d;
    std::fill(o, o + d, 0.0f);
    float total = 0.0f;
    for (int64_t j = lo; j < len; ++j) {
      const float e = std::exp(s[j - lo] - m);
      total += e;
      const int64_t slot = static_cast<int64_t>(pages[j / a.page_size]) * a.page_size + j % a.page_size;
      const float* v = a.cache + kv_half + (slot * hkv + g) * d;
      for (int64_t i = 0; i < d; ++i) o[i] += e * v[i];
    }
    const float inv = 1.0f / total;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  };
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += a.seq_lens[b];
  if (work * hq * d < (1 << 18) || pool_.size() == 1) {  // small: no pool wake-up
    for (int64_t i = 0; i < B * hq; ++i) head(i);
  } else {
    pool_.run(B * hq, head);
  }
}

}  // namespace ft
