// Shared shapes of the CPU MoE executor: weight banks, activation layouts, the per-tier
// kernel table and small scalar helpers (E4M3 / BF16 / FP16 decoding).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ft {

// ============================================================================
// Formats
// ============================================================================

// Weight format of one bank. GGUF types are split into their own entries so that the
// kernel table can be indexed directly. MXFP4 is the HF layout (codes and E8M0 scales in two
// tensors); GGUF_MXFP4 is ggml's (17-byte blocks: E8M0 byte, then 16 bytes of codes).
enum class Fmt : int {
  F32 = 0, F16, BF16, NVFP4, FP8_BLOCK, MXFP4, Q4_0, Q8_0, Q4_K, Q6_K,
  Q4_1, Q5_0, Q5_1, Q5_K, GGUF_MXFP4, COUNT
};
constexpr int kNumFmt = static_cast<int>(Fmt::COUNT);

// One expert bank [E, N, K] as raw pointers. `data` rows are `row_bytes` apart, experts
// `N * row_bytes` apart. `scales` (nvfp4: E4M3 [E, N, K/16]; mxfp4: E8M0 [E, N, K/32];
// fp8_block: fp32 [E, ceil(N/128), ceil(K/128)]) is null for the other formats.
struct Bank {
  Fmt fmt = Fmt::F32;
  int64_t E = 0, N = 0, K = 0;
  const uint8_t* data = nullptr;
  int64_t row_bytes = 0;
  const uint8_t* scales = nullptr;

  const uint8_t* row(int64_t e, int64_t r) const { return data + (e * N + r) * row_bytes; }
  // Total bytes of one expert (weights + block scales): what a dot streams from memory.
  int64_t expert_bytes() const;
};

// ============================================================================
// Kernel table (one per ISA tier)
// ============================================================================

// What the calling thread reads after a dot's rows: the next `rows` rows of the same expert,
// then (when `w` is set) rows [r0, r0 + nrows) of expert e of bank *w, another run of rows
// (a layer thread's share of the next expert). A dot's prefetch may run into these, and
// nothing beyond (other threads' rows: bandwidth spent for nothing). Without the second run a
// thread's prefetch stops at each share's end and the next share starts cold: its first lines
// come one demand miss at a time while the prefetch distance builds up again.
struct ReadNext {
  int64_t rows = 0;
  const Bank* w = nullptr;
  int64_t e = 0, r0 = 0, nrows = 0;
};

// out[t * out_stride + i] = dot(row r0 + i of expert e, activation t) for i < nrows, t < ntok.
// `acts[t]` points at token t's prepared activation (layout chosen by the tier's `prep`).
// `next`: what the caller reads after these rows (see ReadNext); only prefetches use it.
// NOTE: each row's result must not depend on r0, nrows or ntok (thread-count invariance).
using DotFn = void (*)(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                       const uint8_t* const* acts, int ntok, float* out, int64_t out_stride,
                       const ReadNext& next);
using ActBytesFn = int64_t (*)(int64_t K);
using PrepFn = void (*)(const float* x, int64_t K, uint8_t* out);
// Row r of expert e -> fp32 out[K], bit for bit gguf-py's dequantize (the same fp32 products and
// sums in the same order; see dequant_rows.h).
using DequantFn = void (*)(const Bank& w, int64_t e, int64_t r, float* out);

struct FormatKernels {
  ActBytesFn act_bytes = nullptr;  // bytes of one token's prepared activation
  PrepFn prep = nullptr;           // fp32 [K] -> prepared activation
  DotFn dot = nullptr;
  DequantFn dequant = nullptr;
};

struct Kernels {
  const char* name = "scalar";
  FormatKernels fmt[kNumFmt];
  // Streaming read of n bytes (n % 256 == 0) with the widest loads the tier has, returning a
  // checksum; software prefetch `dist` bytes ahead into L1 and `far` bytes ahead into L2
  // (0 = none), as the dots do.
  uint64_t (*stream_read)(const uint8_t* p, int64_t n, int64_t dist, int64_t far) = nullptr;
  // The GLU in place: g[i] = act(g[i] * s_gate) * (u[i] * s_up), i < n; act 0 = silu,
  // 1 = gelu_tanh. The SIMD tiers use a polynomial exp (Cephes expf, ~1 ulp), the scalar one
  // std::exp / std::tanh.
  void (*glu)(float* g, const float* u, int64_t n, float s_gate, float s_up, int act) = nullptr;
};

// Software prefetch of the NVFP4 W4A8 dots: bytes of weight codes ahead of the read cursor
// (FREETOKEN_CPU_MOE_PREFETCH, read once per process; 0 = off). A dot of R adjacent rows reads
// them as R interleaved sub-streams, one 4 KiB page at a time (K = 2048, R = 4), which the L2
// streamer (page-local) picks up late; prefetching the linear cursor (R rows x bytes done so
// far) keeps the next page in flight. Scales are prefetched at 1/8 of the distance (their
// stream is 1/8 as fast at 16 k per byte vs 2 k per byte).
int64_t prefetch_bytes();
// The same dots' second prefetch: bytes of weight codes ahead of the cursor that go to L2
// only (prefetcht1), FREETOKEN_CPU_MOE_PREFETCH_L2 (default 16384, 0 = off). The L1 prefetch
// alone left one thread's DRAM dot at 85% of its streaming read (the L1 fill buffers it holds
// are few); a far L2 prefetch keeps more lines in flight: 13.8 -> 15.9 GB/s on one thread.
int64_t prefetch_l2_bytes();

// Prefetch n cache lines from p into all levels (a no-op for unmapped addresses). An asm
// statement, not __builtin_prefetch: GCC 12 deleted every __builtin_prefetch of the dots once
// this loop was inlined through the always_inline prefetch_rows_step below (a loop of nothing
// but prefetches counts as side-effect free), which cost the DRAM dot a third of its speed
// while its L2 speed, and every test, stayed the same. A volatile asm is never dropped.
[[gnu::always_inline]] inline void prefetch_lines(const uint8_t* p, int n) {
  for (int l = 0; l < n; ++l) asm volatile("prefetcht0 %0" : : "m"(*(p + 64 * l)));
}
// The same into L2 (and L3) only.
[[gnu::always_inline]] inline void prefetch_lines_l2(const uint8_t* p, int n) {
  for (int l = 0; l < n; ++l) asm volatile("prefetcht1 %0" : : "m"(*(p + 64 * l)));
}

// Where an NVFP4 dot's prefetch runs: `pf` / `far` bytes of codes ahead of the read cursor
// into L1 / L2 (0 = off), the scales (one byte per 8 code bytes) at an eighth of both. A target
// past `code_end` (the end of the rows the caller reads next in this expert) continues into
// the next run's codes (`next_codes`, `next_bytes` long, its scales at `next_scales`), and
// nothing is prefetched past that.
struct Prefetch {
  int64_t pf, far;
  const uint8_t* code_end;
  const uint8_t* next_codes = nullptr;
  const uint8_t* next_scales = nullptr;
  int64_t next_bytes = 0;
};

// An NVFP4 dot's Prefetch for rows [r0, r0 + nrows) of expert e, then `next`.
inline Prefetch nvfp4_prefetch(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                               const ReadNext& next) {
  const int64_t end = e * w.N + std::min(w.N, r0 + nrows + next.rows);
  Prefetch p{prefetch_bytes(), prefetch_l2_bytes(), w.data + end * w.row_bytes};
  if (next.w && next.nrows > 0 && next.w->fmt == Fmt::NVFP4) {
    const Bank& n = *next.w;
    p.next_codes = n.row(next.e, next.r0);
    p.next_scales = n.scales + (next.e * n.N + next.r0) * (n.K / 16);
    p.next_bytes = next.nrows * n.row_bytes;
  }
  return p;
}

// Prefetch `nc` code lines at `c + dist` and `ns` scale lines at `s + dist / 8` (the codes'
// scales), or their place in the next run once `c + dist` passes the end; `L2`: prefetcht1.
template <bool L2>
[[gnu::always_inline]] inline void prefetch_target(const uint8_t* c, const uint8_t* s, int64_t dist,
                                                   int nc, int ns, const Prefetch& p) {
  const uint8_t* t = c + dist;
  const uint8_t* ts = s + dist / 8;
  if (t >= p.code_end) {
    const int64_t off = t - p.code_end;
    if (off >= p.next_bytes) return;
    t = p.next_codes + off;
    ts = p.next_scales + off / 8;
  }
  if constexpr (L2) {
    prefetch_lines_l2(t, nc);
    prefetch_lines_l2(ts, ns);
  } else {
    prefetch_lines(t, nc);
    prefetch_lines(ts, ns);
  }
}

// The first `bytes` (at most) of rows [r0, r0 + nrows) of expert e into L2, with their NVFP4
// scales: the start of a run of rows no earlier prefetch led into (a thread's first share of a
// layer), requested at once instead of a demand miss at a time.
inline void prefetch_head_l2(const Bank& w, int64_t e, int64_t r0, int64_t nrows, int64_t bytes) {
  const int64_t n = std::min(bytes, nrows * w.row_bytes);
  if (n <= 0) return;
  prefetch_lines_l2(w.row(e, r0), static_cast<int>((n + 63) / 64));
  if (w.fmt == Fmt::NVFP4)
    prefetch_lines_l2(w.scales + (e * w.N + r0) * (w.K / 16), static_cast<int>((n / 8 + 63) / 64));
}

// The prefetch for R adjacent rows read a step at a time: `done` code bytes of each row read
// so far, `step` bytes of each row in this step. The R rows are one contiguous stretch, so the
// cursor is linear (R x done). Forced inline: as a call it cost the 256-bit dot 4% (1 core,
// L2), its counts no longer folded to constants.
[[gnu::always_inline]] inline void prefetch_rows_step(const uint8_t* wrow, const uint8_t* wsc,
                                                      int64_t done, int64_t step, int R,
                                                      const Prefetch& p) {
  const int nc = static_cast<int>((step * R + 63) / 64), ns = static_cast<int>((step / 8 * R + 63) / 64);
  const uint8_t *c = wrow + done * R, *s = wsc + done / 8 * R;
  if (p.pf) prefetch_target<false>(c, s, p.pf, nc, ns, p);
  if (p.far) prefetch_target<true>(c, s, p.far, nc, ns, p);
}

// The row prefetch of the GGUF dots: before row r, row r + pf into L1 and row r + far into
// L2 (`pf` / `far` rows from FREETOKEN_CPU_MOE_PREFETCH / _PREFETCH_L2 bytes, 0 = off), into
// the rows read next (`next`, by bytes: its rows may be longer) and not past them.
class RowAhead {
 public:
  RowAhead(const Bank& w, int64_t e, int64_t r0, int64_t nrows, const ReadNext& next)
      : w_(w), next_(next), e_(e), rb_(w.row_bytes),
        pf_(prefetch_bytes() ? std::max<int64_t>(1, prefetch_bytes() / rb_) : 0),
        far_(prefetch_l2_bytes() ? std::max<int64_t>(pf_ + 1, prefetch_l2_bytes() / rb_) : 0),
        end_(std::min(w.N, r0 + nrows + next.rows)), lines_(static_cast<int>((rb_ + 63) / 64)) {}
  [[gnu::always_inline]] void operator()(int64_t r) const {
    if (const uint8_t* p = l1_target(r)) prefetch_lines(p, lines_);
    if (const uint8_t* p = l2_target(r)) prefetch_lines_l2(p, lines_);
  }
  // What operator()(r) prefetches, for a kernel that spreads it over the row: the L1 and
  // the L2 target (null: none) and the lines of each.
  const uint8_t* l1_target(int64_t r) const { return pf_ ? at(r + pf_) : nullptr; }
  const uint8_t* l2_target(int64_t r) const { return far_ ? at(r + far_) : nullptr; }
  int lines() const { return lines_; }

 private:
  [[gnu::always_inline]] const uint8_t* at(int64_t r) const {
    if (r < end_) return w_.row(e_, r);
    if (!next_.w) return nullptr;
    const int64_t off = (r - end_) * rb_;
    if (off >= next_.nrows * next_.w->row_bytes) return nullptr;
    return next_.w->row(next_.e, next_.r0) + off;
  }
  const Bank& w_;
  const ReadNext& next_;
  int64_t e_, rb_, pf_, far_, end_;
  int lines_;
};

// RowAhead's prefetch of R rows, spread over a kernel's `steps` steps through them (the rows'
// super-blocks): step i requests lines [i L / steps, (i + 1) L / steps) of each target. Issued
// all at once before the rows, the 2 x 18 lines a row (Q4_K, K = 2048) filled the L1 miss
// buffers in bursts and cost the 4-row Q4_K dot 18% of its speed in L2. A kernel walks the
// steps with a Steps cursor, which finds each step's lines by adding (L = q steps + rm: q
// lines a step, one more whenever the remainders pass a step; the same lines) instead of two
// 64-bit divisions a step (idiv, about 10 cycles each next to a 4-row Q4_K step of ~80).
template <int R>
struct SpreadPrefetch {
  const uint8_t* l1[R];
  const uint8_t* l2[R];
  int lines;
  SpreadPrefetch(const RowAhead& a, int64_t r) : lines(a.lines()) {
    for (int i = 0; i < R; ++i) l1[i] = a.l1_target(r + i), l2[i] = a.l2_target(r + i);
  }
  class Steps {
   public:
    Steps(const SpreadPrefetch& p, int64_t steps)
        : p_(p), steps_(static_cast<int>(steps)), q_(steps_ ? p.lines / steps_ : 0),
          rm_(steps_ ? p.lines % steps_ : 0) {}
    // The next step's lines [a, a + n) of each target.
    [[gnu::always_inline]] void step() {
      int n = q_;
      if ((frac_ += rm_) >= steps_) frac_ -= steps_, ++n;
      for (int j = 0; j < R; ++j) {
        if (p_.l1[j]) prefetch_lines(p_.l1[j] + 64 * a_, n);
        if (p_.l2[j]) prefetch_lines_l2(p_.l2[j] + 64 * a_, n);
      }
      a_ += n;
    }

   private:
    const SpreadPrefetch& p_;
    int steps_, q_, rm_, a_ = 0, frac_ = 0;
  };
  Steps steps(int64_t n) const { return Steps(*this, n); }
};

// A DotFn from a one-row kernel: each row against the tokens in groups of at most 4 (a row is
// read once per group; later groups find it in L1). Row::run<NT>(w, e, r, acts, res, os) writes
// res[t * os] for t < NT. With R > 1, a single token takes R rows at a time through
// Row::rows1<R>(w, e, r, act, res, pf) (res[i] for row r + i; its arithmetic per row the same
// as run<1>'s, so a row's bits do not depend on how rows are grouped; pf: the rows' prefetch,
// spread over its steps), the rest one at a time.
// Each row is prefetched as RowAhead says (block scales inside the rows, as in the GGUF
// formats, come along).
template <class Row, int R = 1>
void dot_rows_by_token_groups(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                              const uint8_t* const* acts, int ntok, float* out, int64_t os,
                              const ReadNext& next) {
  const RowAhead ahead(w, e, r0, nrows, next);
  int64_t r = r0;
  if constexpr (R > 1) {
    if (ntok == 1)
      for (; r + R <= r0 + nrows; r += R)
        Row::template rows1<R>(w, e, r, acts[0], out + (r - r0), SpreadPrefetch<R>(ahead, r));
  }
  for (; r < r0 + nrows; ++r) {
    ahead(r);
    float* o = out + (r - r0);
    int t = 0;
    for (; t + 4 <= ntok; t += 4) Row::template run<4>(w, e, r, acts + t, o + t * os, os);
    switch (ntok - t) {
      case 3: Row::template run<3>(w, e, r, acts + t, o + t * os, os); break;
      case 2: Row::template run<2>(w, e, r, acts + t, o + t * os, os); break;
      case 1: Row::template run<1>(w, e, r, acts + t, o + t * os, os); break;
      default: break;
    }
  }
}

// Tier tables, one per translation unit (compiled with that tier's flags).
const Kernels& kernels_scalar();
const Kernels& kernels_avx2();        // AVX2 + FMA + F16C: fp32 W4A16 NVFP4
const Kernels& kernels_avx2_vnni();   // + AVX-VNNI: 256-bit W4A8 NVFP4
const Kernels& kernels_avx512();      // AVX-512 F/BW/VL/DQ: fp32 W4A16 NVFP4
const Kernels& kernels_avx512_vnni(); // + AVX-512 VNNI: 512-bit W4A8 NVFP4
// The AVX-512 tier's Q8_32 activation quant (the VNNI tier's Q4_K layout starts from it).
void q8_32_prep_avx512(const float* x, int64_t K, uint8_t* out);
// The 512-bit W4A8 NVFP4 dot with vpermb (AVX-512 VBMI CPUs only).
void nvfp4_dot_avx512_vbmi(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                           const uint8_t* const* acts, int ntok, float* out, int64_t os,
                           const ReadNext& next);

// ============================================================================
// NVFP4 W4A8 activation layouts (the VNNI tiers)
// ============================================================================
// Activations are quantized once per token (int8 per block of 16 k) into groups of L blocks,
// L = the dot's int32 lanes (16 for the 512-bit dot, 8 for the 256-bit one), so that each
// lane accumulates one whole block: one int->float convert, one scale product and one FMA per
// 16 k and lane. The dot reads a group's weight codes as two loads of 8L bytes (lane l of a
// load holds half of block l/2) and interleaves their dwords (vpermt2d / vshufps) into one
// vector of the blocks' first halves and one of their second halves; lane m then holds block
// ord[m] (identity for 16 lanes; vshufps's in-lane order 0,1,4,5,2,3,6,7 for 8).
// Per token, ceil(K / 16L) groups of 24L bytes; group g covers blocks gL + ord[m], m < L:
//   [4Lv, 4Lv + 4L), v = 0..3: int8; lane m (bytes 4m .. 4m + 3), byte i holds value
//              8 * (v / 2) + 2i + v % 2 of block ord[m] (v even: even k, v odd: odd k), so a
//              weight vector's low nibbles (even k) and high nibbles (odd k) line up with them
//   [16L, 20L) int32 bias[L]: lane m = -12 * sum of block ord[m] (the E2M1 table's +12)
//   [20L, 24L) fp32 scale[L]: lane m = 128 * scale of block ord[m]; the 128 folds the 2^-8 of
//              the E4M3->FP16 shift and the 1/2 of the doubled E2M1 table
// A partial last group is zero-padded (int8 0, bias 0, scale 0).
struct Q8Layout {
  int lanes;
  int ord[16];
  constexpr int64_t group_k() const { return 16 * lanes; }
  constexpr int64_t group_bytes() const { return 24 * lanes; }
  constexpr int64_t bytes(int64_t K) const { return (K + group_k() - 1) / group_k() * group_bytes(); }
  constexpr int64_t vec(int v) const { return 4 * lanes * v; }  // int8 vector v (0..3)
  constexpr int64_t bias() const { return 16 * lanes; }         // int32 bias[lanes]
  constexpr int64_t scale() const { return 20 * lanes; }        // fp32 scale[lanes]
  // Byte offset, inside its group, of value w (0..15) of the block in lane m.
  constexpr int64_t pos(int m, int w) const {
    return vec(2 * (w / 8) + w % 2) + 4 * m + (w % 8) / 2;
  }
};
constexpr Q8Layout kQ8x16{16, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}};
constexpr Q8Layout kQ8x8{8, {0, 1, 4, 5, 2, 3, 6, 7}};
inline int64_t nvfp4_q8x16_bytes(int64_t K) { return kQ8x16.bytes(K); }
inline int64_t nvfp4_q8x8_bytes(int64_t K) { return kQ8x8.bytes(K); }

// Activation quantization shared by every int8 path: per block of `n` values,
// scale = amax / 127, q = round-half-even(x * (127 / amax)). Blocks whose amax is below
// 127 / FLT_MAX (about 3.7e-37, where 127 / amax overflows) become zeros with scale 0.
constexpr float kMinAmax = 127.0f / 3.4028234663852886e38f;

// Q8_32 layout of the GGUF integer formats: int8 q[K]; fp32 d[K/32]; int32 sum[K/32].
inline int64_t q8_32_bytes(int64_t K) { return K + (K / 32) * 8; }

// The Q6_K activations of the SIMD tiers: Q8_32, then int32 sum16[K/16], the sums of each 16
// int8 values (one Q6_K scale's run). A Q6_K weight is d * sc * (q - 32) with q the unsigned
// 6-bit code: the dots take q as vpdpbusd's unsigned operand and the -32 from sum16 as one
// term per super-block, d * sc * da * 32 * sum16, instead of a second vpdpbusd per vector.
inline int64_t q8_32s16_bytes(int64_t K) { return q8_32_bytes(K) + (K / 16) * 4; }

template <void (*Q8_32)(const float*, int64_t, uint8_t*)>
void q6k_prep(const float* x, int64_t K, uint8_t* out) {
  Q8_32(x, K, out);
  const auto* q = reinterpret_cast<const int8_t*>(out);
  auto* s16 = reinterpret_cast<int32_t*>(out + q8_32_bytes(K));
  for (int64_t g = 0; g < K / 16; ++g) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += q[16 * g + i];
    s16[g] = s;
  }
}

// ============================================================================
// Scalar decoders
// ============================================================================

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (NaN kept quiet)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400u), exp - 25);
  }
  return sign ? -v : v;
}

// E4M3 (fn: no infinities, 0x7f / 0xff = NaN), bias 7, subnormals 2^-6 * m/8.
inline float e4m3_to_f32(uint8_t b) {
  const int exp = (b >> 3) & 0xf;
  const int man = b & 7;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -9);
  } else if (exp == 15 && man == 7) {
    v = NAN;
  } else {
    v = std::ldexp(static_cast<float>(8 + man), exp - 10);
  }
  return (b & 0x80) ? -v : v;
}

// E2M1 code -> value (sign in bit 3).
constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float e8m0_to_f32(uint8_t b) {  // 2^(b - 127); 0xff is NaN
  return b == 0xff ? NAN : std::ldexp(1.0f, static_cast<int>(b) - 127);
}

// ggml's ggml_e8m0_to_fp32_half: 2^(b - 128) (the scale of GGUF MXFP4's doubled E2M1 table),
// subnormal for b < 2, and 2^127 (not NaN) for b = 255.
inline float e8m0_half_to_f32(uint8_t b) {
  return f32_from_bits(b < 2 ? 0x00200000u << b : static_cast<uint32_t>(b - 1) << 23);
}

// GGUF MXFP4 codes -> ggml's int8 values (twice the E2M1 values).
constexpr int8_t kMxfp4Int[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// A little-endian fp16 at p (GGUF block scales are not 2-byte aligned).
inline float f16_at(const uint8_t* p) { return f16_to_f32(static_cast<uint16_t>(p[0] | (p[1] << 8))); }

}  // namespace ft
