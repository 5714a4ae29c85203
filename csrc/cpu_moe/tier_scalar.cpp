// Scalar tier: the portable kernels compiled with no ISA flags (fp32 W4A16 for NVFP4).
#include "common.h"

namespace ft {
namespace scalar_tier {
#include "generic_kernels.h"
}  // namespace scalar_tier

const Kernels& kernels_scalar() {
  static const Kernels k = scalar_tier::make_generic_table("scalar");
  return k;
}

// The scalar NVFP4 W4A8 activation quant, the reference the SIMD quants must match, in the
// layout of 16 lanes (the 512-bit dot's) or 8 (the 256-bit dot's).
void nvfp4_q8_prep_reference(const float* x, int64_t K, uint8_t* out, int lanes) {
  scalar_tier::nvfp4_q8_prep_scalar(lanes == 16 ? kQ8x16 : kQ8x8, x, K, out);
}

}  // namespace ft
