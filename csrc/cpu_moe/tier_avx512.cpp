// AVX-512 tier (-mavx512f/bw/vl/dq -mfma -mf16c, no VNNI): the portable kernels vectorized to
// 512 bits; NVFP4 runs the fp32 W4A16 path. Also the 512-bit streaming read (the ceiling).
#include <immintrin.h>

#include "common.h"

namespace ft {
namespace avx512_tier {
#include "generic_kernels.h"

// Streaming loads (vmovntdqa) over 256 bytes per step, 4 independent accumulators.
static uint64_t stream_read_avx512(const uint8_t* p, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 256) {
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
}  // namespace avx512_tier

const Kernels& kernels_avx512() {
  static const Kernels k = [] {
    Kernels t = avx512_tier::make_generic_table("avx512_fp32");
    t.stream_read = avx512_tier::stream_read_avx512;
    return t;
  }();
  return k;
}

}  // namespace ft
