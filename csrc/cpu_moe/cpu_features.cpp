// Run-time ISA detection and tier selection. Behaviour of the switches (the seed design):
//  - cap avx512 (or none): AVX-512 VNNI W4A8 if present and not switched off; else, without
//    AVX-512 VNNI, AVX-VNNI W4A8 (256-bit) if present and VNNI allowed; else fp32 W4A16.
//  - cap avx2: AVX-VNNI W4A8 if present (a CPU with AVX-512 VNNI but no AVX-VNNI, such as
//    Ice Lake-SP or Zen 4, runs the fp32 W4A16 kernel); NO_VNNI gives fp32.
//  - cap scalar: the scalar fp32 kernels.
// A cap above what the CPU has falls back to the best tier below it.
#include "cpu_features.h"

#include <chrono>

#include <cpuid.h>

#include <cstdlib>
#include <stdexcept>

namespace ft {

// 4 KiB: one 4-row group ahead at K = 2048; 4-16 KiB measured alike (2-thread DRAM dot)
constexpr int64_t PF_DEFAULT = 4096;
// 16 KiB into L2: 8-32 KiB measured alike (1-thread DRAM dot)
constexpr int64_t PF_L2_DEFAULT = 16384;

// ============================================================================
// detection
// ============================================================================
static uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect_cpu() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return f;
  const uint64_t xcr0 = xgetbv0();
  const bool ymm_os = (xcr0 & 0x6) == 0x6;     // SSE + AVX state
  const bool zmm_os = (xcr0 & 0xe6) == 0xe6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5);
  const bool a512f = b & (1u << 16), a512dq = b & (1u << 17), a512bw = b & (1u << 30);
  const bool a512vl = b & (1u << 31), a512vnni = c & (1u << 11), a512vbmi = c & (1u << 1);
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool avxvnni = a1 & (1u << 4);
  f.avx2 = ymm_os && avx2 && fma && f16c;
  f.avx_vnni = f.avx2 && avxvnni;
  f.avx512 = f.avx2 && zmm_os && a512f && a512dq && a512bw && a512vl;
  f.avx512_vnni = f.avx512 && a512vnni;
  f.avx512_vbmi = f.avx512 && a512vbmi;
  return f;
}

// ============================================================================
// selection
// ============================================================================
static const Kernels& by_name(const std::string& name, const CpuFeatures& f) {
  if (name == "scalar") return kernels_scalar();
  if (name == "avx2_fp32" && f.avx2) return kernels_avx2();
  if (name == "avx2_vnni" && f.avx_vnni) return kernels_avx2_vnni();
  if (name == "avx512_fp32" && f.avx512) return kernels_avx512();
  if (name == "avx512_vnni" && f.avx512_vnni) return kernels_avx512_vnni();
  throw std::invalid_argument("isa: tier '" + name + "' is unknown or not supported by this " +
                              "CPU (supported: " + supported_tiers() + ")");
}

const Kernels& select_tier(const std::string& isa, bool no_vnni, bool no_avx512vnni) {
  const CpuFeatures f = detect_cpu();
  if (isa.find('_') != std::string::npos) return by_name(isa, f);
  if (isa != "" && isa != "avx512" && isa != "avx2" && isa != "scalar")
    throw std::invalid_argument("isa must be scalar, avx2, avx512 or a tier name, got '" + isa + "'");
  if (isa == "scalar") return kernels_scalar();
  if ((isa == "" || isa == "avx512") && f.avx512) {
    if (f.avx512_vnni && !no_vnni && !no_avx512vnni) return kernels_avx512_vnni();
    if (f.avx_vnni && !no_vnni) return kernels_avx2_vnni();
    return kernels_avx512();
  }
  if (f.avx2) {
    if (f.avx_vnni && !no_vnni) return kernels_avx2_vnni();
    return kernels_avx2();
  }
  return kernels_scalar();
}

std::string supported_tiers() {
  const CpuFeatures f = detect_cpu();
  std::string s;
  if (f.avx512_vnni) s += "avx512_vnni, ";
  if (f.avx_vnni) s += "avx2_vnni, ";
  if (f.avx512) s += "avx512_fp32, ";
  if (f.avx2) s += "avx2_fp32, ";
  return s + "scalar";
}

// Bytes from an environment variable (rounded down to 64), `dflt` when unset or not a number.
static int64_t env_bytes(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !v[0]) return dflt;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return (end && *end == 0 && x >= 0) ? static_cast<int64_t>(x) / 64 * 64 : dflt;
}

int64_t prefetch_bytes() {
  static const int64_t d = env_bytes("FREETOKEN_CPU_MOE_PREFETCH", PF_DEFAULT);
  return d;
}

int64_t prefetch_l2_bytes() {
  static const int64_t d = env_bytes("FREETOKEN_CPU_MOE_PREFETCH_L2", PF_L2_DEFAULT);
  return d;
}

double core_clock_ghz(double seconds) {
  using Clock = std::chrono::steady_clock;
  uint64_t x = 3, n = 0;
  const auto t0 = Clock::now();
  double dt = 0;
  do {
    for (int i = 0; i < 100000; ++i) {  // 8 dependent imuls an iteration
      asm volatile(
          "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
          "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0"
          : "+r"(x));
    }
    n += 800000;
    dt = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (dt < seconds);
  return 3.0 * static_cast<double>(n) / dt / 1e9;
}

}  // namespace ft
