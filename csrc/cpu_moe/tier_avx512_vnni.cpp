// AVX-512 VNNI tier: the 512-bit NVFP4 W4A8 kernel (vpdpbusd) and its SIMD activation quant.
// Everything else comes from the AVX-512 tier's table.
//
// Chunk = 128 k = 64 weight bytes + 8 E4M3 scales. One 64-byte load splits into low nibbles
// (even k) and high nibbles (odd k); vpshufb maps each code through the E2M1 table doubled and
// biased by +12 (0..24, unsigned), so it is vpdpbusd's unsigned operand as is; the activation's
// -12 * sum(a) per lane seeds the accumulator. Lanes 2b, 2b+1 of the int32 result belong to
// block b; the E4M3 scales become fp16 by a shift (value * 2^-8) and fp32 by vcvtph2ps.
#include <immintrin.h>

#include "common.h"

namespace ft {


namespace avx512_vnni_tier {

// ---------------------------------------------------------------------------
// activation quant (bit-identical to nvfp4_q8_prep_scalar)
// ---------------------------------------------------------------------------
static void prep_nvfp4_q8(const float* x, int64_t K, uint8_t* out) {
  std::memset(out, 0, nvfp4_q8_bytes(K));
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t b = 0; b < K / 16; ++b) {
    uint8_t* ch = out + (b / 8) * kChunkBytes;
    const int bb = static_cast<int>(b % 8);
    const __m512 v = _mm512_loadu_ps(x + b * 16);
    const float amax = _mm512_reduce_max_ps(_mm512_and_ps(v, absmask));
    if (!(amax >= kMinAmax)) continue;  // zeros, scale 0 (already cleared)
    const float inv = 127.0f / amax;
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));
    q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    const __m128i q8 = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q), split);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(ch + bb * 8), q8);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(ch + 64 + bb * 8), _mm_unpackhi_epi64(q8, q8));
    int32_t* bias = reinterpret_cast<int32_t*>(ch + 128);
    float* sc = reinterpret_cast<float*>(ch + 192);
    bias[2 * bb] = -12 * _mm512_mask_reduce_add_epi32(0x00ff, q);
    bias[2 * bb + 1] = -12 * _mm512_mask_reduce_add_epi32(0xff00, q);
    sc[2 * bb] = sc[2 * bb + 1] = (amax / 127.0f) * 128.0f;
  }
}

// ---------------------------------------------------------------------------
// dot
// ---------------------------------------------------------------------------
// 8 E4M3 bytes -> 16 fp32 lanes (each scale twice), value * 2^-8.
static inline __m512 decode_scales(__m128i s8) {
  const __m128i d = _mm_unpacklo_epi8(s8, s8);
  __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(d), 7);
  h = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0xbfff)));
  return _mm512_cvtph_ps(h);
}

template <int NT>
static inline void chunk_step(__m512i w, __m512 ws, const uint8_t* const* a, int64_t off,
                              __m512* facc) {
  const __m512i lut = _mm512_broadcast_i32x4(
      _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i wl = _mm512_shuffle_epi8(lut, _mm512_and_si512(w, m4));
  const __m512i wh = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(w, 4), m4));
  for (int t = 0; t < NT; ++t) {
    const uint8_t* p = a[t] + off;
    __m512i acc = _mm512_load_si512(p + 128);
    acc = _mm512_dpbusd_epi32(acc, wl, _mm512_load_si512(p));
    acc = _mm512_dpbusd_epi32(acc, wh, _mm512_load_si512(p + 64));
    const __m512 s = _mm512_mul_ps(ws, _mm512_load_ps(reinterpret_cast<const float*>(p + 192)));
    facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), s, facc[t]);
  }
}

template <int NT>
static inline void row_dot(const uint8_t* wrow, const uint8_t* wsc, int64_t K,
                           const uint8_t* const* a, float* res, int64_t os) {
  __m512 facc[NT];
  for (int t = 0; t < NT; ++t) facc[t] = _mm512_setzero_ps();
  const int64_t nfull = K / kChunkK;
  for (int64_t c = 0; c < nfull; ++c) {
    const __m512i w = _mm512_loadu_si512(wrow + c * 64);
    const __m512 ws = decode_scales(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wsc + c * 8)));
    chunk_step<NT>(w, ws, a, c * kChunkBytes, facc);
  }
  const int rem = static_cast<int>((K % kChunkK) / 16);  // blocks in a partial last chunk
  if (rem) {
    const __m512i w = _mm512_maskz_loadu_epi8((1ULL << (rem * 8)) - 1, wrow + nfull * 64);
    const __m128i s8 = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << rem) - 1), wsc + nfull * 8);
    chunk_step<NT>(w, decode_scales(s8), a, nfull * kChunkBytes, facc);
  }
  for (int t = 0; t < NT; ++t) res[t * os] = _mm512_reduce_add_ps(facc[t]);
}

static void dot_nvfp4(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                      const uint8_t* const* acts, int ntok, float* out, int64_t os) {
  const int64_t sbytes = w.K / 16;
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const uint8_t* wrow = w.row(e, r);
    const uint8_t* wsc = w.scales + (e * w.N + r) * sbytes;
    float* o = out + (r - r0);
    int t = 0;
    for (; t + 4 <= ntok; t += 4) row_dot<4>(wrow, wsc, w.K, acts + t, o + t * os, os);
    switch (ntok - t) {
      case 3: row_dot<3>(wrow, wsc, w.K, acts + t, o + t * os, os); break;
      case 2: row_dot<2>(wrow, wsc, w.K, acts + t, o + t * os, os); break;
      case 1: row_dot<1>(wrow, wsc, w.K, acts + t, o + t * os, os); break;
      default: break;
    }
  }
}

}  // namespace avx512_vnni_tier

const Kernels& kernels_avx512_vnni() {
  static const Kernels k = [] {
    Kernels t = kernels_avx512();
    t.name = "avx512_vnni";
    t.fmt[static_cast<int>(Fmt::NVFP4)] =
        FormatKernels{nvfp4_q8_bytes, avx512_vnni_tier::prep_nvfp4_q8, avx512_vnni_tier::dot_nvfp4};
    return t;
  }();
  return k;
}

}  // namespace ft
