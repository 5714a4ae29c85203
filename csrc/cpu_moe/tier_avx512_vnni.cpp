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
// GGUF Q4_K x int8 (the Q8_32 activation layout of common.h), vpdpbusd
// ---------------------------------------------------------------------------
// A super-block is 256 values: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins of 8
// sub-blocks of 32, 128 bytes of nibbles (32 bytes a group of 64 values: low nibbles the first
// 32, high nibbles the next 32). Value = d * sc[s] * q - dmin * m[s]. Against int8 activations
// with a scale da[s] and a sum sa[s] per 32: sum_s da[s] * (d * sc[s] * sum(q * a) - dmin * m[s]
// * sa[s]). One 64-byte load of nibbles splits into low nibbles (sub-blocks 0 and 2 of its 128
// values) and high nibbles (1 and 3): each the unsigned operand of a vpdpbusd against the
// activations of those two sub-blocks, every int32 lane then belongs to one sub-block, and one
// FMA with the lane's factor d * sc * da accumulates it. The mins go to a second accumulator.

// The 256-bit GGUF kernels (gguf_dot256.h, also q4k_scales_mins) with the EVEX vpdpbusd on ymm.
struct EvexDp {
  static __m256i dp(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
};
#include "gguf_dot256.h"

// One row against NT tokens; res[t * os].
template <int NT>
static inline void q4k_row(const uint8_t* row, int64_t K, const uint8_t* const* acts, float* res,
                           int64_t os) {
  const int64_t nsb = K / 256;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  // lane -> sub-block of the 8: vector v holds sub-blocks (2v', ...) as below
  const __m512i sel0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i sel1 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i sel2 = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6);
  const __m512i sel3 = _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7);
  // Two accumulator chains a token (low-nibble and high-nibble sub-blocks): one chain of four
  // dependent FMAs per super-block bound the kernel by their latency.
  __m512 acc[NT], acc2[NT];
  __m256 accm[NT];
  for (int t = 0; t < NT; ++t)
    acc[t] = _mm512_setzero_ps(), acc2[t] = _mm512_setzero_ps(), accm[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nsb; ++b) {
    const uint8_t* blk = row + b * 144;
    __m256 dsc, dmn;
    q4k_factors(blk, dsc, dmn);
    const __m512i w0 = _mm512_loadu_si512(blk + 16), w1 = _mm512_loadu_si512(blk + 80);
    const __m512i l0 = _mm512_and_si512(w0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), m4);
    const __m512i l1 = _mm512_and_si512(w1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), m4);
    for (int t = 0; t < NT; ++t) {
      const uint8_t* A = acts[t];
      const uint8_t* aq = A + b * 256;
      const float* ad = reinterpret_cast<const float*>(A + K) + b * 8;
      const int32_t* as = reinterpret_cast<const int32_t*>(A + K + K / 8) + b * 8;
      auto two = [aq](int lo, int hi) {  // activations of values [lo, lo+32) and [hi, hi+32)
        return _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + lo))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + hi)), 1);
      };
      const __m256 da = _mm256_loadu_ps(ad);
      const __m512 f = _mm512_castps256_ps512(_mm256_mul_ps(dsc, da));
      const __m512i z = _mm512_setzero_si512();
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, l0, two(0, 64))),
                               _mm512_permutexvar_ps(sel0, f), acc[t]);
      acc2[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, h0, two(32, 96))),
                                _mm512_permutexvar_ps(sel1, f), acc2[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, l1, two(128, 192))),
                               _mm512_permutexvar_ps(sel2, f), acc[t]);
      acc2[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, h1, two(160, 224))),
                                _mm512_permutexvar_ps(sel3, f), acc2[t]);
      accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(dmn, da),
                                _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(as))),
                                accm[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const __m128 m = _mm_add_ps(_mm256_castps256_ps128(accm[t]), _mm256_extractf128_ps(accm[t], 1));
    const __m128 m2 = _mm_add_ps(m, _mm_movehl_ps(m, m));
    res[t * os] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t])) -
                  _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
  }
}

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
    const __m512 DM = _mm512_permutexvar_ps(  // [d x 8, dmin x 8]
        _mm512_inserti64x4(_mm512_set1_epi32(2 * r), _mm256_set1_epi32(2 * r + 1), 1),
        _mm512_castps256_ps512(dd));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                             _mm_load_si128(reinterpret_cast<const __m128i*>(scm + 16 * r)))), DM);
  }
};

// R rows (`rb` bytes apart) against one token, res[i] for row i: q4k_row<1>'s arithmetic lane
// for lane (the same products, FMA chains and final sums, so the same bits), with what it
// spent per row and super-block done once for the R rows or in fewer instructions (one core,
// L2, 30B expert shapes: 20 -> 27 GB/s at R = 4):
// - the activations (four 2 x 32-byte loads) and their scales and sums, loaded once for R rows;
// - the rows' headers unpacked together (KHeaders);
// - d * sc and dmin * m in one 16-lane vector F, times [da, da] in one product fz: lanes 0-7
//   are q4k_row's f = dsc * da, lanes 8-15 its dmn * da; the mins FMA runs on all 16 lanes
//   against [0, float(sa)] and only lanes 8-15 are summed (k_mins_sum).
template <int R>
static inline void q4k_rows1(const uint8_t* row0, int64_t rb, int64_t K, const uint8_t* A,
                             float* res, const SpreadPrefetch<R>& pf) {
  const int64_t nsb = K / 256;
  const KHeaderConsts kh;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i sel0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i sel1 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i sel2 = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6);
  const __m512i sel3 = _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7);
  const __m512i z = _mm512_setzero_si512();
  __m512 acc[R], acc2[R], accm[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    acc2[r] = _mm512_setzero_ps();
    accm[r] = _mm512_setzero_ps();
  }
  auto pfs = pf.steps(nsb);
  for (int64_t b = 0; b < nsb; ++b) {
    pfs.step();
    const uint8_t* aq = A + b * 256;
    auto two = [aq](int lo, int hi) {  // activations of values [lo, lo+32) and [hi, hi+32)
      return _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + lo))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + hi)), 1);
    };
    const __m512i a0 = two(0, 64), a1 = two(32, 96), a2 = two(128, 192), a3 = two(160, 224);
    const __m512 da2 = k_da2(A, K, b), sa2 = k_sa2(A, K, b);
    const uint8_t* blk0 = row0 + b * 144;
    const KHeaders<R> hd(blk0, rb, kh);
    for (int r = 0; r < R; ++r) {
      const __m512 fz = _mm512_mul_ps(hd.factors(r), da2);
      const uint8_t* blk = blk0 + r * rb;
      const __m512i w0 = _mm512_loadu_si512(blk + 16), w1 = _mm512_loadu_si512(blk + 80);
      const __m512i l0 = _mm512_and_si512(w0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), m4);
      const __m512i l1 = _mm512_and_si512(w1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), m4);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, l0, a0)),
                               _mm512_permutexvar_ps(sel0, fz), acc[r]);
      acc2[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, h0, a1)),
                                _mm512_permutexvar_ps(sel1, fz), acc2[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, l1, a2)),
                               _mm512_permutexvar_ps(sel2, fz), acc[r]);
      acc2[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(z, h1, a3)),
                                _mm512_permutexvar_ps(sel3, fz), acc2[r]);
      accm[r] = _mm512_fmadd_ps(fz, sa2, accm[r]);
    }
  }
  for (int r = 0; r < R; ++r)  // q4k_row's sums: the same trees
    res[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r])) - k_mins_sum(accm[r]);
}

// q4k_rows1 where the CPU has GFNI (one core, L2, K = 2048, against q4k_rows1: +8%; in L1 +11%;
// the same layout with a shift and a mask for the nibbles was 4-8% slower than q4k_rows1, so
// CPUs without GFNI keep it). The same products, FMA chains and sums, so the same bits; what
// differs is where they sit and how they are made:
// - vector g (g < 4) is group g's 32 nibble bytes broadcast to both halves (a load, no shuffle)
//   and one vgf2p8affineqb with a matrix a qword (the low 4 qwords keep bits 0-3, the high 4
//   move bits 4-7 down), so lanes 0-7 hold sub-block 2g and lanes 8-15 sub-block 2g + 1; the
//   activations are the 64 bytes of values 64g .. 64g + 63 as they lie (no inserts). Two
//   chains a row: acc[r][0] = [q4k_row's chain of sub-blocks 0, 4 | of 1, 5] (groups 0, 2),
//   acc[r][1] = [2, 6 | 3, 7] (groups 1, 3), each lane taking the FMAs it took there in the
//   same order; the row's sum (c0 + c1) + (c2 + c3), then hsum8, is the tree
//   _mm512_reduce_add_ps(acc + acc2) makes there.
// - vpdpbusd into a zero idiom (vpxord) rather than a register copy of a zero.
// - the rows' factors fz = [d sc da, dmin m da] of up to 8 super-blocks are made before those
//   super-blocks' dots (a pass of their own into a stack buffer, read back by the FMAs): in the
//   dot loop their chain of header load, shuffles, store, reload, convert and two products per
//   super-block held the dots' instructions back.
#pragma GCC push_options
#pragma GCC target("gfni")
template <int R>
static void q4k_rows1_gfni(const uint8_t* row0, int64_t rb, int64_t K, const uint8_t* A,
                           float* res, const SpreadPrefetch<R>& pf) {
  const int64_t nsb = K / 256;
  const KHeaderConsts kh;
  const __m512i gfm = _mm512_inserti64x4(_mm512_set1_epi64(0x0102040800000000LL),
                                         _mm256_set1_epi64x(0x1020408000000000LL), 1);
  __m512i sel[4];  // vector g's lanes: factor 2g (lanes 0-7), 2g + 1 (8-15)
  for (int g = 0; g < 4; ++g)
    sel[g] = _mm512_inserti64x4(_mm512_set1_epi32(2 * g), _mm256_set1_epi32(2 * g + 1), 1);
  __m512 acc[R][2], accm[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = accm[r] = _mm512_setzero_ps();
  constexpr int kChunk = 8;
  alignas(64) float fzb[kChunk][R][16];
  auto pfs = pf.steps(nsb);
  for (int64_t b0 = 0; b0 < nsb; b0 += kChunk) {
    const int nb = static_cast<int>(std::min<int64_t>(kChunk, nsb - b0));
    for (int i = 0; i < nb; ++i) {  // the factors (q4k_rows1's fz)
      const int64_t b = b0 + i;
      const __m512 da2 = k_da2(A, K, b);
      const KHeaders<R> hd(row0 + b * 144, rb, kh);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm512_store_ps(fzb[i][r], _mm512_mul_ps(hd.factors(r), da2));
    }
    for (int i = 0; i < nb; ++i) {
      const int64_t b = b0 + i;
      pfs.step();
      __m512i a[4];
      for (int g = 0; g < 4; ++g) a[g] = _mm512_loadu_si512(A + b * 256 + 64 * g);
      const __m512 sa2 = k_sa2(A, K, b);
      const uint8_t* blk0 = row0 + b * 144;
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 fz = _mm512_load_ps(fzb[i][r]);
        const uint8_t* blk = blk0 + r * rb;
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const __m512i w = _mm512_broadcast_i64x4(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * g)));
          const __m512i q = _mm512_gf2p8affine_epi64_epi8(w, gfm, 0);
          __m512i p;
          asm("vpxord %0, %0, %0\n\tvpdpbusd %2, %1, %0" : "=&v"(p) : "v"(q), "v"(a[g]));
          __m512& c = acc[r][g % 2];
          c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(sel[g], fz), c);
        }
        accm[r] = _mm512_fmadd_ps(fz, sa2, accm[r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 c01 = _mm256_add_ps(_mm512_castps512_ps256(acc[r][0]),
                                     _mm512_extractf32x8_ps(acc[r][0], 1));
    const __m256 c23 = _mm256_add_ps(_mm512_castps512_ps256(acc[r][1]),
                                     _mm512_extractf32x8_ps(acc[r][1], 1));
    res[r] = hsum8(_mm256_add_ps(c01, c23)) - k_mins_sum(accm[r]);
  }
}
#pragma GCC pop_options

struct Q4KRow {
  template <int NT>
  static void run(const Bank& w, int64_t e, int64_t r, const uint8_t* const* acts, float* res,
                  int64_t os) {
    q4k_row<NT>(w.row(e, r), w.K, acts, res, os);
  }
  template <int R>
  static void rows1(const Bank& w, int64_t e, int64_t r, const uint8_t* act, float* res,
                    const SpreadPrefetch<R>& pf) {
    q4k_rows1<R>(w.row(e, r), w.row_bytes, w.K, act, res, pf);
  }
};

struct Q4KRowGfni : Q4KRow {  // q4k_rows1_gfni at one token
  template <int R>
  static void rows1(const Bank& w, int64_t e, int64_t r, const uint8_t* act, float* res,
                    const SpreadPrefetch<R>& pf) {
    q4k_rows1_gfni<R>(w.row(e, r), w.row_bytes, w.K, act, res, pf);
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

// The vpermb dot where the CPU has AVX-512 VBMI, unless FREETOKEN_CPU_MOE_NO_VBMI=1; Q4_K at
// one token by q4k_rows1_gfni where the CPU has GFNI (the same bits as q4k_rows1), unless
// FREETOKEN_CPU_MOE_NO_GFNI=1 (both read at each call, so every executor built afterwards
// follows them).
const Kernels& kernels_avx512_vnni() {
  const CpuFeatures cpu = detect_cpu();
  auto make = [](DotFn dot, bool gfni) {
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
    t.fmt[static_cast<int>(Fmt::Q4_K)].dot =
        gfni ? dot_rows_by_token_groups<avx512_vnni_tier::Q4KRowGfni, 4>
             : dot_rows_by_token_groups<avx512_vnni_tier::Q4KRow, 4>;
    t.fmt[static_cast<int>(Fmt::Q6_K)].dot = dot_rows_by_token_groups<avx512_vnni_tier::Q6KRow>;
    t.fmt[static_cast<int>(Fmt::Q5_K)].dot = dot_rows_by_token_groups<avx512_vnni_tier::Q5KRow, 4>;
    return t;
  };
  static const Kernels plain = make(dot512::dot_nvfp4<false>, false);
  static const Kernels vbmi = make(nvfp4_dot_avx512_vbmi, false);
  static const Kernels plain_gfni = make(dot512::dot_nvfp4<false>, true);
  static const Kernels vbmi_gfni = make(nvfp4_dot_avx512_vbmi, true);
  const bool use_vbmi = cpu.avx512_vbmi && !switched_on("FREETOKEN_CPU_MOE_NO_VBMI");
  const bool use_gfni = cpu.gfni && !switched_on("FREETOKEN_CPU_MOE_NO_GFNI");
  if (use_gfni) return use_vbmi ? vbmi_gfni : plain_gfni;
  return use_vbmi ? vbmi : plain;
}

}  // namespace ft
