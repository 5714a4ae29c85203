// AVX-512 VNNI tier: the 512-bit NVFP4 W4A8 kernel (nvfp4_dot512.h; its vpermb variant from
// tier_avx512_vbmi.cpp where the CPU has AVX-512 VBMI) and its SIMD activation quant.
// Everything else comes from the AVX-512 tier's table.
#include <immintrin.h>

#include <cstdlib>

#include "common.h"
#include "cpu_features.h"
#include "nvfp4_dot512.h"

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

}  // namespace avx512_vnni_tier

// The vpermb dot where the CPU has AVX-512 VBMI, unless FREETOKEN_CPU_MOE_NO_VBMI=1 (read at
// each call, so every executor built afterwards follows it).
const Kernels& kernels_avx512_vnni() {
  auto make = [](DotFn dot) {
    Kernels t = kernels_avx512();
    t.name = "avx512_vnni";
    t.fmt[static_cast<int>(Fmt::NVFP4)] =
        FormatKernels{nvfp4_q8_bytes, avx512_vnni_tier::prep_nvfp4_q8, dot};
    return t;
  };
  static const Kernels plain = make(dot512::dot_nvfp4<false>);
  static const Kernels vbmi = make(nvfp4_dot_avx512_vbmi);
  const char* off = std::getenv("FREETOKEN_CPU_MOE_NO_VBMI");
  const bool use = detect_cpu().avx512_vbmi && !(off && off[0] && std::string(off) != "0");
  return use ? vbmi : plain;
}

}  // namespace ft
