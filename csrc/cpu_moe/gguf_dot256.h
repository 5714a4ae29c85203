// GGUF Q4_K / Q5_K / Q6_K / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / MXFP4 x int8 (the Q8_32
// activations of common.h), 256-bit.
// Dp::dp(acc, u8, s8) adds the 4-byte dot products of unsigned u and signed s to acc's int32
// lanes: the VEX vpdpbusd in the avx2_vnni tier (AVX-VNNI), the EVEX one on ymm in the
// avx512_vnni tier, vpmaddubsw + vpmaddwd in the tiers without VNNI. Include inside the tier's
// namespace, after <immintrin.h> and common.h.
//
// One vector holds 32 values, so every int32 lane belongs to one sub-block of 32 (Q4_K, Q8_0,
// Q4_0) or one scale of 16 values (Q6_K) and one FMA with the lane's factor accumulates it.
// - Q4_K (super-block of 256: fp16 d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
//   nibbles, 32 bytes a group of 64 values: low nibbles the first 32, high the next 32): value
//   = d * sc[s] * q - dmin * m[s]; the mins go to a second accumulator against the activation
//   sums of the Q8_32 layout.
// - Q6_K (256 values in two halves of 128: ql 64 bytes, qh 32 bytes, 16 int8 scales, fp16 d):
//   value = d * sc[v / 16] * (q - 32); the 6-bit q is the unsigned operand, the -32 a second
//   accumulator of d * sc * da * sum16 against the activation's sums per 16 (q6k_prep).
// - Q8_0 (fp16 d, int8 q[32]): |w| is the unsigned operand, the activations take w's sign
//   (they are in [-127, 127], so negating them cannot overflow; w = -128 gives 128 x -a).
// - Q4_0 (fp16 d, 16 bytes: value j in the low nibble of byte j, value j + 16 in its high
//   nibble, w = q - 8): the nibbles are the unsigned operand and -8 * sum(a) seeds lane 0.
// - Q5_0 / Q5_1: Q4_0's nibbles with bit j of a u32 qh as bit 4 of value j (w = q - 16, the
//   -16 as Q4_0's -8); Q4_1 / Q5_1: w = d * q + m, the m * da * sum(a) terms on scalar chains.
// - Q5_K: Q4_K with bit s of qh[l] (32 bytes) as bit 4 of value l of sub-block s.
// - MXFP4 (E8M0 e, Q4_0's nibbles, w = int[code] * 2^(e - 128), int in [-12, 12]): a vpshufb
//   table gives int + 12 as the unsigned operand, -12 * sum(a) seeds lane 0.
// All exact in int32 before the scales.
#pragma once

// The sum of 8 floats (a fixed order).
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

namespace gguf256 {

// Independent accumulator chains a token: with one, every FMA of a row waits for the one
// before it (4 cycles), which bounded these kernels (one core, L2, this box: Q8_0 8 B and Q4_K
// 4 B a cycle against the 34 and 144 bytes each chain link covers). Four chains for every
// token group size, summed in a fixed order: a token's result must not depend on how many
// tokens share its call (with one chain from three tokens on, as before, a request decoded
// alone and the same request in a batch of 16 got other bits, and another greedy text).
template <int NT>
constexpr int kChains = 4;

template <int NT>
static inline float sum_chains(const __m256* c) {
  __m256 s = c[0];
  for (int i = 1; i < kChains<NT>; ++i) s = _mm256_add_ps(s, c[i]);
  return hsum8(s);
}

static inline __m256 bcast(__m256 v, int i) {
  return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i));
}
static inline __m256i ld32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The unsigned 6-bit codes of half h (128 values) of a Q6_K super-block as four vectors of 32
// bytes: V[v] holds values 32v .. 32v + 31 of the half (ql nibbles, qh's 2-bit pairs above).
static inline void q6k_half_codes(const uint8_t* blk, int h, __m256i V[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
  const __m256i ql0 = ld32(blk + 64 * h), ql1 = ld32(blk + 64 * h + 32);
  const __m256i qh = ld32(blk + 128 + 32 * h);
  V[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
  V[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
  V[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
  V[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                         _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}

}  // namespace gguf256

// The 8 scales and 8 mins of a Q4_K super-block (llama.cpp's get_scale_min_k4, four words at
// once); shared with the row dequantizer (gguf_dequant256.h).
static inline void q4k_scales_mins(const uint8_t* s12, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t u[3];
  std::memcpy(u, s12, 12);
  const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
  const uint32_t sc_lo = u[0] & k1, sc_hi = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  const uint32_t m_lo = u[1] & k1, m_hi = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  std::memcpy(sc, &sc_lo, 4), std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(mn, &m_lo, 4), std::memcpy(mn + 4, &m_hi, 4);
}

// A Q4_K super-block's factors per sub-block: dsc[s] = d * sc[s], dmn[s] = dmin * m[s].
static inline void q4k_factors(const uint8_t* blk, __m256& dsc, __m256& dmn) {
  uint16_t dh, mh;
  std::memcpy(&dh, blk, 2), std::memcpy(&mh, blk + 2, 2);
  alignas(8) uint8_t sc[8], mn[8];
  q4k_scales_mins(blk + 4, sc, mn);
  auto u8x8 = [](const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  };
  dsc = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dh)), u8x8(sc));
  dmn = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(mh)), u8x8(mn));
}

namespace gguf256 {

// Q4_K (Q5 false) or Q5_K (Q5 true: 176-byte blocks, qh at 16, nibbles at 48).
template <class Dp, int NT, bool Q5 = false>
static inline void q4k_row(const uint8_t* row, int64_t K, const uint8_t* const* acts, float* res,
                           int64_t os) {
  const int64_t nsb = K / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0f), z = _mm256_setzero_si256();
  const __m256i m10 = _mm256_set1_epi8(0x10);
  constexpr int C = kChains<NT>;
  __m256 acc[NT][C], accm[NT];
  for (int t = 0; t < NT; ++t) {
    for (int c = 0; c < C; ++c) acc[t][c] = _mm256_setzero_ps();
    accm[t] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* blk = row + b * (Q5 ? 176 : 144);
    __m256 dsc, dmn;
    q4k_factors(blk, dsc, dmn);
    __m256i q[8];  // sub-block s: 32 values, low nibbles (s even) or high (s odd) of 32 bytes
    for (int g = 0; g < 4; ++g) {
      const __m256i w = ld32(blk + (Q5 ? 48 : 16) + 32 * g);
      q[2 * g] = _mm256_and_si256(w, m4);
      q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
    }
    if constexpr (Q5) {  // bit s of each qh byte to bit 4 (16-bit shifts: the mask keeps bytes apart)
      const __m256i qh = ld32(blk + 16);
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m256i h = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
        q[s] = _mm256_or_si256(q[s], _mm256_and_si256(h, m10));
      }
    }
    for (int t = 0; t < NT; ++t) {
      const uint8_t* A = acts[t];
      const uint8_t* aq = A + b * 256;
      const __m256 da = _mm256_loadu_ps(reinterpret_cast<const float*>(A + K) + b * 8);
      const __m256 f = _mm256_mul_ps(dsc, da);
      for (int s = 0; s < 8; ++s)
        acc[t][s % C] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Dp::dp(z, q[s], ld32(aq + 32 * s))),
                                        bcast(f, s), acc[t][s % C]);
      const __m256i sa = ld32(A + K + K / 8 + b * 32);
      accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(dmn, da), _mm256_cvtepi32_ps(sa), accm[t]);
    }
  }
  for (int t = 0; t < NT; ++t) res[t * os] = sum_chains<NT>(acc[t]) - hsum8(accm[t]);
}

template <class Dp, int NT>
static inline void q6k_row(const uint8_t* row, int64_t K, const uint8_t* const* acts, float* res,
                           int64_t os) {
  const int64_t nsb = K / 256;
  const __m256i z = _mm256_setzero_si256();
  const __m256i da_pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  constexpr int C = kChains<NT>;
  __m256 acc[NT][C], off[NT];  // off: sum over the scales' runs of d * sc * da * sum16
  for (int t = 0; t < NT; ++t) {
    for (int c = 0; c < C; ++c) acc[t][c] = _mm256_setzero_ps();
    off[t] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* blk = row + b * 210;
    uint16_t dh;
    std::memcpy(&dh, blk + 208, 2);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
    for (int h = 0; h < 2; ++h) {
      // S[i] = d * sc[8h + i]; vector v (values 32v .. 32v + 31 of the half) has scale 2v in
      // lanes 0-3 and 2v + 1 in lanes 4-7
      const __m256 S = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192 + 8 * h)))));
      __m256i V[4];
      q6k_half_codes(blk, h, V);
      __m256 F[4];
      for (int v = 0; v < 4; ++v)
        F[v] = _mm256_permutevar8x32_ps(S, _mm256_setr_epi32(2 * v, 2 * v, 2 * v, 2 * v,
                                                             2 * v + 1, 2 * v + 1, 2 * v + 1, 2 * v + 1));
      for (int t = 0; t < NT; ++t) {
        const uint8_t* A = acts[t];
        const uint8_t* aq = A + b * 256 + 128 * h;
        const float* da = reinterpret_cast<const float*>(A + K) + b * 8 + 4 * h;
        for (int v = 0; v < 4; ++v) {
          const __m256i q = Dp::dp(z, V[v], ld32(aq + 32 * v));  // the codes, offset 32
          acc[t][v % C] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q),
                                          _mm256_mul_ps(F[v], _mm256_broadcast_ss(da + v)),
                                          acc[t][v % C]);
        }
        // the half's 8 runs of 16: S[i] * da[i / 2] * sum16[i]
        const __m256 dap = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_loadu_ps(da)), da_pairs);
        const __m256i s16 = ld32(A + q8_32_bytes(K) + 4 * (b * 16 + 8 * h));
        off[t] = _mm256_fmadd_ps(_mm256_mul_ps(S, dap), _mm256_cvtepi32_ps(s16), off[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) res[t * os] = sum_chains<NT>(acc[t]) - 32.0f * hsum8(off[t]);
}

#include "gguf_block32_256.h"

template <class Dp, int NT>
static inline void q8_0_row(const uint8_t* row, int64_t K, const uint8_t* const* acts,
                            float* res, int64_t os) {
  block32_row<Dp, Q8_0Blk, NT>(row, K, acts, res, os);
}
template <class Dp, int NT>
static inline void q4_0_row(const uint8_t* row, int64_t K, const uint8_t* const* acts,
                            float* res, int64_t os) {
  block32_row<Dp, Q4_0Blk, NT>(row, K, acts, res, os);
}
template <class Dp, int NT>
static inline void q4_1_row(const uint8_t* row, int64_t K, const uint8_t* const* acts,
                            float* res, int64_t os) {
  block32_row<Dp, Q4_1Blk, NT>(row, K, acts, res, os);
}
template <class Dp, int NT>
static inline void q5_0_row(const uint8_t* row, int64_t K, const uint8_t* const* acts,
                            float* res, int64_t os) {
  block32_row<Dp, Q5_0Blk, NT>(row, K, acts, res, os);
}
template <class Dp, int NT>
static inline void q5_1_row(const uint8_t* row, int64_t K, const uint8_t* const* acts,
                            float* res, int64_t os) {
  block32_row<Dp, Q5_1Blk, NT>(row, K, acts, res, os);
}
template <class Dp, int NT>
static inline void mxfp4_row(const uint8_t* row, int64_t K, const uint8_t* const* acts,
                             float* res, int64_t os) {
  block32_row<Dp, Mxfp4Blk, NT>(row, K, acts, res, os);
}
template <class Dp, int NT>
static inline void q5k_row(const uint8_t* row, int64_t K, const uint8_t* const* acts, float* res,
                           int64_t os) {
  q4k_row<Dp, NT, true>(row, K, acts, res, os);
}

#define FT_ROW(NAME, FN)                                                                        \
  template <class Dp>                                                                           \
  struct NAME {                                                                                 \
    template <int NT>                                                                           \
    static void run(const Bank& w, int64_t e, int64_t r, const uint8_t* const* acts, float* res, \
                    int64_t os) {                                                               \
      FN<Dp, NT>(w.row(e, r), w.K, acts, res, os);                                              \
    }                                                                                           \
  };
FT_ROW(Q4KRow, q4k_row)
FT_ROW(Q6KRow, q6k_row)
FT_ROW(Q8_0Row, q8_0_row)
FT_ROW(Q4_0Row, q4_0_row)
FT_ROW(Q4_1Row, q4_1_row)
FT_ROW(Q5_0Row, q5_0_row)
FT_ROW(Q5_1Row, q5_1_row)
FT_ROW(Mxfp4Row, mxfp4_row)
FT_ROW(Q5KRow, q5k_row)
#undef FT_ROW

// A tier's table entries for the GGUF formats: the activations by its Q8_32 quant P (Q6_K's
// with the sums per 16 its dots take, q6k_prep) ...
template <void (*P)(const float*, int64_t, uint8_t*)>
static void set_preps(Kernels& t) {
  for (Fmt f : {Fmt::Q4_0, Fmt::Q8_0, Fmt::Q4_K, Fmt::Q4_1, Fmt::Q5_0, Fmt::Q5_1, Fmt::Q5_K,
                Fmt::GGUF_MXFP4})
    t.fmt[static_cast<int>(f)].prep = P;
  t.fmt[static_cast<int>(Fmt::Q6_K)].act_bytes = q8_32s16_bytes;
  t.fmt[static_cast<int>(Fmt::Q6_K)].prep = q6k_prep<P>;
}

// ... and the 256-bit dots with Dp.
template <class Dp>
static void set_dots(Kernels& t) {
  t.fmt[static_cast<int>(Fmt::Q4_1)].dot = dot_rows_by_token_groups<Q4_1Row<Dp>>;
  t.fmt[static_cast<int>(Fmt::Q5_0)].dot = dot_rows_by_token_groups<Q5_0Row<Dp>>;
  t.fmt[static_cast<int>(Fmt::Q5_1)].dot = dot_rows_by_token_groups<Q5_1Row<Dp>>;
  t.fmt[static_cast<int>(Fmt::Q5_K)].dot = dot_rows_by_token_groups<Q5KRow<Dp>>;
  t.fmt[static_cast<int>(Fmt::GGUF_MXFP4)].dot = dot_rows_by_token_groups<Mxfp4Row<Dp>>;
  t.fmt[static_cast<int>(Fmt::Q4_K)].dot = dot_rows_by_token_groups<Q4KRow<Dp>>;
  t.fmt[static_cast<int>(Fmt::Q6_K)].dot = dot_rows_by_token_groups<Q6KRow<Dp>>;
  t.fmt[static_cast<int>(Fmt::Q8_0)].dot = dot_rows_by_token_groups<Q8_0Row<Dp>>;
  t.fmt[static_cast<int>(Fmt::Q4_0)].dot = dot_rows_by_token_groups<Q4_0Row<Dp>>;
}

}  // namespace gguf256
