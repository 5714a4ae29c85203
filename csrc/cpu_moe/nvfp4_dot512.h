// The 512-bit NVFP4 W4A8 dot (vpdpbusd), shared by tier_avx512_vnni.cpp (kVbmi = false: vpshufb
// nibble lookups) and tier_avx512_vbmi.cpp (kVbmi = true: vpermb, which reads 6 index bits, so
// the low nibble needs no mask). Include only from a translation unit compiled with the
// matching flags.
//
// A group = 256 k = 16 blocks = 128 weight bytes + 16 E4M3 scales, activations in the 16-lane
// layout of common.h. In a 64-byte load, int32 lane l holds half a block (block l/2, 8 codes);
// vpermt2d of two loads gathers the first halves of the 16 blocks into one vector and the second
// halves into another, so lane j is block j in both. Each splits into low nibbles (even k) and
// high nibbles (odd k); a byte lookup maps each code through the E2M1 table doubled and biased
// by +12 (0..24, unsigned), vpdpbusd's unsigned operand as is; four vpdpbusd on top of the
// activation's -12 * sum(a) leave block j's integer dot in lane j. The 16 E4M3 scales become fp16
// by a shift (value * 2^-8) and fp32 by one vcvtph2ps, in the lanes' order as they are.
// Against a layout of half-block lanes this halves the int->float converts, scale products,
// FMAs and scale decodes per weight byte (one core, L2, K = 2048: +13% with vpermb, +19% with
// vpshufb).
//
// R rows share each activation load (4 at one token), every (row, token) has its own
// accumulator chain, and the row sum is reduced once at the end: a row's arithmetic is the
// same whatever R, NT, r0 and nrows are.
#pragma once

#include <immintrin.h>

#include "common.h"

namespace ft {
namespace dot512 {

// 16 E4M3 bytes -> 16 fp32 (value * 2^-8): sign-extended to words and shifted left by 7, the
// byte lands in bits 7..14 with its sign also in bit 15; clearing bit 14 leaves fp16
// sign | exponent | mantissa, which vcvtph2ps converts exactly (subnormals included).
static inline __m512 decode_scales16(__m128i s16) {
  __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s16), 7);
  h = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xbfff)));
  return _mm512_cvtph_ps(h);
}

// 64 code bytes -> the biased E2M1 values of their low and high nibbles.
template <bool kVbmi>
static inline void nibbles(__m512i p, __m512i& lo, __m512i& hi) {
  const __m512i lut = _mm512_broadcast_i32x4(
      _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  if constexpr (kVbmi) {  // the table repeats every 16, so index bits 4..5 are moot
    lo = _mm512_permutexvar_epi8(p, lut);
    hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(p, 4), lut);
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(p, m4));
    hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(p, 4), m4));
  }
}

// The sum of a row's 16 lanes, in one fixed tree for every R and NT: h_i = a_i + a_(i+8),
// q_i = h_i + h_(i+4), p_i = q_i + q_(i+2), then p_0 + p_1 (the order of _mm512_reduce_add_ps).
static inline float sum1(__m512 a) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

// Four rows' sums at once, by the same tree (each step adds the same pairs as sum1), with
// whole-register shuffles instead of four horizontal reductions: about 14 instructions for 4
// rows instead of 36, which matters for short rows (K = 512: 2 groups a row).
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // [a.lo256 | b.lo256] + [a.hi256 | b.hi256] = [h(a) | h(b)]
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xee));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xee));
  // [h0.lo, h1.lo, h2.lo, h3.lo] + [h0.hi, h1.hi, h2.hi, h3.hi] = [q0 | q1 | q2 | q3]
  const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xdd));
  const __m512 p = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4e));   // lanes 0, 1: q0+q2, q1+q3
  const __m512 s = _mm512_add_ps(p, _mm512_permute_ps(p, 0xb1));   // lane 0: p0 + p1
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s));
}

// One group of R rows x NT tokens: A, B are each row's two 64-byte loads, ws its 16 block
// scales; the activation group of token t starts at a[t] + off.
template <bool kVbmi, int R, int NT>
static inline void group_step(const __m512i* A, const __m512i* B, const __m512* ws,
                              const uint8_t* const* a, int64_t off, __m512 (*facc)[NT]) {
  const __m512i first = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i second = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int r = 0; r < R; ++r) {
    __m512i l0, h0, l1, h1;
    nibbles<kVbmi>(_mm512_permutex2var_epi32(A[r], first, B[r]), l0, h0);
    nibbles<kVbmi>(_mm512_permutex2var_epi32(A[r], second, B[r]), l1, h1);
    for (int t = 0; t < NT; ++t) {
      const uint8_t* p = a[t] + off;
      constexpr Q8Layout L = kQ8x16;
      __m512i acc = _mm512_dpbusd_epi32(_mm512_load_si512(p + L.bias()), l0, _mm512_load_si512(p));
      acc = _mm512_dpbusd_epi32(acc, h0, _mm512_load_si512(p + L.vec(1)));
      acc = _mm512_dpbusd_epi32(acc, l1, _mm512_load_si512(p + L.vec(2)));
      acc = _mm512_dpbusd_epi32(acc, h1, _mm512_load_si512(p + L.vec(3)));
      const __m512 as = _mm512_load_ps(reinterpret_cast<const float*>(p + L.scale()));
      facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(ws[r], as), facc[r][t]);
    }
  }
}

// R consecutive rows (`rows` bytes apart, scales `srows` apart) against NT tokens; res[r + t*os].
// The last 1..15 blocks use masked loads, whose zeros meet the activation's zero padding.
template <bool kVbmi, int R, int NT>
static inline void rows_dot(const uint8_t* wrow, int64_t rows, const uint8_t* wsc, int64_t srows,
                            int64_t K, const uint8_t* const* a, float* res, int64_t os,
                            const Prefetch& pre) {
  __m512 facc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) facc[r][t] = _mm512_setzero_ps();
  const int64_t ns = K / kQ8x16.group_k();
  __m512i A[R], B[R];
  __m512 ws[R];
  for (int64_t s = 0; s < ns; ++s) {
    prefetch_rows_step(wrow, wsc, s * 128, 128, R, pre);
    for (int r = 0; r < R; ++r) {
      A[r] = _mm512_loadu_si512(wrow + r * rows + s * 128);
      B[r] = _mm512_loadu_si512(wrow + r * rows + s * 128 + 64);
      ws[r] = decode_scales16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wsc + r * srows + s * 16)));
    }
    group_step<kVbmi, R, NT>(A, B, ws, a, s * kQ8x16.group_bytes(), facc);
  }
  const int64_t left = K / 16 - 16 * ns;  // 0..15 blocks after the groups
  if (left) {
    prefetch_rows_step(wrow, wsc, ns * 128, left * 8, R, pre);
    const int64_t nb = left * 8;  // their code bytes, 8..120
    const __mmask64 ma = nb >= 64 ? ~0ULL : (1ULL << nb) - 1;
    const __mmask64 mb = nb <= 64 ? 0ULL : (1ULL << (nb - 64)) - 1;
    const __mmask16 sm = static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < R; ++r) {
      A[r] = _mm512_maskz_loadu_epi8(ma, wrow + r * rows + ns * 128);
      B[r] = _mm512_maskz_loadu_epi8(mb, wrow + r * rows + ns * 128 + 64);
      ws[r] = decode_scales16(_mm_maskz_loadu_epi8(sm, wsc + r * srows + ns * 16));
    }
    group_step<kVbmi, R, NT>(A, B, ws, a, ns * kQ8x16.group_bytes(), facc);
  }
  if constexpr (R == 4 && NT == 1) {
    _mm_storeu_ps(res, sum4(facc[0][0], facc[1][0], facc[2][0], facc[3][0]));  // t = 0: res[0..3]
  } else {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) res[r + t * os] = sum1(facc[r][t]);
  }
}

// Rows r..r+R-1 against every token, in groups of at most 4 tokens: a weight row comes from
// memory once for all of them (later groups find it in L1).
template <bool kVbmi, int R>
static inline void rows_all_tokens(const Bank& w, int64_t e, int64_t r, const uint8_t* const* a,
                                   int ntok, float* o, int64_t os, const Prefetch& pre) {
  const int64_t sb = w.K / 16, rb = w.row_bytes;
  const uint8_t* wr = w.row(e, r);
  const uint8_t* sc = w.scales + (e * w.N + r) * sb;
  int t = 0;
  for (; t + 4 <= ntok; t += 4) rows_dot<kVbmi, R, 4>(wr, rb, sc, sb, w.K, a + t, o + t * os, os, pre);
  switch (ntok - t) {
    case 3: rows_dot<kVbmi, R, 3>(wr, rb, sc, sb, w.K, a + t, o + t * os, os, pre); break;
    case 2: rows_dot<kVbmi, R, 2>(wr, rb, sc, sb, w.K, a + t, o + t * os, os, pre); break;
    case 1: rows_dot<kVbmi, R, 1>(wr, rb, sc, sb, w.K, a + t, o + t * os, os, pre); break;
    default: break;
  }
}

// The DotFn: rows in groups of 4 at one token, 2 at two, 1 beyond (the accumulators fit the 32
// registers).
template <bool kVbmi>
static void dot_nvfp4(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                      const uint8_t* const* acts, int ntok, float* out, int64_t os,
                      const ReadNext& next) {
  const int64_t r1 = r0 + nrows;
  const Prefetch pre = nvfp4_prefetch(w, e, r0, nrows, next);
  int64_t r = r0;
  if (ntok == 1)
    for (; r + 4 <= r1; r += 4)
      rows_all_tokens<kVbmi, 4>(w, e, r, acts, 1, out + (r - r0), os, pre);
  if (ntok == 2)
    for (; r + 2 <= r1; r += 2)
      rows_all_tokens<kVbmi, 2>(w, e, r, acts, 2, out + (r - r0), os, pre);
  for (; r < r1; ++r) rows_all_tokens<kVbmi, 1>(w, e, r, acts, ntok, out + (r - r0), os, pre);
}

}  // namespace dot512
}  // namespace ft
