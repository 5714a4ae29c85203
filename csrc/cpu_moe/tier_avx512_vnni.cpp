// AVX-512 VNNI tier: the 512-bit NVFP4 W4A8 kernel (nvfp4_dot512.h; its vpermb variant from
// tier_avx512_vbmi.cpp where the CPU has AVX-512 VBMI) and its SIMD activation quant (the 16-lane
// layout of common.h); vpdpbusd kernels for the GGUF Q4_K and Q6_K (512-bit, here), Q5_K at one
// token (512-bit, here) and Q8_0 and Q4_0 (256-bit, gguf_dot256.h). Everything else comes from
// the AVX-512 tier's table.
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
    for (int u = 0; u < 4; ++u) std::memcpy(sc + kQ8x16.vec(u) + 4 * j, &d[u], 4);
    reinterpret_cast<int32_t*>(sc + kQ8x16.bias())[j] = -12 * _mm512_reduce_add_epi32(q);
    reinterpret_cast<float*>(sc + kQ8x16.scale())[j] = (amax / 127.0f) * 128.0f;
  }
}

// ---------------------------------------------------------------------------
// GGUF integer formats, vpdpbusd
// ---------------------------------------------------------------------------
// The 256-bit GGUF kernels (gguf_dot256.h) with the EVEX vpdpbusd on ymm.
struct EvexDp {
  static __m256i dp(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
};
#include "gguf_dot256.h"

// The R-row Q4_K / Q5_K kernels' activation terms of super-block b: [da, da] (both halves the
// 8 scales of the super-block) and [0, float(sa)] (the 8 sums in the upper half).
static inline __m512 k_da2(const uint8_t* A, int64_t K, int64_t b) {
  return _mm512_broadcast_f32x8(_mm256_loadu_ps(reinterpret_cast<const float*>(A + K) + b * 8));
}
static inline __m512 k_sa2(const uint8_t* A, int64_t K, int64_t b) {
  return _mm512_insertf32x8(_mm512_setzero_ps(), _mm256_cvtepi32_ps(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(A + K + K / 8 + b * 32))), 1);
}
// The mins' sum of the R-row kernels: lanes 8-15 of accm as hsum8 adds them.
static inline float k_mins_sum(__m512 accm) { return hsum8(_mm512_extractf32x8_ps(accm, 1)); }

// The shuffles of KHeaders, made once per row group (outside the super-block loop).
struct KHeaderConsts {
  // Header bytes (per 128-bit lane = one row): 0-1 d, 2-3 dmin, 4-15 s[0..11]. Output bytes
  // 0-7 sc[0..7], 8-15 m[0..7]: sc[j<4] = s[j] & 63, m[j<4] = s[j+4] & 63,
  // sc[j>=4] = (s[j+4] & 15) | (s[j-4] >> 6) << 4, m[j>=4] = (s[j+4] >> 4) | (s[j] >> 6) << 4.
  // P: the low bits' bytes (m[4..7]'s shifted down 4 by a word shift), Q: the top 2 bits.
  const __m512i idxP = _mm512_broadcast_i32x4(
      _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i idxQ = _mm512_broadcast_i32x4(
      _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m512i shP = _mm512_broadcast_i32x4(_mm_setr_epi16(0, 0, 0, 0, 0, 0, 4, 4));
  const __m512i mP = _mm512_broadcast_i32x4(
      _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  const __m512i m30 = _mm512_set1_epi8(0x30);
  const __m512i dd_idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
};

// The headers of R Q4_K / Q5_K rows' super-blocks (`blk0`, rows `rb` bytes apart), unpacked
// together: their 6-bit scales and mins in one vector (two vpshufb, a word shift, one ternary
// logic) instead of scalar shifts and a store / reload per row, their fp16 d, dmin converted
// at once. factors(r) = [d * sc[0..7], dmin * m[0..7]] of row r: d * sc is exact in fp32
// (11 x 6 significant bits), so its lanes equal q4k_factors' dsc, dmn exactly.
template <int R>
struct KHeaders {
  alignas(64) uint8_t scm[64];  // row r: sc[0..7], m[0..7] at 16r
  __m256 dd;                    // [d0, dmin0, d1, dmin1, ...]
  [[gnu::always_inline]] KHeaders(const uint8_t* blk0, int64_t rb, const KHeaderConsts& k) {
    static_assert(R <= 4, "one header a 128-bit lane");
    auto hdr = [&](int r) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk0 + r * rb));
    };
    __m512i H = _mm512_castsi128_si512(hdr(0));
    if constexpr (R > 1) H = _mm512_inserti32x4(H, hdr(1), 1);
    if constexpr (R > 2) H = _mm512_inserti32x4(H, hdr(2), 2);
    if constexpr (R > 3) H = _mm512_inserti32x4(H, hdr(3), 3);
    const __m512i P = _mm512_srlv_epi16(_mm512_shuffle_epi8(H, k.idxP), k.shP);
    const __m512i Q = _mm512_and_si512(_mm512_srli_epi16(_mm512_shuffle_epi8(H, k.idxQ), 2),
                                       k.m30);
    _mm512_store_si512(scm, _mm512_ternarylogic_epi32(P, k.mP, Q, 0xea));  // (P & mP) | Q
    dd = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi32(k.dd_idx, H)));
  }
  [[gnu::always_inline]] __m512 factors(int r) const {
    // lanes of dd for row r: [2r x 8, 2r + 1 x 8], from memory (as constants made in the
    // loop they took three instructions a row)
    alignas(64) static constexpr int32_t kDm[4][16] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
        {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
        {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
        {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7}};
    const __m512 DM = _mm512_permutexvar_ps(  // [d x 8, dmin x 8]
        _mm512_load_si512(kDm[r]), _mm512_castps256_ps512(dd));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                             _mm_load_si128(reinterpret_cast<const __m128i*>(scm + 16 * r)))), DM);
  }
};

// ---------------------------------------------------------------------------
// GGUF Q4_K x int8: a lane per half sub-block, vpdpbusd
// ---------------------------------------------------------------------------
// A super-block is 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins of 8
// sub-blocks of 32, 128 bytes of nibbles (group g of 32 bytes: byte k's low nibble is value k of
// sub-block 2g, its high nibble value k of sub-block 2g + 1). Value = d * sc[s] * q - dmin *
// m[s]; against int8 activations with a scale da[s] and a sum sa[s] per 32 (Q8_32): sum_s
// da[s] * (d * sc[s] * sum(q * a) - dmin * m[s] * sa[s]).
//
// Int32 lane j of the dot holds half j % 2 (values 0-15 or 16-31) of sub-block j / 2 through
// four vpdpbusd, as the NVFP4 dot holds a block a lane: one int -> float convert and one FMA per
// super-block and row, where a lane per 4 values (the 256-bit kernels) takes four of each and a
// factor shuffle per 64 values. The nibbles come to those lanes by one vpermt2d of the
// super-block's two 64-byte loads per vector (vector v, lane j: dword 8 (j / 4) + 4 (j % 2) + v
// of the 128 bytes) and one AND: low nibbles where j / 2 is even, high nibbles left in place
// (16 q, 0..240) where it is odd, their factor divided by 16 (a power of two: the same products
// to the bit, and 16 x 4 x 15 x 127 x 4 < 2^24 keeps the lane's integer exact in fp32). The
// activations come in that order already (q4k_lanes_prep). One core, L2, K = 2048 (Emerald
// Rapids, benchmarks/ab_cpu_dot_l2.py, 6 alternated rounds, median of each round's best):
// 20.2 -> 23.7 GB/s against the lane-per-4-values kernel it replaced (a GFNI nibble split,
// 4 rows a call). Without the headers' factors (a constant instead) it read 29 GB/s: a
// quarter of the time is the 6-bit scales and mins (KHeaders, factors); precomputing the
// factors of 8 super-blocks in a pass of their own, as the kernel before did, was slower here
// (21.0 against 21.8 in the same session).

// The Q4_K activations of this tier: Q8_32 (common.h) with each super-block's 256 int8 values
// reordered for the lanes above: byte 64 v + 4 j + i holds value 16 (j % 2) + 4 v + i of
// sub-block j / 2 (dword 16 v + j from dword 8 (j / 2) + 4 (j % 2) + v). The scales and sums
// per 32 follow as in Q8_32.
static void q4k_lanes_prep(const float* x, int64_t K, uint8_t* out) {
  q8_32_prep_avx512(x, K, out);
  __m512i idx[4];  // dwords 0-31 of the super-block for lanes 0-7, 32-63 for lanes 8-15
  for (int v = 0; v < 4; ++v) {
    alignas(64) int32_t ix[16];
    for (int j = 0; j < 16; ++j) ix[j] = (8 * (j / 2) + 4 * (j % 2) + v) & 31;
    idx[v] = _mm512_load_si512(ix);
  }
  for (int64_t b = 0; b < K / 256; ++b) {
    uint8_t* q = out + 256 * b;
    __m512i s[4], d[4];
    for (int i = 0; i < 4; ++i) s[i] = _mm512_loadu_si512(q + 64 * i);
    for (int v = 0; v < 4; ++v)
      d[v] = _mm512_mask_blend_epi32(0xff00, _mm512_permutex2var_epi32(s[0], idx[v], s[1]),
                                     _mm512_permutex2var_epi32(s[2], idx[v], s[3]));
    for (int v = 0; v < 4; ++v) _mm512_storeu_si512(q + 64 * v, d[v]);
  }
}

// The constants of the lane layout.
struct Q4KLanes {
  __m512i idx[4];  // vector v's dwords of [W0 | W1] (the super-block's nibble bytes)
  __m512i mask;    // 0x0f in the lanes of even sub-blocks, 0xf0 in the odd ones'
  __m512i dup;     // lane j <- lane j / 2: factors of sub-blocks to lanes
  __m512 half;     // [1, 1/16] x 4 (lanes 0-7: the odd sub-blocks' 16 q), then 1 x 8 (the mins)
  Q4KLanes() {
    alignas(64) int32_t ix[16];
    alignas(64) uint8_t mk[64];
    alignas(64) float hf[16];
    for (int v = 0; v < 4; ++v) {
      for (int j = 0; j < 16; ++j) ix[j] = 8 * (j / 4) + 4 * (j % 2) + v;
      idx[v] = _mm512_load_si512(ix);
    }
    for (int i = 0; i < 64; ++i) mk[i] = ((i / 4 / 2) % 2) ? 0xf0 : 0x0f;
    mask = _mm512_load_si512(mk);
    for (int j = 0; j < 16; ++j) ix[j] = j / 2;
    dup = _mm512_load_si512(ix);
    for (int j = 0; j < 16; ++j) hf[j] = (j < 8 && j % 2) ? 0.0625f : 1.0f;
    half = _mm512_load_ps(hf);
  }
};

// A row's super-block (144 bytes at blk) as the four unsigned vpdpbusd operands of the lanes.
[[gnu::always_inline]] static inline void q4k_lane_codes(const uint8_t* blk, const Q4KLanes& c,
                                                         __m512i P[4]) {
  const __m512i w0 = _mm512_loadu_si512(blk + 16), w1 = _mm512_loadu_si512(blk + 80);
  for (int v = 0; v < 4; ++v)
    P[v] = _mm512_and_si512(_mm512_permutex2var_epi32(w0, c.idx[v], w1), c.mask);
}

// One super-block of a row (codes P, factors F = [d sc, dmin m] of KHeaders) against one
// token's activation (super-block b, its da2 scaled by Q4KLanes::half): acc and accm as
// q4k_lanes_rows1 and q4k_lanes_row both take them, so their bits agree.
[[gnu::always_inline]] static inline void q4k_lane_step(const __m512i P[4], __m512 F,
                                                        const uint8_t* aq, __m512 dah, __m512 sa2,
                                                        const Q4KLanes& c, __m512& acc,
                                                        __m512& accm) {
  __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), P[0], _mm512_loadu_si512(aq));
  p = _mm512_dpbusd_epi32(p, P[1], _mm512_loadu_si512(aq + 64));
  p = _mm512_dpbusd_epi32(p, P[2], _mm512_loadu_si512(aq + 128));
  p = _mm512_dpbusd_epi32(p, P[3], _mm512_loadu_si512(aq + 192));
  const __m512 fz = _mm512_mul_ps(F, dah);  // [d sc da (/16 odd), dmin m da]
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(c.dup, fz), acc);
  accm = _mm512_fmadd_ps(fz, sa2, accm);
}

// A row's sum: acc's 16 lanes less the mins (lanes 8-15 of accm; its lanes 0-7 stay 0), as one
// vector through sum1 / sum4's tree (nvfp4_dot512.h): a subtraction a row where a second
// horizontal sum took about six instructions, and four rows reduced together where their
// rows are (K = 768, the 30B shape's down: three super-blocks a row).
static inline __m512 q4k_lane_total(__m512 acc, __m512 accm) { return _mm512_sub_ps(acc, accm); }
static inline __m128 q4k_lane_totals4(const __m512 acc[4], const __m512 accm[4]) {
  return dot512::sum4(q4k_lane_total(acc[0], accm[0]), q4k_lane_total(acc[1], accm[1]),
                      q4k_lane_total(acc[2], accm[2]), q4k_lane_total(acc[3], accm[3]));
}

// R rows (`rb` bytes apart) against one token, res[i] for row i; the activations' scales and
// sums and the rows' headers (KHeaders) once per super-block for the R rows.
template <int R>
static inline void q4k_lanes_rows1(const uint8_t* row0, int64_t rb, int64_t K, const uint8_t* A,
                                   float* res, const SpreadPrefetch<R>& pf) {
  const int64_t nsb = K / 256;
  const KHeaderConsts kh;
  const Q4KLanes c;
  __m512 acc[R], accm[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  auto pfs = pf.steps(nsb);
  for (int64_t b = 0; b < nsb; ++b) {
    pfs.step();
    const __m512 dah = _mm512_mul_ps(k_da2(A, K, b), c.half), sa2 = k_sa2(A, K, b);
    const uint8_t* blk0 = row0 + b * 144;
    const KHeaders<R> hd(blk0, rb, kh);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m512i P[4];
      q4k_lane_codes(blk0 + r * rb, c, P);
      q4k_lane_step(P, hd.factors(r), A + b * 256, dah, sa2, c, acc[r], accm[r]);
    }
  }
  if constexpr (R == 4) {
    _mm_storeu_ps(res, q4k_lane_totals4(acc, accm));
  } else {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) res[r] = dot512::sum1(q4k_lane_total(acc[r], accm[r]));
  }
}

// One row against NT tokens; res[t * os]: each row's codes and factors once for the tokens.
template <int NT>
static inline void q4k_lanes_row(const uint8_t* row, int64_t K, const uint8_t* const* acts,
                                 float* res, int64_t os) {
  const int64_t nsb = K / 256;
  const KHeaderConsts kh;
  const Q4KLanes c;
  __m512 acc[NT], accm[NT];
  for (int t = 0; t < NT; ++t) acc[t] = accm[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* blk = row + b * 144;
    const KHeaders<1> hd(blk, 0, kh);
    const __m512 F = hd.factors(0);
    __m512i P[4];
    q4k_lane_codes(blk, c, P);
    for (int t = 0; t < NT; ++t) {
      const uint8_t* A = acts[t];
      q4k_lane_step(P, F, A + b * 256, _mm512_mul_ps(k_da2(A, K, b), c.half), k_sa2(A, K, b), c,
                    acc[t], accm[t]);
    }
  }
  if constexpr (NT == 4) {
    alignas(16) float r4[4];
    _mm_store_ps(r4, q4k_lane_totals4(acc, accm));
    for (int t = 0; t < 4; ++t) res[t * os] = r4[t];
  } else {
    for (int t = 0; t < NT; ++t) res[t * os] = dot512::sum1(q4k_lane_total(acc[t], accm[t]));
  }
}

struct Q4KRow {
  template <int NT>
  static void run(const Bank& w, int64_t e, int64_t r, const uint8_t* const* acts, float* res,
                  int64_t os) {
    q4k_lanes_row<NT>(w.row(e, r), w.K, acts, res, os);
  }
  template <int R>
  static void rows1(const Bank& w, int64_t e, int64_t r, const uint8_t* act, float* res,
                    const SpreadPrefetch<R>& pf) {
    q4k_lanes_rows1<R>(w.row(e, r), w.row_bytes, w.K, act, res, pf);
  }
};

// ---------------------------------------------------------------------------
// GGUF Q5_K x int8 (Q8_32 activations): R rows at one token, 512-bit
// ---------------------------------------------------------------------------
// Q5_K is Q4_K's header, qh[32] (bit s of qh[l]: bit 4 of value l of sub-block s) and its
// nibbles (176-byte blocks). Several tokens take the 256-bit kernel (gguf256::q5k_row); R rows
// against one token take this one, its arithmetic lane for lane: vector g of a row holds
// sub-blocks 2g and 2g + 1 (group g's low and high nibbles), so its halves are two of the
// 256-bit kernel's four chains (acc[s % 4]): C[0] = (chains 0, 1) takes groups 0 and 2, C[1]
// = (2, 3) groups 1 and 3, in that kernel's order, and the sums add chain 0, 1, 2, 3 as it does.
// The rows' headers as Q4_K's (KHeaders); the qh bits by one 32-bit rotate a vector instead of a
// shift each 32 values. One core, L2, K = 2048 (a 2-core Zen 5): 27 -> 33 GB/s, from DRAM on one
// thread 24 -> 31.
template <int R>
static inline void q5k_rows1(const uint8_t* row0, int64_t rb, int64_t K, const uint8_t* A,
                             float* res, const SpreadPrefetch<R>& pf) {
  const int64_t nsb = K / 256;
  const KHeaderConsts kh;
  const __m512i m4 = _mm512_set1_epi8(0x0f), m10 = _mm512_set1_epi8(0x10);
  const __m512i nib = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512i rot[4], sel[4];  // group g: bit 2g / 2g + 1 of each qh byte to bit 4; f[2g], f[2g + 1]
  for (int g = 0; g < 4; ++g) {
    rot[g] = _mm512_inserti64x4(_mm512_set1_epi32((4 - 2 * g) & 31),
                                _mm256_set1_epi32((3 - 2 * g) & 31), 1);
    sel[g] = _mm512_inserti64x4(_mm512_set1_epi32(2 * g), _mm256_set1_epi32(2 * g + 1), 1);
  }
  // NOTE: the row loops unrolled early keep acc and accm in registers; unrolled later, GCC kept
  // them in memory too and stored all 12 every super-block (across the prefetch's asm).
  __m512 acc[R][2], accm[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    acc[r][0] = acc[r][1] = accm[r] = _mm512_setzero_ps();
  auto bcast32 = [](const uint8_t* p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  auto pfs = pf.steps(nsb);
  for (int64_t b = 0; b < nsb; ++b) {
    pfs.step();
    __m512i a[4];
    for (int g = 0; g < 4; ++g) a[g] = _mm512_loadu_si512(A + b * 256 + 64 * g);
    const __m512 da2 = k_da2(A, K, b), sa2 = k_sa2(A, K, b);
    const uint8_t* blk0 = row0 + b * 176;
    const KHeaders<R> hd(blk0, rb, kh);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 fz = _mm512_mul_ps(hd.factors(r), da2);  // [d sc da, dmin m da]
      const uint8_t* blk = blk0 + r * rb;
      const __m512i qh = bcast32(blk + 16);
      for (int g = 0; g < 4; ++g) {
        // 32-bit rotates by (4 - s) mod 32 move bit s of every byte to its bit 4
        const __m512i q = _mm512_ternarylogic_epi32(
            _mm512_and_si512(_mm512_srlv_epi16(bcast32(blk + 48 + 32 * g), nib), m4),
            _mm512_rolv_epi32(qh, rot[g]), m10, 0xf8);  // nibble | (qh bit & m10)
        __m512& c = acc[r][g % 2];
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, a[g]);
        c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(sel[g], fz), c);
      }
      accm[r] = _mm512_fmadd_ps(fz, sa2, accm[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {  // the 256-bit kernel's four chains, summed as it sums them
    const __m256 c[4] = {_mm512_castps512_ps256(acc[r][0]), _mm512_extractf32x8_ps(acc[r][0], 1),
                         _mm512_castps512_ps256(acc[r][1]), _mm512_extractf32x8_ps(acc[r][1], 1)};
    res[r] = gguf256::sum_chains<1>(c) - k_mins_sum(accm[r]);
  }
}

struct Q5KRow {
  template <int NT>
  static void run(const Bank& w, int64_t e, int64_t r, const uint8_t* const* acts, float* res,
                  int64_t os) {
    gguf256::q5k_row<EvexDp, NT>(w.row(e, r), w.K, acts, res, os);
  }
  template <int R>
  static void rows1(const Bank& w, int64_t e, int64_t r, const uint8_t* act, float* res,
                    const SpreadPrefetch<R>& pf) {
    q5k_rows1<R>(w.row(e, r), w.row_bytes, w.K, act, res, pf);
  }
};

// ---------------------------------------------------------------------------
// GGUF Q6_K x int8 (Q8_32 activations), vpdpbusd
// ---------------------------------------------------------------------------
// A super-block is 256 values in two halves of 128: ql (64 bytes a half: low nibbles values
// 0-31 and 32-63, high nibbles 64-95 and 96-127), qh (32 bytes a half: bits 0-1, 2-3, 4-5, 6-7
// complete those four runs to 6 bits), 16 int8 scales (one per 16 values), fp16 d.
// Value = d * sc[v / 16] * (q - 32). The 6-bit q is vpdpbusd's unsigned operand; the -32
// comes off once per super-block from the activation's sums per 16 values (q6k_prep). Lane j of a
// 64-value vector holds values 4j .. 4j + 3, so it belongs to one scale (16 values) and one
// activation scale (32): one FMA with d * sc * da accumulates it.
template <int NT>
static inline void q6k_row(const uint8_t* row, int64_t K, const uint8_t* const* acts, float* res,
                           int64_t os) {
  const int64_t nsb = K / 256;
  const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
  const __m512i z = _mm512_setzero_si512();
  // FS[i] = d * sc[i] * da[i / 2]; the lanes of vector (half h, v) take FS[8h + 4v + j / 4]
  const __m512i da_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i lane_idx[4] = {
      _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
      _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
      _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
      _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
  // two chains a token (vectors 0, 2 and 1, 3): see q4k_row; off: the -32 (q6k_prep)
  __m512 acc[NT], acc2[NT], off[NT];
  for (int t = 0; t < NT; ++t)
    acc[t] = _mm512_setzero_ps(), acc2[t] = _mm512_setzero_ps(), off[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* blk = row + b * 210;
    uint16_t dh;
    std::memcpy(&dh, blk + 208, 2);
    const __m512 S = _mm512_mul_ps(
        _mm512_set1_ps(_cvtsh_ss(dh)),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))));
    __m512i V[4];  // (half 0: values 0-63, 64-127; half 1: 128-191, 192-255)
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      const __m512i hlo = _mm512_and_si512(_mm512_slli_epi16(qh2, 4), m30);  // bits 0-1 / 2-3
      const __m512i hhi = _mm512_and_si512(qh2, m30);                        // bits 4-5 / 6-7
      V[2 * h] = _mm512_ternarylogic_epi32(ql, m4, hlo, 0xea);  // (ql & m4) | hlo
      V[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), m4, hhi, 0xea);
    }
    for (int t = 0; t < NT; ++t) {
      const uint8_t* A = acts[t];
      const uint8_t* aq = A + b * 256;
      const __m512 da = _mm512_castps256_ps512(
          _mm256_loadu_ps(reinterpret_cast<const float*>(A + K) + b * 8));
      const __m512 FS = _mm512_mul_ps(S, _mm512_permutexvar_ps(da_idx, da));
      for (int v = 0; v < 4; ++v) {
        const __m512i q = _mm512_dpbusd_epi32(z, V[v], _mm512_loadu_si512(aq + 64 * v));
        __m512& c = v % 2 ? acc2[t] : acc[t];
        c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_permutexvar_ps(lane_idx[v], FS), c);
      }
      // FS[i] * sum16[i] over the super-block's 16 runs: 32 x this is the codes' offset
      const __m512i s16 = _mm512_loadu_si512(A + q8_32_bytes(K) + 64 * b);
      off[t] = _mm512_fmadd_ps(FS, _mm512_cvtepi32_ps(s16), off[t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    res[t * os] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t])) -
                  32.0f * _mm512_reduce_add_ps(off[t]);
}

struct Q6KRow {
  template <int NT>
  static void run(const Bank& w, int64_t e, int64_t r, const uint8_t* const* acts, float* res,
                  int64_t os) {
    q6k_row<NT>(w.row(e, r), w.K, acts, res, os);
  }
};


}  // namespace avx512_vnni_tier

namespace {
bool switched_on(const char* name) {
  const char* v = std::getenv(name);
  return v && v[0] && std::string(v) != "0";
}
}  // namespace

// The vpermb dot where the CPU has AVX-512 VBMI, unless FREETOKEN_CPU_MOE_NO_VBMI=1 (read at
// each call, so every executor built afterwards follows it).
const Kernels& kernels_avx512_vnni() {
  const CpuFeatures cpu = detect_cpu();
  auto make = [](DotFn dot) {
    Kernels t = kernels_avx512();
    t.name = "avx512_vnni";
    t.fmt[static_cast<int>(Fmt::NVFP4)] =  // the W4A8 dot; the row decoder stays
        FormatKernels{nvfp4_q8x16_bytes, avx512_vnni_tier::prep_nvfp4_q8, dot, t.fmt[static_cast<int>(Fmt::NVFP4)].dequant};
    // The blocks of 32 (Q8_0, Q4_0, ...): the 256-bit kernels, one block a vector, beat 512-bit
    // ones that took two blocks a vector (1 core, L2, K = 2048: Q8_0 20.6 vs 16.0 and Q4_0 11.2
    // vs 9.0 GB/s: their two blocks' scales cost more than the wider vpdpbusd saves); Q4_K /
    // Q6_K: the 512-bit ones (14.7 vs 13.9, 18.5 vs 15.4); Q5_K the 256-bit one, and at one
    // token the 512-bit 4 rows at a time (Q4_K too). Q6_K 4 rows at a time (activations loaded
    // once for the 4) was no faster (1 core, L2, Zen 5: 43 vs 43 GB/s): it has no header to
    // unpack, and its loads of the activations were memory operands of vpdpbusd anyway.
    avx512_vnni_tier::gguf256::set_dots<avx512_vnni_tier::EvexDp>(t);
    t.fmt[static_cast<int>(Fmt::Q4_K)].prep = avx512_vnni_tier::q4k_lanes_prep;
    t.fmt[static_cast<int>(Fmt::Q4_K)].dot = dot_rows_by_token_groups<avx512_vnni_tier::Q4KRow, 4>;
    t.fmt[static_cast<int>(Fmt::Q6_K)].dot = dot_rows_by_token_groups<avx512_vnni_tier::Q6KRow>;
    t.fmt[static_cast<int>(Fmt::Q5_K)].dot = dot_rows_by_token_groups<avx512_vnni_tier::Q5KRow, 4>;
    return t;
  };
  static const Kernels plain = make(dot512::dot_nvfp4<false>);
  static const Kernels vbmi = make(nvfp4_dot_avx512_vbmi);
  return cpu.avx512_vbmi && !switched_on("FREETOKEN_CPU_MOE_NO_VBMI") ? vbmi : plain;
}

}  // namespace ft
