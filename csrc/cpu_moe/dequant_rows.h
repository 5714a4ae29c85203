// Row decoders for the prefill path: one weight row -> fp32 [K], bit for bit what gguf-py's
// numpy dequantize (and freetoken/formats/codecs.py) computes. Included by generic_kernels.h,
// so the compiler vectorizes the loops with each tier's flags.
//
// Exactness: the codecs form each value with the same fp32 operations, in the same order:
//   Q4_0 / Q5_0 / Q8_0:   d * q                 (one rounding)
//   Q4_1 / Q5_1:          (d * q) + m           (two)
//   Q4_K / Q5_K:          (d * sc) * q - dmin * m, the two products rounded first (three)
//   Q6_K:                 (d * sc) * q          (two)
//   GGUF MXFP4:           2^(e - 128) * int     (one; ggml_e8m0_to_fp32_half)
// NOTE: this file is compiled with -std=gnu++17, whose default -ffp-contract=fast allows GCC to
// fuse a product and a sum into one FMA (one rounding instead of two), also across statements
// (GCC 12 happens not to here, but nothing guarantees it). The formats with a product and a sum
// therefore store the products, pass a compiler barrier (the products must be stored and
// reloaded: nothing can fuse across it), then add. The tests check every tier bit for bit.
// The float formats reuse the dot's segment decoders (their values are exact products).

// ---------------------------------------------------------------------------
// GGUF blocks -> fp32
// ---------------------------------------------------------------------------
static inline void fp_barrier() { asm volatile("" ::: "memory"); }

// The blocks of 32 decode their codes to int8 first (byte loops the compiler vectorizes), then
// convert and scale 32 at once: per-value loops over both nibbles of a byte vectorized poorly
// (Q4_0 2.3 GB/s of output on one core against 13 for Q4_K's grouped loops).
// o[i] = d * q[i] for a run of n codes.
static inline void scale_codes(const int8_t* q, int n, float d, float* o) {
  for (int i = 0; i < n; ++i) o[i] = d * static_cast<float>(q[i]);
}
// 16 bytes of nibbles: value j in the low nibble of byte j, j + 16 in its high one, minus off.
static inline void nibble_codes(const uint8_t* qs, int off, int8_t* q) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((qs[j] & 15) - off);
    q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - off);
  }
}
// Byte i of kBitSpread[v] = bit i of v at bit 4: the 5th bits of 8 Q5_0 / Q5_1 values.
struct BitSpread {
  uint64_t v[256];
  constexpr BitSpread() : v() {
    for (int x = 0; x < 256; ++x)
      for (int i = 0; i < 8; ++i) v[x] |= static_cast<uint64_t>((x >> i) & 1) << (8 * i + 4);
  }
};
static constexpr BitSpread kBitSpread{};
// Q5_0 / Q5_1 codes: the nibbles with bit j of the u32 at qh as bit 4 of value j, minus off.
static inline void q5_dq_codes(const uint8_t* qh, const uint8_t* qs, int off, int8_t* q) {
  uint8_t hi[32];
  for (int i = 0; i < 4; ++i) std::memcpy(hi + 8 * i, &kBitSpread.v[qh[i]], 8);
  nibble_codes(qs, 0, q);
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>((q[j] | hi[j]) - off);
}

static void dq_q8_0(const uint8_t* b, float* o) {
  scale_codes(reinterpret_cast<const int8_t*>(b + 2), 32, f16_at(b), o);
}
static void dq_q4_0(const uint8_t* b, float* o) {
  int8_t q[32];
  nibble_codes(b + 2, 8, q);
  scale_codes(q, 32, f16_at(b), o);
}
static void dq_q4_1(const uint8_t* b, float* o) {
  int8_t q[32];
  nibble_codes(b + 4, 0, q);
  scale_codes(q, 32, f16_at(b), o);
  fp_barrier();
  const float m = f16_at(b + 2);
  for (int j = 0; j < 32; ++j) o[j] += m;
}
static void dq_q5_0(const uint8_t* b, float* o) {
  int8_t q[32];
  q5_dq_codes(b + 2, b + 6, 16, q);
  scale_codes(q, 32, f16_at(b), o);
}
static void dq_q5_1(const uint8_t* b, float* o) {
  int8_t q[32];
  q5_dq_codes(b + 4, b + 8, 0, q);
  scale_codes(q, 32, f16_at(b), o);
  fp_barrier();
  const float m = f16_at(b + 2);
  for (int j = 0; j < 32; ++j) o[j] += m;
}
static void dq_gguf_mxfp4(const uint8_t* b, float* o) {
  int8_t q[32];
  nibble_codes(b + 1, 0, q);
  for (int j = 0; j < 32; ++j) {  // kMxfp4Int by selects (a table lookup does not vectorize)
    const int m = q[j] & 7;
    const int v = m == 5 ? 6 : m == 6 ? 8 : m == 7 ? 12 : m;
    q[j] = static_cast<int8_t>(q[j] & 8 ? -v : v);
  }
  scale_codes(q, 32, e8m0_half_to_f32(b[0]), o);
}
// Q4_K / Q5_K: per sub-block s of 32, (d * sc[s]) * q - (dmin * m[s]); qh null for Q4_K.
static inline void dq_k4(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* o) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  float dsc[8], dm[8];
  for (int j = 0; j < 8; ++j) {  // llama.cpp's get_scale_min_k4
    const uint8_t* s = b + 4;
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    dsc[j] = d * static_cast<float>(sc);
    dm[j] = dmin * static_cast<float>(m);
  }
  for (int g = 0; g < 4; ++g) {  // 64 values per group: low nibbles, then high nibbles
    float* lo = o + 64 * g;
    float* hi = lo + 32;
    for (int l = 0; l < 32; ++l) {
      int ql = qs[32 * g + l] & 15, qu = qs[32 * g + l] >> 4;
      if (qh) {
        ql |= ((qh[l] >> (2 * g)) & 1) << 4;
        qu |= ((qh[l] >> (2 * g + 1)) & 1) << 4;
      }
      lo[l] = dsc[2 * g] * static_cast<float>(ql);
      hi[l] = dsc[2 * g + 1] * static_cast<float>(qu);
    }
  }
  fp_barrier();
  for (int s = 0; s < 8; ++s)
    for (int l = 0; l < 32; ++l) o[32 * s + l] -= dm[s];
}
static void dq_q4_k(const uint8_t* b, float* o) { dq_k4(b, nullptr, b + 16, o); }
static void dq_q5_k(const uint8_t* b, float* o) { dq_k4(b, b + 16, b + 48, o); }
static void dq_q6_k(const uint8_t* b, float* o) {
  int8_t q[256];
  float sw[16], mw[8];
  decode_q6_k(b, q, sw, mw);  // the dot's decoder: q - 32, sw[i] = d * sc[i] (as the codec)
  for (int i = 0; i < 16; ++i) scale_codes(q + 16 * i, 16, sw[i], o + 16 * i);
}

using BlockDequant = void (*)(const uint8_t*, float*);

template <BlockDequant DQ, int BS, int BBYTES>
static void dequant_blocks(const Bank& w, int64_t e, int64_t r, float* out) {
  const uint8_t* row = w.row(e, r);
  for (int64_t b = 0; b < w.K / BS; ++b) DQ(row + b * BBYTES, out + b * BS);
}

// The float formats through their dot's segment decoders (exact: their values are products of
// values with few significant bits, or conversions).
template <SegDecoder DEC>
static void dequant_segs(const Bank& w, int64_t e, int64_t r, float* out) {
  for (int64_t k0 = 0; k0 < w.K; k0 += kSeg)
    DEC(w, e, r, k0, static_cast<int>(w.K - k0 < kSeg ? w.K - k0 : kSeg), out + k0);
}

// f16 with the F16C conversion where the tier has it (decode_f16_seg's ldexp is ~10x slower).
static void dequant_f16(const Bank& w, int64_t e, int64_t r, float* out) {
#ifdef __F16C__
  const uint16_t* p = reinterpret_cast<const uint16_t*>(w.row(e, r));
  int64_t i = 0;
  for (; i + 8 <= w.K; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
  for (; i < w.K; ++i) out[i] = _cvtsh_ss(p[i]);
#else
  dequant_segs<decode_f16_seg>(w, e, r, out);
#endif
}

static void set_dequant(Kernels& k) {
  auto set = [&](Fmt f, DequantFn fn) { k.fmt[static_cast<int>(f)].dequant = fn; };
  set(Fmt::F32, dequant_segs<decode_f32_seg>);
  set(Fmt::F16, dequant_f16);
  set(Fmt::BF16, dequant_segs<decode_bf16_seg>);
  set(Fmt::NVFP4, dequant_segs<decode_nvfp4_seg>);
  set(Fmt::MXFP4, dequant_segs<decode_mxfp4_seg>);
  set(Fmt::FP8_BLOCK, dequant_segs<decode_fp8_seg>);
  set(Fmt::Q4_0, dequant_blocks<dq_q4_0, 32, 18>);
  set(Fmt::Q4_1, dequant_blocks<dq_q4_1, 32, 20>);
  set(Fmt::Q5_0, dequant_blocks<dq_q5_0, 32, 22>);
  set(Fmt::Q5_1, dequant_blocks<dq_q5_1, 32, 24>);
  set(Fmt::Q8_0, dequant_blocks<dq_q8_0, 32, 34>);
  set(Fmt::Q4_K, dequant_blocks<dq_q4_k, 256, 144>);
  set(Fmt::Q5_K, dequant_blocks<dq_q5_k, 256, 176>);
  set(Fmt::Q6_K, dequant_blocks<dq_q6_k, 256, 210>);
  set(Fmt::GGUF_MXFP4, dequant_blocks<dq_gguf_mxfp4, 32, 17>);
}
