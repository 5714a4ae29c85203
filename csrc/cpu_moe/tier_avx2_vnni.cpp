// AVX-VNNI tier (256-bit, the `avx2` tier with VNNI): the NVFP4 W4A8 kernel with
// vpdpbusd on ymm registers and its SIMD activation quant; everything else comes from the
// AVX2 tier's table. Same data layout as the 512-bit kernel: a 32-byte weight load covers
// half a chunk (4 blocks); whole halves run in SIMD, the last 1-3 blocks in a scalar tail.
#include <immintrin.h>

#include "common.h"

namespace ft {
namespace avx2_vnni_tier {

constexpr int8_t kLut[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// ---------------------------------------------------------------------------
// activation quant (bit-identical to nvfp4_q8_prep_scalar)
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
  std::memset(out, 0, nvfp4_q8_bytes(K));
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t b = 0; b < K / 16; ++b) {
    uint8_t* ch = out + (b / 8) * kChunkBytes;
    const int bb = static_cast<int>(b % 8);
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
    _mm_storel_epi64(reinterpret_cast<__m128i*>(ch + bb * 8), q8);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(ch + 64 + bb * 8), _mm_unpackhi_epi64(q8, q8));
    int32_t* bias = reinterpret_cast<int32_t*>(ch + 128);
    float* sc = reinterpret_cast<float*>(ch + 192);
    bias[2 * bb] = -12 * hsum8i(q0);
    bias[2 * bb + 1] = -12 * hsum8i(q1);
    sc[2 * bb] = sc[2 * bb + 1] = (amax / 127.0f) * 128.0f;
  }
}

// ---------------------------------------------------------------------------
// dot
// ---------------------------------------------------------------------------
static inline __m256 decode_scales4(const uint8_t* p) {  // 4 E4M3 -> 8 lanes, value * 2^-8
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m128i s = _mm_cvtsi32_si128(v);
  __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_unpacklo_epi8(s, s)), 7);
  h = _mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0xbfff)));
  return _mm256_cvtph_ps(h);
}

static inline float e4m3_shifted(uint8_t b) {  // the same 2^-8 value as decode_scales4
  const __m128i h = _mm_cvtsi32_si128((((b & 0x7f) << 7) | ((b & 0x80) << 8)));
  return _mm_cvtss_f32(_mm_cvtph_ps(h));
}

// 8 E4M3 bytes (one chunk) -> two fp32 vectors (half h: lanes j <- byte 4h + j/2), value * 2^-8.
static inline void decode_scales8(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, s)), 7);
  h = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xbfff)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// Half a chunk (32 weight bytes, 4 blocks) of R rows x NT tokens at activation offset `off`:
// the activation vectors are loaded once per token and shared by the R rows; each (row, token)
// has its own accumulator chain, so a row's arithmetic does not depend on R or NT.
template <int R, int NT>
static inline void half_rows(const uint8_t* wp, int64_t rows, const __m256* ws,
                             const uint8_t* const* a, int64_t off, __m256 (*facc)[NT]) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kLut)));
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  __m256i wl[R], wh[R];
  for (int r = 0; r < R; ++r) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + r * rows));
    wl[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(w, m4));
    wh[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(w, 4), m4));
  }
  for (int t = 0; t < NT; ++t) {
    const uint8_t* p = a[t] + off;
    const __m256i ae = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i ao = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 64));
    const __m256i bias = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 128));
    const __m256 as = _mm256_load_ps(reinterpret_cast<const float*>(p + 192));
    for (int r = 0; r < R; ++r) {
      __m256i acc = _mm256_dpbusd_avx_epi32(bias, wl[r], ae);
      acc = _mm256_dpbusd_avx_epi32(acc, wh[r], ao);
      facc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(ws[r], as), facc[r][t]);
    }
  }
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Scalar tail: block b (global index) of one token, same integer math as the SIMD lanes.
static inline float tail_block(const uint8_t* wrow, const uint8_t* wsc, int64_t b,
                               const uint8_t* a) {
  const uint8_t* ch = a + (b / 8) * kChunkBytes;
  const int bb = static_cast<int>(b % 8);
  const int8_t* even = reinterpret_cast<const int8_t*>(ch) + bb * 8;
  const int8_t* odd = even + 64;
  int32_t s = 0;
  for (int i = 0; i < 8; ++i) {
    const uint8_t byte = wrow[b * 8 + i];
    s += (kLut[byte & 15] - 12) * even[i] + (kLut[byte >> 4] - 12) * odd[i];
  }
  const float as = reinterpret_cast<const float*>(ch + 192)[2 * bb];
  return static_cast<float>(s) * (e4m3_shifted(wsc[b]) * as);
}

// R consecutive rows against NT tokens; res[r + t * os]. Whole chunks decode their 8 scales at
// once; a last whole half (4 blocks) decodes its 4; the last 1-3 blocks run the scalar tail.
template <int R, int NT>
static inline void rows_dot(const uint8_t* wrow, int64_t rows, const uint8_t* wsc, int64_t srows,
                            int64_t K, const uint8_t* const* a, float* res, int64_t os) {
  __m256 facc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) facc[r][t] = _mm256_setzero_ps();
  const int64_t nblocks = K / 16, nchunk = nblocks / 8;
  __m256 lo[R], hi[R];
  const int64_t pf = prefetch_bytes();
  for (int64_t c = 0; c < nchunk; ++c) {
    if (pf) {  // the linear cursor of the R rows (R x 64 B codes, R x 8 B scales a chunk)
      prefetch_lines(wrow + c * 64 * R + pf, R);
      prefetch_lines(wsc + c * 8 * R + pf / 8, 1);
    }
    for (int r = 0; r < R; ++r) decode_scales8(wsc + r * srows + c * 8, lo[r], hi[r]);
    half_rows<R, NT>(wrow + c * 64, rows, lo, a, c * kChunkBytes, facc);
    half_rows<R, NT>(wrow + c * 64 + 32, rows, hi, a, c * kChunkBytes + 32, facc);
  }
  if (nblocks % 8 >= 4) {
    for (int r = 0; r < R; ++r) lo[r] = decode_scales4(wsc + r * srows + nchunk * 8);
    half_rows<R, NT>(wrow + nchunk * 64, rows, lo, a, nchunk * kChunkBytes, facc);
  }
  const int64_t b0 = nblocks / 4 * 4;  // first block of the scalar tail
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      float s = hsum8(facc[r][t]);
      for (int64_t b = b0; b < nblocks; ++b)
        s += tail_block(wrow + r * rows, wsc + r * srows, b, a[t]);
      res[r + t * os] = s;
    }
}

// Row r against every token, in groups of at most 4 tokens (the row comes from memory once for
// all of them).
static inline void row_all_tokens(const Bank& w, int64_t e, int64_t r, const uint8_t* const* a,
                                  int ntok, float* o, int64_t os) {
  const int64_t sb = w.K / 16, rb = w.row_bytes;
  const uint8_t* wr = w.row(e, r);
  const uint8_t* sc = w.scales + (e * w.N + r) * sb;
  int t = 0;
  for (; t + 4 <= ntok; t += 4) rows_dot<1, 4>(wr, rb, sc, sb, w.K, a + t, o + t * os, os);
  switch (ntok - t) {
    case 3: rows_dot<1, 3>(wr, rb, sc, sb, w.K, a + t, o + t * os, os); break;
    case 2: rows_dot<1, 2>(wr, rb, sc, sb, w.K, a + t, o + t * os, os); break;
    case 1: rows_dot<1, 1>(wr, rb, sc, sb, w.K, a + t, o + t * os, os); break;
    default: break;
  }
}

// Rows in groups of 4 at one token, 1 beyond (1-core L2, K = 2048: 4 rows 24.6 GB/s, 3 rows
// 23.6-24.3, 2 rows 22.5; 4 spill the accumulators to the stack but still win).
static void dot_nvfp4(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                      const uint8_t* const* acts, int ntok, float* out, int64_t os) {
  const int64_t r1 = r0 + nrows, sb = w.K / 16;
  int64_t r = r0;
  if (ntok == 1)
    for (; r + 4 <= r1; r += 4)
      rows_dot<4, 1>(w.row(e, r), w.row_bytes, w.scales + (e * w.N + r) * sb, sb, w.K, acts,
                     out + (r - r0), os);
  for (; r < r1; ++r) row_all_tokens(w, e, r, acts, ntok, out + (r - r0), os);
}

}  // namespace avx2_vnni_tier

const Kernels& kernels_avx2_vnni() {
  static const Kernels k = [] {
    Kernels t = kernels_avx2();
    t.name = "avx2_vnni";
    t.fmt[static_cast<int>(Fmt::NVFP4)] =
        FormatKernels{nvfp4_q8_bytes, avx2_vnni_tier::prep_nvfp4_q8, avx2_vnni_tier::dot_nvfp4};
    return t;
  }();
  return k;
}

}  // namespace ft
