// Row decoders of the GGUF integer formats, 256-bit: the codes of 32 values as 32 bytes (the
// dots' unpacking, gguf_dot256.h), then 8 at a time int8 -> fp32 times the scale. The generic
// decoders (dequant_rows.h) vectorize these formats poorly: Q4_0 / Q5_0 / Q6_K / Q4_K 3.7 /
// 4.1 / 6.7 / 19 GB/s of output on one core (L2) against about 30 here. The values are those of
// dequant_rows.h: the same fp32 products and sums, the products rounded before a min is added.
// Include after gguf_dot256.h (inside the tier's namespace); call set_dequants().
#pragma once

namespace gguf256 {

// o[0..32) = d[i / 8] * q, q 32 int8 codes, d one scale per run of 8 (Q6_K has two per vector).
// With MIN: (d * q) + m, the product rounded first: the empty asm hides it from GCC, which
// would otherwise fuse the multiply and the add into one FMA (-ffp-contract=fast).
template <bool MIN>
static inline void store_scaled(__m256i q, const __m256* d, __m256 m, float* o) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i part[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
  for (int i = 0; i < 4; ++i) {
    __m256 p = _mm256_mul_ps(d[i], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i])));
    if constexpr (MIN) {
      asm("" : "+x"(p));
      p = _mm256_add_ps(p, m);
    }
    _mm256_storeu_ps(o + 8 * i, p);
  }
}
static inline void store_scaled1(__m256i q, float d, float* o) {
  const __m256 v = _mm256_set1_ps(d), dv[4] = {v, v, v, v};
  store_scaled<false>(q, dv, v, o);
}
static inline void store_scaled_min(__m256i q, float d, float m, float* o) {
  const __m256 v = _mm256_set1_ps(d), dv[4] = {v, v, v, v};
  store_scaled<true>(q, dv, _mm256_set1_ps(m), o);
}

static void dq256_q8_0(const uint8_t* b, float* o) { store_scaled1(ld32(b + 2), f16_scale(b), o); }
static void dq256_q4_0(const uint8_t* b, float* o) {
  store_scaled1(_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), f16_scale(b), o);
}
static void dq256_q4_1(const uint8_t* b, float* o) {
  store_scaled_min(nibbles32(b + 4), f16_scale(b), f16_scale(b + 2), o);
}
static void dq256_q5_0(const uint8_t* b, float* o) {
  store_scaled1(_mm256_sub_epi8(q5_codes32(b + 2, b + 6), _mm256_set1_epi8(16)), f16_scale(b), o);
}
static void dq256_q5_1(const uint8_t* b, float* o) {
  store_scaled_min(q5_codes32(b + 4, b + 8), f16_scale(b), f16_scale(b + 2), o);
}
static void dq256_mxfp4(const uint8_t* b, float* o) {
  const __m256i lut = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Int)));
  store_scaled1(_mm256_shuffle_epi8(lut, nibbles32(b + 1)), e8m0_half_to_f32(b[0]), o);
}
// Q6_K: value = (d * sc[i]) * (q - 32), scale i per 16 values (see q6k_row for the layout).
static void dq256_q6_k(const uint8_t* b, float* o) {
  const __m256i c32 = _mm256_set1_epi8(32);
  const float d = f16_scale(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int h = 0; h < 2; ++h) {
    __m256i V[4];
    q6k_half_codes(b, h, V);
    for (int v = 0; v < 4; ++v) {
      const __m256 s0 = _mm256_set1_ps(d * static_cast<float>(sc[8 * h + 2 * v]));
      const __m256 s1 = _mm256_set1_ps(d * static_cast<float>(sc[8 * h + 2 * v + 1]));
      const __m256 dv[4] = {s0, s0, s1, s1};
      store_scaled<false>(_mm256_sub_epi8(V[v], c32), dv, s0, o + 128 * h + 32 * v);
    }
  }
}

// Q4_K / Q5_K: value = (d * sc[s]) * q - (dmin * m[s]) per sub-block s of 32 (x - y is
// x + (-y) bit for bit); the codes as q4k_row unpacks them.
template <bool Q5>
static void dq256_k4(const uint8_t* b, float* o) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m10 = _mm256_set1_epi8(0x10);
  const float d = f16_scale(b), dmin = f16_scale(b + 2);
  uint8_t sc[8], mn[8];
  q4k_scales_mins(b + 4, sc, mn);
  const __m256i qh = Q5 ? ld32(b + 16) : _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
    const __m256i w = ld32(b + (Q5 ? 48 : 16) + 32 * (s / 2));
    __m256i q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(w, 4) : w, m4);
    if constexpr (Q5) {
      const __m256i h = s <= 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
      q = _mm256_or_si256(q, _mm256_and_si256(h, m10));
    }
    const __m256 dv = _mm256_set1_ps(d * static_cast<float>(sc[s])), dvs[4] = {dv, dv, dv, dv};
    store_scaled<true>(q, dvs, _mm256_set1_ps(-(dmin * static_cast<float>(mn[s]))), o + 32 * s);
  }
}

static void set_dequants(Kernels& t) {
  auto set = [&](Fmt f, DequantFn fn) { t.fmt[static_cast<int>(f)].dequant = fn; };
  set(Fmt::Q8_0, dequant_blocks<dq256_q8_0, 32, 34>);
  set(Fmt::Q4_0, dequant_blocks<dq256_q4_0, 32, 18>);
  set(Fmt::Q4_1, dequant_blocks<dq256_q4_1, 32, 20>);
  set(Fmt::Q5_0, dequant_blocks<dq256_q5_0, 32, 22>);
  set(Fmt::Q5_1, dequant_blocks<dq256_q5_1, 32, 24>);
  set(Fmt::GGUF_MXFP4, dequant_blocks<dq256_mxfp4, 32, 17>);
  set(Fmt::Q4_K, dequant_blocks<dq256_k4<false>, 256, 144>);
  set(Fmt::Q5_K, dequant_blocks<dq256_k4<true>, 256, 176>);
  set(Fmt::Q6_K, dequant_blocks<dq256_q6_k, 256, 210>);
}

}  // namespace gguf256
