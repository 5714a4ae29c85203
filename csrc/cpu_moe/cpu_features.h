// Run-time ISA detection (cpuid + xgetbv) and the choice of the kernel tier.
#pragma once

#include <string>

#include "common.h"

namespace ft {

struct CpuFeatures {
  bool avx2 = false;        // AVX2 + FMA + F16C, OS saves ymm state
  bool avx_vnni = false;    // AVX-VNNI (256-bit vpdpbusd)
  bool avx512 = false;      // AVX-512 F/BW/VL/DQ, OS saves zmm + opmask state
  bool avx512_vnni = false;
  bool avx512_vbmi = false; // vpermb (byte permutes over 64 bytes)
};

CpuFeatures detect_cpu();

// The tier for a cap ("" = best, "scalar", "avx2", "avx512") and the two VNNI switches, as
// FREETOKEN_CPU_MOE_ISA / _NO_VNNI / _NO_AVX512VNNI define them; or a tier by its name
// ("avx512_vnni", "avx2_vnni", "avx512_fp32", "avx2_fp32", "scalar"), which must be supported.
// Throws std::invalid_argument for an unknown name or a tier this CPU lacks.
const Kernels& select_tier(const std::string& isa, bool no_vnni, bool no_avx512vnni);

// Tier names this CPU can run, best first.
std::string supported_tiers();

// The calling core's clock in GHz, from a chain of dependent 64-bit multiplies (3 cycles each
// on every x86-64 core since Sandy Bridge) run for about `seconds`: the benchmark's B/cycle.
double core_clock_ghz(double seconds);

}  // namespace ft
