// The 512-bit NVFP4 W4A8 dot (vpdpbusd), shared by tier_avx512_vnni.cpp (kVbmi = false: vpshufb
// nibble lookups) and tier_avx512_vbmi.cpp (kVbmi = true: vpermb, which reads 6 index bits, so
// the low nibble needs no mask and the E4M3 scales of two chunks spread with one instruction).
// Include only from a translation unit compiled with the matching flags.
//
// Chunk = 128 k = 64 weight bytes + 8 E4M3 scales. One 64-byte load splits into low nibbles
// (even k) and high nibbles (odd k); a byte lookup maps each code through the E2M1 table doubled
// and biased by +12 (0..24, unsigned), so it is vpdpbusd's unsigned operand as is; the
// activation's -12 * sum(a) per lane seeds the accumulator. Lanes 2b, 2b+1 of the int32 result
// belong to block b; the E4M3 scales become fp16 by a shift (value * 2^-8) and fp32 by vcvtph2ps.
//
// Speed (one core, weights in L2): R rows share each activation load (4 at one token), every
// (row, token) has its own accumulator chain, scales are decoded 16 at a time, and the row sum
// is reduced once at the end. A row's arithmetic is the same whatever R, NT, r0 and nrows are.
#pragma once

#include <immintrin.h>

#include "common.h"

namespace ft {
namespace dot512 {

// 16 E4M3 bytes (two chunks) -> two fp32 vectors; lane j of chunk h takes byte 8h + j/2, as
// value * 2^-8: the byte lands in bits 7..14 of a word with its sign also at bit 15; bit 14
// (the sign's copy) is cleared, leaving fp16 sign | exp | man; vcvtph2ps is exact.
template <bool kVbmi>
static inline void decode_scales16(__m128i s16, __m512& lo, __m512& hi) {
  __m512i h;
  if constexpr (kVbmi) {  // word i <- byte i/2 in its high byte, low byte zero; >> 1 arith.
    const __m512i idx = _mm512_set_epi8(
        15, 0, 15, 0, 14, 0, 14, 0, 13, 0, 13, 0, 12, 0, 12, 0, 11, 0, 11, 0, 10, 0, 10, 0,
        9, 0, 9, 0, 8, 0, 8, 0, 7, 0, 7, 0, 6, 0, 6, 0, 5, 0, 5, 0, 4, 0, 4, 0,
        3, 0, 3, 0, 2, 0, 2, 0, 1, 0, 1, 0, 0, 0, 0, 0);
    h = _mm512_maskz_permutexvar_epi8(0xAAAAAAAAAAAAAAAAULL, idx, _mm512_castsi128_si512(s16));
    h = _mm512_srai_epi16(h, 1);
  } else {  // sign-extended byte pairs << 7
    const __m256i d = _mm256_set_m128i(_mm_unpackhi_epi8(s16, s16), _mm_unpacklo_epi8(s16, s16));
    h = _mm512_slli_epi16(_mm512_cvtepi8_epi16(d), 7);
  }
  h = _mm512_and_si512(h, _mm512_set1_epi16(static_cast<short>(0xbfff)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// One chunk (128 k) of R rows x NT tokens: activation vectors loaded once per token, shared by
// the R rows.
template <bool kVbmi, int R, int NT>
static inline void chunk_rows(const __m512i* w, const __m512* ws, const uint8_t* const* a,
                              int64_t off, __m512 (*facc)[NT]) {
  const __m512i lut = _mm512_broadcast_i32x4(
      _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  __m512i wl[R], wh[R];
  for (int r = 0; r < R; ++r) {
    if constexpr (kVbmi) {  // the table repeats every 16, so bits 4..5 of the index are moot
      wl[r] = _mm512_permutexvar_epi8(w[r], lut);
      wh[r] = _mm512_permutexvar_epi8(_mm512_srli_epi16(w[r], 4), lut);
    } else {
      const __m512i m4 = _mm512_set1_epi8(0x0f);
      wl[r] = _mm512_shuffle_epi8(lut, _mm512_and_si512(w[r], m4));
      wh[r] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(w[r], 4), m4));
    }
  }
  for (int t = 0; t < NT; ++t) {
    const uint8_t* p = a[t] + off;
    const __m512i ae = _mm512_load_si512(p), ao = _mm512_load_si512(p + 64);
    const __m512i bias = _mm512_load_si512(p + 128);
    const __m512 as = _mm512_load_ps(reinterpret_cast<const float*>(p + 192));
    for (int r = 0; r < R; ++r) {
      __m512i acc = _mm512_dpbusd_epi32(bias, wl[r], ae);
      acc = _mm512_dpbusd_epi32(acc, wh[r], ao);
      facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(ws[r], as), facc[r][t]);
    }
  }
}

// R consecutive rows (`rows` bytes apart, scales `srows` apart) against NT tokens; res[r + t*os].
// Two chunks per step share one 16-byte scale load; the tail (an odd chunk, a partial chunk)
// uses masked loads, whose zeros meet the activation's zero padding.
template <bool kVbmi, int R, int NT>
static inline void rows_dot(const uint8_t* wrow, int64_t rows, const uint8_t* wsc, int64_t srows,
                            int64_t K, const uint8_t* const* a, float* res, int64_t os) {
  __m512 facc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) facc[r][t] = _mm512_setzero_ps();
  const int64_t npair = K / kChunkK / 2;
  __m512i w[R];
  __m512 lo[R], hi[R];
  const int64_t pf = prefetch_bytes();
  for (int64_t c = 0; c < 2 * npair; c += 2) {
    if (pf) {  // the linear cursor of the R rows (R x 128 B codes, R x 16 B scales a step)
      prefetch_lines(wrow + c * 64 * R + pf, 2 * R);
      prefetch_lines(wsc + c * 8 * R + pf / 8, 1);
    }
    for (int r = 0; r < R; ++r) {
      const auto* sp = reinterpret_cast<const __m128i*>(wsc + r * srows + c * 8);
      decode_scales16<kVbmi>(_mm_loadu_si128(sp), lo[r], hi[r]);
      w[r] = _mm512_loadu_si512(wrow + r * rows + c * 64);
    }
    chunk_rows<kVbmi, R, NT>(w, lo, a, c * kChunkBytes, facc);
    for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_si512(wrow + r * rows + c * 64 + 64);
    chunk_rows<kVbmi, R, NT>(w, hi, a, (c + 1) * kChunkBytes, facc);
  }
  const int64_t left = K / 16 - 16 * npair;  // 0..15 blocks after the pairs
  if (left) {
    const int64_t c = 2 * npair;
    const int n0 = static_cast<int>(left < 8 ? left : 8), n1 = static_cast<int>(left - n0);
    const __mmask64 m0 = n0 == 8 ? ~0ULL : (1ULL << (n0 * 8)) - 1;
    for (int r = 0; r < R; ++r) {
      const __mmask16 sm = static_cast<__mmask16>((1u << left) - 1);
      decode_scales16<kVbmi>(_mm_maskz_loadu_epi8(sm, wsc + r * srows + c * 8), lo[r], hi[r]);
      w[r] = _mm512_maskz_loadu_epi8(m0, wrow + r * rows + c * 64);
    }
    chunk_rows<kVbmi, R, NT>(w, lo, a, c * kChunkBytes, facc);
    if (n1) {
      for (int r = 0; r < R; ++r)
        w[r] = _mm512_maskz_loadu_epi8((1ULL << (n1 * 8)) - 1, wrow + r * rows + c * 64 + 64);
      chunk_rows<kVbmi, R, NT>(w, hi, a, (c + 1) * kChunkBytes, facc);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) res[r + t * os] = _mm512_reduce_add_ps(facc[r][t]);
}

// Rows r..r+R-1 against every token, in groups of at most 4 tokens: a weight row comes from
// memory once for all of them (later groups find it in L1).
template <bool kVbmi, int R>
static inline void rows_all_tokens(const Bank& w, int64_t e, int64_t r, const uint8_t* const* a,
                                   int ntok, float* o, int64_t os) {
  const int64_t sb = w.K / 16, rb = w.row_bytes;
  const uint8_t* wr = w.row(e, r);
  const uint8_t* sc = w.scales + (e * w.N + r) * sb;
  int t = 0;
  for (; t + 4 <= ntok; t += 4) rows_dot<kVbmi, R, 4>(wr, rb, sc, sb, w.K, a + t, o + t * os, os);
  switch (ntok - t) {
    case 3: rows_dot<kVbmi, R, 3>(wr, rb, sc, sb, w.K, a + t, o + t * os, os); break;
    case 2: rows_dot<kVbmi, R, 2>(wr, rb, sc, sb, w.K, a + t, o + t * os, os); break;
    case 1: rows_dot<kVbmi, R, 1>(wr, rb, sc, sb, w.K, a + t, o + t * os, os); break;
    default: break;
  }
}

// The DotFn: rows in groups of 4 at one token, 2 at two, 1 beyond (the accumulators fit the 32
// registers).
template <bool kVbmi>
static void dot_nvfp4(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                      const uint8_t* const* acts, int ntok, float* out, int64_t os) {
  const int64_t r1 = r0 + nrows;
  int64_t r = r0;
  if (ntok == 1)
    for (; r + 4 <= r1; r += 4) rows_all_tokens<kVbmi, 4>(w, e, r, acts, 1, out + (r - r0), os);
  if (ntok == 2)
    for (; r + 2 <= r1; r += 2) rows_all_tokens<kVbmi, 2>(w, e, r, acts, 2, out + (r - r0), os);
  for (; r < r1; ++r) rows_all_tokens<kVbmi, 1>(w, e, r, acts, ntok, out + (r - r0), os);
}

}  // namespace dot512
}  // namespace ft
