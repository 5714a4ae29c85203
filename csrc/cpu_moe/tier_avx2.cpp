// AVX2 tier (-mavx2 -mfma -mf16c, no VNNI): the portable kernels vectorized to 256 bits;
// NVFP4 runs the fp32 W4A16 path. Also the 256-bit streaming read.
#include <immintrin.h>

#include "common.h"

namespace ft {
namespace avx2_tier {
#include "generic_kernels.h"

static uint64_t stream_read_avx2(const uint8_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 128) {
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
}  // namespace avx2_tier

const Kernels& kernels_avx2() {
  static const Kernels k = [] {
    Kernels t = avx2_tier::make_generic_table("avx2_fp32");
    t.stream_read = avx2_tier::stream_read_avx2;
    return t;
  }();
  return k;
}

}  // namespace ft
