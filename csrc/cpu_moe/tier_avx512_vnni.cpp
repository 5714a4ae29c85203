// AVX-512 VNNI tier: the 512-bit NVFP4 W4A8 kernel (nvfp4_dot512.h; its vpermb variant from
// tier_avx512_vbmi.cpp where the CPU has AVX-512 VBMI) and its SIMD activation quant (the 16-lane
// layout of common.h).
// Everything else comes from the AVX-512 tier's table.
#include <immintrin.h>

#include <cstdlib>

#include "common.h"
#include "cpu_features.h"
#include "nvfp4_dot512.h"

namespace ft {


namespace avx512_vnni_tier {

// ---------------------------------------------------------------------------
// activation quant in the 16-lane layout (bit-identical to nvfp4_q8_prep_scalar(kQ8x16))
// ---------------------------------------------------------------------------
static void prep_nvfp4_q8(const float* x, int64_t K, uint8_t* out) {
  std::memset(out, 0, kQ8x16.bytes(K));
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  // dword v of the shuffled block = the 4 values vector v of the group takes
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t b = 0; b < K / 16; ++b) {
    uint8_t* sc = out + (b / 16) * kQ8x16.group_bytes();
    const int j = static_cast<int>(b % 16);
    const __m512 v = _mm512_loadu_ps(x + b * 16);
    const float amax = _mm512_reduce_max_ps(_mm512_and_ps(v, absmask));
    if (!(amax >= kMinAmax)) continue;  // zeros, scale 0 (already cleared)
    const float inv = 127.0f / amax;
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));
    q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    const __m128i q8 = _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q), split);
    const int32_t d[4] = {_mm_cvtsi128_si32(q8), _mm_extract_epi32(q8, 1),
                          _mm_extract_epi32(q8, 2), _mm_extract_epi32(q8, 3)};
    for (int u = 0; u < 4; ++u) std::memcpy(sc + 64 * u + 4 * j, &d[u], 4);
    reinterpret_cast<int32_t*>(sc + 256)[j] = -12 * _mm512_reduce_add_epi32(q);
    reinterpret_cast<float*>(sc + 320)[j] = (amax / 127.0f) * 128.0f;
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
        FormatKernels{nvfp4_q8x16_bytes, avx512_vnni_tier::prep_nvfp4_q8, dot};
    return t;
  };
  static const Kernels plain = make(dot512::dot_nvfp4<false>);
  static const Kernels vbmi = make(nvfp4_dot_avx512_vbmi);
  const char* off = std::getenv("FREETOKEN_CPU_MOE_NO_VBMI");
  const bool use = detect_cpu().avx512_vbmi && !(off && off[0] && std::string(off) != "0");
  return use ? vbmi : plain;
}

}  // namespace ft
