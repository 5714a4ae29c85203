// The 512-bit NVFP4 W4A8 dot with vpermb (AVX-512 VBMI): compiled with -mavx512vbmi and called
// only where cpuid reports VBMI (see kernels_avx512_vnni()).
#include "nvfp4_dot512.h"

namespace ft {

void nvfp4_dot_avx512_vbmi(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                           const uint8_t* const* acts, int ntok, float* out, int64_t os,
                           const ReadNext& next) {
  dot512::dot_nvfp4<true>(w, e, r0, nrows, acts, ntok, out, os, next);
}

}  // namespace ft
