// AVX-VNNI tier (256-bit, the `avx2` tier with VNNI): the NVFP4 W4A8 kernel with
// vpdpbusd on ymm registers and its SIMD activation quant (the 8-lane layout of common.h), and
// the GGUF Q4_K / Q6_K / Q8_0 / Q4_0 kernels of gguf_dot256.h; everything else comes from the
// AVX2 tier's table. A group is 8 blocks = 64 weight bytes:
// two 32-byte loads interleaved by vshufps into the blocks' first and second halves, so each
// int32 lane accumulates one whole block (lanes in block order 0,1,4,5,2,3,6,7); the last
// 1..7 blocks use masked loads.
#include <immintrin.h>

#include <cstring>

#include "common.h"

namespace ft {
namespace avx2_vnni_tier {
#include "gguf_dot256.h"

// ---------------------------------------------------------------------------
// activation quant (bit-identical to nvfp4_q8_prep_scalar(kQ8x8))
// ---------------------------------------------------------------------------
static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

static inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

static void prep_nvfp4_q8(const float* x, int64_t K, uint8_t* out) {
  std::memset(out, 0, kQ8x8.bytes(K));
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // dword v of the shuffled block = the 4 values vector v of the group takes
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  constexpr int kLaneOf[8] = {0, 1, 4, 5, 2, 3, 6, 7};  // ord is its own inverse
  for (int64_t b = 0; b < K / 16; ++b) {
    uint8_t* g = out + (b / 8) * kQ8x8.group_bytes();
    const int m = kLaneOf[b % 8];
    const __m256 v0 = _mm256_loadu_ps(x + b * 16), v1 = _mm256_loadu_ps(x + b * 16 + 8);
    const float amax = hmax8(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)));
    if (!(amax >= kMinAmax)) continue;
    const __m256 inv = _mm256_set1_ps(127.0f / amax);
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
    __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
    q0 = _mm256_max_epi32(_mm256_min_epi32(q0, lim), nlim);
    q1 = _mm256_max_epi32(_mm256_min_epi32(q1, lim), nlim);
    // packs interleaves 128-bit lanes: [0..3, 8..11, 4..7, 12..15] -> permute back.
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xd8);
    const __m128i q8 = _mm_shuffle_epi8(
        _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1)), split);
    const int32_t d[4] = {_mm_cvtsi128_si32(q8), _mm_extract_epi32(q8, 1),
                          _mm_extract_epi32(q8, 2), _mm_extract_epi32(q8, 3)};
    for (int u = 0; u < 4; ++u) std::memcpy(g + kQ8x8.vec(u) + 4 * m, &d[u], 4);
    reinterpret_cast<int32_t*>(g + kQ8x8.bias())[m] = -12 * hsum8i(_mm256_add_epi32(q0, q1));
    reinterpret_cast<float*>(g + kQ8x8.scale())[m] = (amax / 127.0f) * 128.0f;
  }
}

// ---------------------------------------------------------------------------
// dot
// ---------------------------------------------------------------------------
// 8 E4M3 bytes (one group) -> 8 fp32 in lane order 0,1,4,5,2,3,6,7, value * 2^-8: vpshufb puts
// each byte in the high byte of its word (low byte zero), >> 1 arithmetic leaves it in bits
// 7..14 with its sign also in bit 15; clearing bit 14 leaves fp16 sign | exponent | mantissa.
static inline __m256 decode_scales8(__m128i s) {
  const __m128i idx = _mm_setr_epi8(-128, 0, -128, 1, -128, 4, -128, 5, -128, 2, -128, 3, -128, 6,
                                    -128, 7);
  __m128i h = _mm_srai_epi16(_mm_shuffle_epi8(s, idx), 1);
  h = _mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0xbfff)));
  return _mm256_cvtph_ps(h);
}

// The same for two groups at once (16 E4M3 bytes; group g in the low 128-bit lane, g + 1 in
// the high one): one shuffle, shift and mask for both, then a convert each. Against two
// decode_scales8 this is one vector instruction fewer per group of 64 code bytes, of ~23.
static inline void decode_scales8x2(__m128i s, __m256& w0, __m256& w1) {
  const __m256i idx = _mm256_setr_epi8(-128, 0, -128, 1, -128, 4, -128, 5, -128, 2, -128, 3, -128,
                                       6, -128, 7, -128, 8, -128, 9, -128, 12, -128, 13, -128, 10,
                                       -128, 11, -128, 14, -128, 15);
  __m256i h = _mm256_srai_epi16(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(s), idx), 1);
  h = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xbfff)));
  w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// One group of R rows x NT tokens: A, B are each row's two 32-byte loads, ws its 8 block scales;
// the activation group of token t starts at a[t] + off. Each (row, token) has its own
// accumulator chain, so a row's arithmetic does not depend on R or NT.
template <int R, int NT>
static inline void group_step(const __m256i* A, const __m256i* B, const __m256* ws,
                              const uint8_t* const* a, int64_t off, __m256 (*facc)[NT]) {
  const __m256i lut = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (int r = 0; r < R; ++r) {
    const __m256 fa = _mm256_castsi256_ps(A[r]), fb = _mm256_castsi256_ps(B[r]);
    const __m256i p0 = _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0x88));  // first halves
    const __m256i p1 = _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0xdd));  // second halves
    const __m256i l0 = _mm256_shuffle_epi8(lut, _mm256_and_si256(p0, m4));
    const __m256i h0 = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(p0, 4), m4));
    const __m256i l1 = _mm256_shuffle_epi8(lut, _mm256_and_si256(p1, m4));
    const __m256i h1 = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(p1, 4), m4));
    for (int t = 0; t < NT; ++t) {
      const uint8_t* p = a[t] + off;
      auto ld = [p](int64_t o) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p + o)); };
      constexpr Q8Layout L = kQ8x8;
      __m256i acc = _mm256_dpbusd_avx_epi32(ld(L.bias()), l0, ld(L.vec(0)));
      acc = _mm256_dpbusd_avx_epi32(acc, h0, ld(L.vec(1)));
      acc = _mm256_dpbusd_avx_epi32(acc, l1, ld(L.vec(2)));
      acc = _mm256_dpbusd_avx_epi32(acc, h1, ld(L.vec(3)));
      const __m256 as = _mm256_load_ps(reinterpret_cast<const float*>(p + L.scale()));
      facc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(ws[r], as), facc[r][t]);
    }
  }
}


// R consecutive rows (`rows` bytes apart, scales `srows` apart) against NT tokens;
// res[r + t * os]. The last 1..7 blocks load masked (2 dwords of codes per block; the scale
// bytes through a zeroed buffer); their zeros meet the activation's zero padding.
template <int R, int NT>
static inline void rows_dot(const uint8_t* wrow, int64_t rows, const uint8_t* wsc, int64_t srows,
                            int64_t K, const uint8_t* const* a, float* res, int64_t os,
                            const Prefetch& pre) {
  __m256 facc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) facc[r][t] = _mm256_setzero_ps();
  const int64_t ng = K / kQ8x8.group_k();
  __m256i A[R], B[R];
  __m256 ws[R], ws1[R];
  auto load = [&](int64_t g) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* w = wrow + r * rows + g * 64;
      A[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      B[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
    }
  };
  int64_t g = 0;
  for (; g + 2 <= ng; g += 2) {  // two groups a step: their scales decoded together
    prefetch_rows_step(wrow, wsc, g * 64, 64, R, pre);
    load(g);
    for (int r = 0; r < R; ++r)
      decode_scales8x2(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wsc + r * srows + g * 8)),
                       ws[r], ws1[r]);
    group_step<R, NT>(A, B, ws, a, g * kQ8x8.group_bytes(), facc);
    prefetch_rows_step(wrow, wsc, (g + 1) * 64, 64, R, pre);
    load(g + 1);
    group_step<R, NT>(A, B, ws1, a, (g + 1) * kQ8x8.group_bytes(), facc);
  }
  if (g < ng) {
    prefetch_rows_step(wrow, wsc, g * 64, 64, R, pre);
    load(g);
    for (int r = 0; r < R; ++r)
      ws[r] = decode_scales8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wsc + r * srows + g * 8)));
    group_step<R, NT>(A, B, ws, a, g * kQ8x8.group_bytes(), facc);
  }
  const int left = static_cast<int>(K / 16 - 8 * ng);  // 0..7 blocks after the groups
  if (left) {
    prefetch_rows_step(wrow, wsc, ng * 64, left * 8, R, pre);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i ma = _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * left), lane);
    const __m256i mb = _mm256_cmpgt_epi32(_mm256_set1_epi32(2 * left - 8), lane);
    for (int r = 0; r < R; ++r) {
      const int* w = reinterpret_cast<const int*>(wrow + r * rows + ng * 64);
      A[r] = _mm256_maskload_epi32(w, ma);
      B[r] = _mm256_maskload_epi32(w + 8, mb);
      alignas(16) uint8_t sb[16] = {};
      std::memcpy(sb, wsc + r * srows + ng * 8, left);
      ws[r] = decode_scales8(_mm_load_si128(reinterpret_cast<const __m128i*>(sb)));
    }
    group_step<R, NT>(A, B, ws, a, ng * kQ8x8.group_bytes(), facc);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r + t * os] = hsum8(facc[r][t]);
}

// Row r against every token, in groups of at most 4 tokens (the row comes from memory once for
// all of them).
static inline void row_all_tokens(const Bank& w, int64_t e, int64_t r, const uint8_t* const* a,
                                  int ntok, float* o, int64_t os, const Prefetch& pre) {
  const int64_t sb = w.K / 16, rb = w.row_bytes;
  const uint8_t* wr = w.row(e, r);
  const uint8_t* sc = w.scales + (e * w.N + r) * sb;
  int t = 0;
  for (; t + 4 <= ntok; t += 4) rows_dot<1, 4>(wr, rb, sc, sb, w.K, a + t, o + t * os, os, pre);
  switch (ntok - t) {
    case 3: rows_dot<1, 3>(wr, rb, sc, sb, w.K, a + t, o + t * os, os, pre); break;
    case 2: rows_dot<1, 2>(wr, rb, sc, sb, w.K, a + t, o + t * os, os, pre); break;
    case 1: rows_dot<1, 1>(wr, rb, sc, sb, w.K, a + t, o + t * os, os, pre); break;
    default: break;
  }
}

// Rows in groups of 3 at one token, 1 beyond (1 core, L2, best of 400 runs: K = 2048 26.3 GB/s
// with 3 rows, 25.5 with 4, 24.5 with 2; K = 512 22.2 with 3 or 4).
static void dot_nvfp4(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                      const uint8_t* const* acts, int ntok, float* out, int64_t os,
                      const ReadNext& next) {
  const int64_t r1 = r0 + nrows, sb = w.K / 16;
  const Prefetch pre = nvfp4_prefetch(w, e, r0, nrows, next);
  int64_t r = r0;
  if (ntok == 1)
    for (; r + 3 <= r1; r += 3)
      rows_dot<3, 1>(w.row(e, r), w.row_bytes, w.scales + (e * w.N + r) * sb, sb, w.K, acts,
                     out + (r - r0), os, pre);
  for (; r < r1; ++r) row_all_tokens(w, e, r, acts, ntok, out + (r - r0), os, pre);
}


// GGUF integer formats: the 256-bit kernels of gguf_dot256.h with the VEX vpdpbusd.
struct VexDp {
  static __m256i dp(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
};

}  // namespace avx2_vnni_tier

const Kernels& kernels_avx2_vnni() {
  static const Kernels k = [] {
    Kernels t = kernels_avx2();
    t.name = "avx2_vnni";
    t.fmt[static_cast<int>(Fmt::NVFP4)] =  // the W4A8 dot; the row decoder stays
        FormatKernels{nvfp4_q8x8_bytes, avx2_vnni_tier::prep_nvfp4_q8, avx2_vnni_tier::dot_nvfp4, t.fmt[static_cast<int>(Fmt::NVFP4)].dequant};
    avx2_vnni_tier::gguf256::set_dots<avx2_vnni_tier::VexDp>(t);
    return t;
  }();
  return k;
}

}  // namespace ft
