// AVX2 tier (-mavx2 -mfma -mf16c, no VNNI): the portable kernels vectorized to 256 bits;
// NVFP4 runs the fp32 W4A16 path. Also the 256-bit streaming read.
#include <immintrin.h>

#include <climits>

#include "common.h"

namespace ft {
namespace avx2_tier {
#include "generic_kernels.h"

static uint64_t stream_read_avx2(const uint8_t* p, int64_t n, int64_t dist, int64_t far) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 128) {
    if (dist > 0 && i + dist < n) prefetch_lines(p + i + dist, 2);
    if (far > 0 && i + far < n) prefetch_lines_l2(p + i + far, 2);
    a0 = _mm256_xor_si256(a0, _mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  alignas(32) uint64_t t[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), a0);
  return t[0] ^ t[1] ^ t[2] ^ t[3];
}

#include "simd_glu.h"

// ---------------------------------------------------------------------------
// NVFP4 fp32 W4A16 (CPUs without VNNI): 8 codes -> |E2M1| with one vpermps, the sign bit
// moved in by a shift, times the block's E4M3 scale; FMA with fp32 activations.
// ---------------------------------------------------------------------------
static inline __m256 decode8(__m128i bytes4x2, __m256 table) {  // 8 dup'd bytes -> 8 values
  const __m256i shifts = _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0);
  const __m256i code = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(bytes4x2), shifts);
  const __m256 mag = _mm256_permutevar8x32_ps(table, code);
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 28), _mm256_set1_epi32(INT32_MIN));
  return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

struct RowF32 {  // one row against NT tokens (Nvfp4Row of generic_kernels.h)
  template <int NT>
  static void run(const uint8_t* wrow, const uint8_t* wsc, int64_t K, const uint8_t* const* a,
                  float* res, int64_t os) {
    const float* e4m3 = e4m3_table();
    const __m256 table = _mm256_loadu_ps(kE2M1);
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 16; ++b) {
      const __m128i by = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wrow + b * 8));
      const __m128i dup = _mm_unpacklo_epi8(by, by);
      const __m256 s = _mm256_set1_ps(e4m3[wsc[b]]);
      const __m256 w0 = _mm256_mul_ps(decode8(dup, table), s);
      const __m256 w1 = _mm256_mul_ps(decode8(_mm_unpackhi_epi64(dup, dup), table), s);
      for (int t = 0; t < NT; ++t) {
        const float* x = reinterpret_cast<const float*>(a[t]) + b * 16;
        acc[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[t]);
        acc[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
      v = _mm_add_ps(v, _mm_movehl_ps(v, v));
      res[t * os] = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
    }
  }
};

// The Q8_32 activation quant of the GGUF formats, 32 values a step: the same int8 values,
// scales and sums as quant_block_scalar (cvtps_epi32 rounds half to even, as nearbyint does
// in the default rounding mode; blocks below kMinAmax become zeros with scale 0).
static void q8_32_prep_avx2(const float* x, int64_t K, uint8_t* out) {
  int8_t* q = reinterpret_cast<int8_t*>(out);
  float* d = reinterpret_cast<float*>(out + K);
  int32_t* s = reinterpret_cast<int32_t*>(out + K + (K / 32) * 4);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' lane split
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    if (!(amax >= kMinAmax)) {
      std::memset(q + b * 32, 0, 32);
      d[b] = 0.0f;
      s[b] = 0;
      continue;
    }
    const __m256 inv = _mm256_set1_ps(127.0f / amax);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i)
      qi[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), hi), lo);
    const __m256i q8 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), q8);
    d[b] = amax / 127.0f;
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    s[b] = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
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

}  // namespace avx2_tier

const Kernels& kernels_avx2() {
  static const Kernels k = [] {
    Kernels t = avx2_tier::make_generic_table("avx2_fp32");
    t.stream_read = avx2_tier::stream_read_avx2;
    t.glu = avx2_tier::glu_simd<avx2_tier::F8>;
    t.fmt[static_cast<int>(Fmt::NVFP4)].dot = dot_rows_by_token_groups<avx2_tier::Nvfp4Row<avx2_tier::RowF32>>;
    avx2_tier::gguf256::set_preps<avx2_tier::q8_32_prep_avx2>(t);
    avx2_tier::gguf256::set_dots<avx2_tier::MaddDp>(t);
    avx2_tier::gguf256::set_dequants(t);
    return t;
  }();
  return k;
}

}  // namespace ft
