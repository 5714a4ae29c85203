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
// 4 B a cycle against the 34 and 144 bytes each chain link covers). Four chains at one token,
// two at two, one from three tokens on (the tokens' chains interleave). The chains are summed
// in a fixed order, so a row's result still does not depend on how rows and tokens are grouped.
template <int NT>
constexpr int kChains = NT == 1 ? 4 : NT == 2 ? 2 : 1;

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

}  // namespace gguf256

// The 8 scales and 8 mins of a Q4_K super-block (llama.cpp's get_scale_min_k4, four words at
// once); shared with the 512-bit Q4_K kernel.
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
  const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
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
      const __m256i ql0 = ld32(blk + 64 * h), ql1 = ld32(blk + 64 * h + 32);
      const __m256i qh = ld32(blk + 128 + 32 * h);
      const __m256i V[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
          _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                          _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30))};
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

// Blocks of 32 values, one vector a block. Blk::kBytes is the block's size, Blk::scales8(blk, m)
// the fp32 scales of the 8 blocks from blk on (lanes off in mask m: 0), Blk::weights(blk) its prepared
// weights, Blk::dot<Dp>(w, a, seed) its int32 lanes against one token's activations a (32 int8)
// on top of `seed`. Codes stored with an offset (w = q - kOff) take -kOff * sum(a) from the
// seed: Blk::seed8(ns, c) spreads it over the lanes from ns = -sum(a) of 8 blocks (lane c).
// Blk::kMin: every value also adds its block's min (Q4_1, Q5_1; Blk::mins8 as scales8).
static inline float f16_scale(const uint8_t* blk) {
  uint16_t h;
  std::memcpy(&h, blk, 2);
  return _cvtsh_ss(h);
}
// The dwords at byte `off` of 8 consecutive blocks of `bytes` each, lanes off in `mask` 0 (not
// read): one gather.
static inline __m256i gather8(const uint8_t* blk, int64_t bytes, int off, __m256i mask) {
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                         _mm256_set1_epi32(static_cast<int>(bytes)));
  return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(),
                                     reinterpret_cast<const int*>(blk + off), idx, mask, 1);
}
// The low (HI false) or high fp16 halves of 8 dwords as 8 floats.
template <bool HI>
static inline __m256 f16x8(__m256i g) {
  const int8_t o = HI ? 2 : 0;
  const __m256i pick = _mm256_setr_epi8(o, o + 1, o + 4, o + 5, o + 8, o + 9, o + 12, o + 13,
                                        -1, -1, -1, -1, -1, -1, -1, -1, o, o + 1, o + 4, o + 5,
                                        o + 8, o + 9, o + 12, o + 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(g, pick), 0x08);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(h));
}
static inline __m256i lane(__m256i v, int c) {  // lane c of v in every lane
  return _mm256_permutevar8x32_epi32(v, _mm256_set1_epi32(c));
}
// 16 bytes of codes: value j in the low nibble of byte j, j + 16 in the high one -> 32 bytes.
// A broadcast load and a per-lane shift, not vinserti128: the shuffle port is these dots' busiest
// (1 core, L2, K = 896: Q4_0 9.7 -> 10.8 GB/s, Q4_1 10.7 -> 12.0, MXFP4 7.7 -> 8.6).
static inline __m256i nibbles32(const uint8_t* p) {
  const __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(c, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
}
// Q5_0 / Q5_1: the nibbles at qs with bit j of the u32 at qh as 0x10 in byte j.
static inline __m256i q5_codes32(const uint8_t* qh, const uint8_t* qs) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
#ifdef __AVX512BW__
  const __m256i q = nibbles32(qs);
  return _mm256_mask_add_epi8(q, h, q, _mm256_set1_epi8(0x10));  // nibble + 0x10 = nibble | 0x10
#else
  // llama.cpp's bytes_from_bits_32: byte j takes byte j / 8 of h, all its bits but bit j % 8
  // are set, so it is all ones exactly where that bit is set
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                         0x0101010101010101, 0);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  const __m256i bit = _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
  return _mm256_or_si256(nibbles32(qs), _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
#endif
}

// The fp16 d (and m) at the start of a block.
template <class Blk>
struct F16Scales8 {
  static __m256 scales8(const uint8_t* blk, __m256i mask) {
    return f16x8<false>(gather8(blk, Blk::kBytes, 0, mask));
  }
  static __m256 mins8(const uint8_t* blk, __m256i mask) {
    return f16x8<true>(gather8(blk, Blk::kBytes, 0, mask));
  }
};
// Unsigned codes against a, from `seed`.
struct PlainDot {
  using W = __m256i;
  template <class Dp>
  static __m256i dot(const W& q, const uint8_t* a, __m256i seed) { return Dp::dp(seed, q, ld32(a)); }
};
// Seeds of the offsets 0, 8 (-sum in each of 8 lanes) and 16 (-2 sum each).
struct NoSeed {
  static constexpr int kOff = 0;
  static __m256i seed8(__m256i, int) { return _mm256_setzero_si256(); }
};
struct Seed8 {
  static constexpr int kOff = 8;
  static __m256i seed8(__m256i ns, int c) { return lane(ns, c); }
};
struct Seed16 {
  static constexpr int kOff = 16;
  static __m256i seed8(__m256i ns, int c) { return _mm256_slli_epi32(lane(ns, c), 1); }
};

struct Q8_0Blk : F16Scales8<Q8_0Blk>, NoSeed {
  static constexpr int64_t kBytes = 34;
  static constexpr bool kMin = false;
  struct W {
    __m256i abs, sign;
  };
  static W weights(const uint8_t* blk) {
    const __m256i w = ld32(blk + 2);
    return {_mm256_abs_epi8(w), w};  // -128 -> 0x80 = 128 as the unsigned operand
  }
  template <class Dp>
  static __m256i dot(const W& w, const uint8_t* a, __m256i /*seed*/) {
    // a with w's sign (0 where w = 0)
    return Dp::dp(_mm256_setzero_si256(), w.abs, _mm256_sign_epi8(ld32(a), w.sign));
  }
};
struct Q4_0Blk : F16Scales8<Q4_0Blk>, PlainDot, Seed8 {
  static constexpr int64_t kBytes = 18;
  static constexpr bool kMin = false;
  static W weights(const uint8_t* blk) { return nibbles32(blk + 2); }
};
struct Q4_1Blk : F16Scales8<Q4_1Blk>, PlainDot, NoSeed {
  static constexpr int64_t kBytes = 20;
  static constexpr bool kMin = true;
  static W weights(const uint8_t* blk) { return nibbles32(blk + 4); }
};
struct Q5_0Blk : F16Scales8<Q5_0Blk>, PlainDot, Seed16 {
  static constexpr int64_t kBytes = 22;
  static constexpr bool kMin = false;
  static W weights(const uint8_t* blk) { return q5_codes32(blk + 2, blk + 6); }
};
struct Q5_1Blk : F16Scales8<Q5_1Blk>, PlainDot, NoSeed {
  static constexpr int64_t kBytes = 24;
  static constexpr bool kMin = true;
  static W weights(const uint8_t* blk) { return q5_codes32(blk + 4, blk + 8); }
};
struct Mxfp4Blk : PlainDot {
  static constexpr int64_t kBytes = 17;
  static constexpr bool kMin = false;
  static constexpr int kOff = 12;
  static __m256 scales8(const uint8_t* blk, __m256i mask) {  // e8m0_half_to_f32 of the first bytes
    const __m256i e = _mm256_and_si256(gather8(blk, kBytes, 0, mask), _mm256_set1_epi32(0xff));
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(norm, sub, small));
  }
  static __m256i seed8(__m256i ns, int c) {  // -2 sum in lanes 0-3, -sum in 4-7: -12 sum
    return _mm256_sllv_epi32(lane(ns, c), _mm256_setr_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  }
  static W weights(const uint8_t* blk) {  // kMxfp4Int[code] + 12
    const __m256i lut = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    return _mm256_shuffle_epi8(lut, nibbles32(blk + 1));
  }
};

// One row of blocks of 32 against NT tokens. Groups of 8 blocks take their scales (and mins)
// with one gather and their token factors d * da with one multiply, and pass each block its
// factor and offset seed by one lane broadcast each: per block that is about 11 instructions
// instead of 17 (the scalar fp16 scale, its product and broadcast, the seed built from a
// scalar): 1 core, L2, T = 1, Q4_0 9.2 -> 9.8 GB/s at K = 896 and 9.8 -> 10.7 at K = 4864 (the
// two builds alternated); Q4_1, its mins per block on scalar chains before, went from 0.9x
// Q4_0's rate to 1.1x. The mins: one FMA per 8 blocks. A last group of n < 8 blocks
// masks its gathers and loads (zero lanes: their factors and mins are 0).
template <class Dp, class Blk, int NT>
static inline void block32_row(const uint8_t* row, int64_t K, const uint8_t* const* acts,
                               float* res, int64_t os) {
  constexpr int C = kChains<NT>;
  __m256 acc[NT][C], accm[NT];
  for (int t = 0; t < NT; ++t) {
    for (int c = 0; c < C; ++c) acc[t][c] = _mm256_setzero_ps();
    accm[t] = _mm256_setzero_ps();
  }
  const int64_t nb = K / 32;
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, nb - b0));
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota);
    const uint8_t* g = row + b0 * Blk::kBytes;
    const __m256 dw = Blk::scales8(g, mask);
    __m256 f[NT];
    __m256i ns[NT];
    for (int t = 0; t < NT; ++t) {
      const __m256 da = _mm256_maskload_ps(reinterpret_cast<const float*>(acts[t] + K) + b0, mask);
      const __m256i sa = _mm256_maskload_epi32(
          reinterpret_cast<const int*>(acts[t] + K + K / 8) + b0, mask);
      f[t] = _mm256_mul_ps(dw, da);
      ns[t] = _mm256_sub_epi32(_mm256_setzero_si256(), sa);
      if constexpr (Blk::kMin)
        accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(Blk::mins8(g, mask), da), _mm256_cvtepi32_ps(sa),
                                  accm[t]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      if (c >= n) break;
      const typename Blk::W w = Blk::weights(g + c * Blk::kBytes);
      for (int t = 0; t < NT; ++t) {
        const __m256i q = Blk::template dot<Dp>(w, acts[t] + (b0 + c) * 32, Blk::seed8(ns[t], c));
        const __m256 fc = _mm256_castsi256_ps(lane(_mm256_castps_si256(f[t]), c));
        acc[t][c % C] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), fc, acc[t][c % C]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) res[t * os] = sum_chains<NT>(acc[t]) + hsum8(accm[t]);
}
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
