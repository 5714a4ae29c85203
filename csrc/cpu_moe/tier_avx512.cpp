// AVX-512 tier (-mavx512f/bw/vl/dq -mfma -mf16c, no VNNI): the portable kernels vectorized to
// 512 bits; NVFP4 runs the fp32 W4A16 path. Also the 512-bit streaming read (the ceiling).
#include <immintrin.h>

#include "common.h"

namespace ft {
namespace avx512_tier {
#include "generic_kernels.h"

// Streaming loads (vmovntdqa) over 256 bytes per step, 4 independent accumulators.
static uint64_t stream_read_avx512(const uint8_t* p, int64_t n, int64_t dist, int64_t far) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 256) {
    if (dist > 0 && i + dist < n) prefetch_lines(p + i + dist, 4);
    if (far > 0 && i + far < n) prefetch_lines_l2(p + i + far, 4);
    a0 = _mm512_xor_si512(a0, _mm512_stream_load_si512((void*)(p + i)));
    a1 = _mm512_xor_si512(a1, _mm512_stream_load_si512((void*)(p + i + 64)));
    a2 = _mm512_xor_si512(a2, _mm512_stream_load_si512((void*)(p + i + 128)));
    a3 = _mm512_xor_si512(a3, _mm512_stream_load_si512((void*)(p + i + 192)));
  }
  a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  alignas(64) uint64_t t[8];
  _mm512_store_si512(t, a0);
  return t[0] ^ t[1] ^ t[2] ^ t[3] ^ t[4] ^ t[5] ^ t[6] ^ t[7];
}

#include "simd_glu.h"

// ---------------------------------------------------------------------------
// NVFP4 fp32 W4A16 (CPUs without VNNI): 16 codes -> fp32 with one vpermps from the E2M1
// table, times the block's E4M3 scale, FMA with fp32 activations. 16 lanes per token.
// ---------------------------------------------------------------------------
struct RowF32 {  // one row against NT tokens (Nvfp4Row of generic_kernels.h)
  template <int NT>
  static void run(const uint8_t* wrow, const uint8_t* wsc, int64_t K, const uint8_t* const* a,
                  float* res, int64_t os) {
    const float* e4m3 = e4m3_table();
    const __m512 table = _mm512_loadu_ps(kE2M1);
    const __m512i shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 16; ++b) {
      const __m128i by = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wrow + b * 8));
      const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(by, by)), shifts);
      const __m512 w = _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), _mm512_set1_ps(e4m3[wsc[b]]));
      for (int t = 0; t < NT; ++t)
        acc[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(reinterpret_cast<const float*>(a[t]) + b * 16), acc[t]);
    }
    for (int t = 0; t < NT; ++t) res[t * os] = _mm512_reduce_add_ps(acc[t]);
  }
};

// The Q8_32 activation quant of the GGUF formats, 32 values a step: the same int8 values,
// scales and sums as quant_block_scalar (cvtps_epi32 rounds half to even, as nearbyint does
// in the default rounding mode; blocks below kMinAmax become zeros with scale 0).
static void q8_32_prep_avx512(const float* x, int64_t K, uint8_t* out) {
  int8_t* q = reinterpret_cast<int8_t*>(out);
  float* d = reinterpret_cast<float*>(out + K);
  int32_t* s = reinterpret_cast<int32_t*>(out + K + (K / 32) * 4);
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
    if (!(amax >= kMinAmax)) {
      std::memset(q + b * 32, 0, 32);
      d[b] = 0.0f;
      s[b] = 0;
      continue;
    }
    const __m512 inv = _mm512_set1_ps(127.0f / amax);
    const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), hi), lo);
    const __m512i q1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), hi), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
    d[b] = amax / 127.0f;
    s[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// GGUF integer formats without VNNI: the 256-bit kernels of gguf_dot256.h with vpdpbusd done
// as vpmaddubsw + vpmaddwd (llama.cpp's AVX2 way). Exact: vpmaddubsw saturates a pair sum at
// +-32767, and the largest here is 2 x 128 x 127 = 32512 (Q8_0's |w| = 128 for w = -128; Q6_K
// 63, Q4_K / Q4_0 15; activations within [-127, 127]).
struct MaddDp {
  static __m256i dp(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
};
#include "gguf_dot256.h"
#include "gguf_dequant256.h"

}  // namespace avx512_tier

void q8_32_prep_avx512(const float* x, int64_t K, uint8_t* out) {
  avx512_tier::q8_32_prep_avx512(x, K, out);
}

const Kernels& kernels_avx512() {
  static const Kernels k = [] {
    Kernels t = avx512_tier::make_generic_table("avx512_fp32");
    t.stream_read = avx512_tier::stream_read_avx512;
    t.glu = avx512_tier::glu_simd<avx512_tier::F16>;
    t.fmt[static_cast<int>(Fmt::NVFP4)].dot = dot_rows_by_token_groups<avx512_tier::Nvfp4Row<avx512_tier::RowF32>>;
    avx512_tier::gguf256::set_preps<avx512_tier::q8_32_prep_avx512>(t);
    avx512_tier::gguf256::set_dots<avx512_tier::MaddDp>(t);
    avx512_tier::gguf256::set_dequants(t);
    return t;
  }();
  return k;
}

}  // namespace ft
