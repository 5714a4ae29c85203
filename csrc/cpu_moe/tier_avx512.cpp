// AVX-512 tier (-mavx512f/bw/vl/dq -mfma -mf16c, no VNNI): the portable kernels vectorized to
// 512 bits; NVFP4 runs the fp32 W4A16 path. Also the 512-bit streaming read (the ceiling).
#include <immintrin.h>

#include "common.h"

namespace ft {
namespace avx512_tier {
#include "generic_kernels.h"

// Streaming loads (vmovntdqa) over 256 bytes per step, 4 independent accumulators.
static uint64_t stream_read_avx512(const uint8_t* p, int64_t n, int64_t dist) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 256) {
    if (dist > 0 && i + dist < n) prefetch_lines(p + i + dist, 4);
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

// ---------------------------------------------------------------------------
// NVFP4 fp32 W4A16 (CPUs without VNNI): 16 codes -> fp32 with one vpermps from the E2M1
// table, times the block's E4M3 scale, FMA with fp32 activations. 16 lanes per token.
// ---------------------------------------------------------------------------
struct RowF32 {  // one row against NT tokens (dot_nvfp4_rows of generic_kernels.h)
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

}  // namespace avx512_tier

const Kernels& kernels_avx512() {
  static const Kernels k = [] {
    Kernels t = avx512_tier::make_generic_table("avx512_fp32");
    t.stream_read = avx512_tier::stream_read_avx512;
    t.fmt[static_cast<int>(Fmt::NVFP4)].dot = avx512_tier::dot_nvfp4_rows<avx512_tier::RowF32>;
    return t;
  }();
  return k;
}

}  // namespace ft
