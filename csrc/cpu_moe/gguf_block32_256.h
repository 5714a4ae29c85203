// GGUF blocks of 32 values x int8 (the Q8_32 activations of common.h), 256-bit: Q8_0, Q4_0,
// Q4_1, Q5_0, Q5_1 and MXFP4, one vector a block (see gguf_dot256.h for the formats' math).
// Included by gguf_dot256.h inside namespace gguf256.
#pragma once

// Blk::kBytes is a block's size, Blk::scales8(blk, m) the fp32 scales of the 8 blocks from blk
// on (lanes off in mask m: 0), Blk::weights(blk) a block's prepared weights, Blk::dot<Dp>(w, a,
// seed) its int32 lanes against one token's activations a (32 int8) on top of `seed`. Codes
// stored with an offset (w = q - kOff) take -kOff * sum(a) from the seed: Blk::seed8(ns, c)
// spreads it over the lanes from ns = -sum(a) of 8 blocks (lane c).
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
                                        o + 8, o + 9, o + 12, o + 13,
                                        -1, -1, -1, -1, -1, -1, -1, -1);
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
  const __m256i c =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(c, _mm256_setr_epi64x(0, 0, 4, 4)),
                          _mm256_set1_epi8(0x0f));
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
  static __m256i dot(const W& q, const uint8_t* a, __m256i seed) {
    return Dp::dp(seed, q, ld32(a));
  }
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
