// Portable kernels for every format, written so that the compiler vectorizes them with the
// flags of the translation unit that includes this file (one copy per ISA tier).
// Include inside a per-tier namespace, after common.h; call make_generic_table().
//
// Float formats (f32, f16, bf16, nvfp4 W4A16, fp8_block, mxfp4) take fp32 activations and
// decode a row segment of up to 256 weights to fp32 first. GGUF integer formats (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) take int8 activations in the Q8_32 layout (blocks of 32, like llama.cpp's q8_0)
// and decode a block to int8 values with per-16 scales and per-32 mins.
// Every row is reduced in the same fixed order whatever r0 / nrows / ntok are.

constexpr int kLanes = 16;   // partial sums per token: fixes the summation order
constexpr int kSeg = 256;    // weights decoded per step
constexpr int kTokGroup = 8; // tokens sharing one decoded segment

// ---------------------------------------------------------------------------
// activation preparation
// ---------------------------------------------------------------------------
static int64_t f32_act_bytes(int64_t K) { return K * 4; }
static void f32_prep(const float* x, int64_t K, uint8_t* out) { std::memcpy(out, x, K * 4); }

// Quantize n values to int8 with one scale (see kMinAmax in common.h). Returns the int sum.
static int32_t quant_block_scalar(const float* x, int n, int8_t* q, float* d) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  if (!(amax >= kMinAmax)) {
    std::memset(q, 0, n);
    *d = 0.0f;
    return 0;
  }
  const float inv = 127.0f / amax;
  int32_t sum = 0;
  for (int i = 0; i < n; ++i) {
    float v = std::nearbyint(x[i] * inv);
    v = std::fmin(127.0f, std::fmax(-127.0f, v));
    q[i] = static_cast<int8_t>(v);
    sum += q[i];
  }
  *d = amax / 127.0f;
  return sum;
}

static void q8_32_prep(const float* x, int64_t K, uint8_t* out) {
  int8_t* q = reinterpret_cast<int8_t*>(out);
  float* d = reinterpret_cast<float*>(out + K);
  int32_t* s = reinterpret_cast<int32_t*>(out + K + (K / 32) * 4);
  for (int64_t b = 0; b < K / 32; ++b) s[b] = quant_block_scalar(x + b * 32, 32, q + b * 32, d + b);
}

// The NVFP4 W4A8 layouts of common.h, scalar. The SIMD quants must match them bit for bit.
static void nvfp4_q8_prep_scalar(const Q8Layout& L, const float* x, int64_t K, uint8_t* out) {
  std::memset(out, 0, L.bytes(K));
  int lane_of[16] = {};
  for (int m = 0; m < L.lanes; ++m) lane_of[L.ord[m]] = m;
  int8_t q[16];
  for (int64_t b = 0; b < K / 16; ++b) {
    float d;
    const int32_t s = quant_block_scalar(x + b * 16, 16, q, &d);
    uint8_t* g = out + (b / L.lanes) * L.group_bytes();
    const int m = lane_of[b % L.lanes];
    for (int w = 0; w < 16; ++w) g[L.pos(m, w)] = static_cast<uint8_t>(q[w]);
    reinterpret_cast<int32_t*>(g + L.bias())[m] = -12 * s;
    reinterpret_cast<float*>(g + L.scale())[m] = d * 128.0f;
  }
}

// ---------------------------------------------------------------------------
// float-format row decoders: weights [k0, k0 + n) of one row -> fp32 (scales applied)
// ---------------------------------------------------------------------------
static void decode_f32_seg(const Bank& w, int64_t e, int64_t r, int64_t k0, int n, float* o) {
  std::memcpy(o, reinterpret_cast<const float*>(w.row(e, r)) + k0, n * 4);
}
static void decode_bf16_seg(const Bank& w, int64_t e, int64_t r, int64_t k0, int n, float* o) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(w.row(e, r)) + k0;
  for (int i = 0; i < n; ++i) o[i] = f32_from_bits(static_cast<uint32_t>(p[i]) << 16);
}
static void decode_f16_seg(const Bank& w, int64_t e, int64_t r, int64_t k0, int n, float* o) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(w.row(e, r)) + k0;
  for (int i = 0; i < n; ++i) o[i] = f16_to_f32(p[i]);
}
static void decode_nvfp4_seg(const Bank& w, int64_t e, int64_t r, int64_t k0, int n, float* o) {
  const uint8_t* p = w.row(e, r) + k0 / 2;
  const uint8_t* s = w.scales + (e * w.N + r) * (w.K / 16) + k0 / 16;
  for (int b = 0; b < n / 16; ++b) {
    const float sc = e4m3_to_f32(s[b]);
    for (int i = 0; i < 8; ++i) {
      o[b * 16 + 2 * i] = kE2M1[p[b * 8 + i] & 15] * sc;
      o[b * 16 + 2 * i + 1] = kE2M1[p[b * 8 + i] >> 4] * sc;
    }
  }
}
static void decode_mxfp4_seg(const Bank& w, int64_t e, int64_t r, int64_t k0, int n, float* o) {
  const uint8_t* p = w.row(e, r) + k0 / 2;
  const uint8_t* s = w.scales + (e * w.N + r) * (w.K / 32) + k0 / 32;
  for (int b = 0; b < n / 32; ++b) {
    const float sc = e8m0_to_f32(s[b]);
    for (int i = 0; i < 16; ++i) {
      o[b * 32 + 2 * i] = kE2M1[p[b * 16 + i] & 15] * sc;
      o[b * 32 + 2 * i + 1] = kE2M1[p[b * 16 + i] >> 4] * sc;
    }
  }
}
// The fp32 value of every E4M3 byte.
static const float* e4m3_table() {
  static const struct Lut {
    float v[256];
    Lut() { for (int i = 0; i < 256; ++i) v[i] = e4m3_to_f32(static_cast<uint8_t>(i)); }
  } lut;
  return lut.v;
}

// The fp32 W4A16 NVFP4 dot of the SIMD tiers without VNNI, as a Row of
// dot_rows_by_token_groups: Row::run<NT>(row codes, row scales, K, acts, res, os) is the
// tier's one-row kernel.
template <class Row>
struct Nvfp4Row {
  template <int NT>
  static void run(const Bank& w, int64_t e, int64_t r, const uint8_t* const* acts, float* res,
                  int64_t os) {
    Row::template run<NT>(w.row(e, r), w.scales + (e * w.N + r) * (w.K / 16), w.K, acts, res, os);
  }
};
static void decode_fp8_seg(const Bank& w, int64_t e, int64_t r, int64_t k0, int n, float* o) {
  const float* lut = e4m3_table();
  const uint8_t* p = w.row(e, r) + k0;
  const int64_t nbk = (w.K + 127) / 128, nbn = (w.N + 127) / 128;
  const float* s = reinterpret_cast<const float*>(w.scales) + (e * nbn + r / 128) * nbk;
  for (int i = 0; i < n; ++i) o[i] = lut[p[i]] * s[(k0 + i) / 128];
}

using SegDecoder = void (*)(const Bank&, int64_t, int64_t, int64_t, int, float*);

static float reduce_lanes(const float* a) {  // fixed pairwise tree
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) t[i] += t[i + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// Segment length: 256 or what is left; nvfp4 / mxfp4 / fp8 keep K % 16 == 0 (checked).
template <SegDecoder DEC>
static void dot_float(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                      const uint8_t* const* acts, int ntok, float* out, int64_t os,
                      const ReadNext& /*next*/) {
  alignas(64) float wf[kSeg];
  alignas(64) float acc[kTokGroup][kLanes];
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    for (int t0 = 0; t0 < ntok; t0 += kTokGroup) {
      const int nt = ntok - t0 < kTokGroup ? ntok - t0 : kTokGroup;
      std::memset(acc, 0, sizeof(acc));
      for (int64_t k0 = 0; k0 < w.K; k0 += kSeg) {
        const int n = static_cast<int>(w.K - k0 < kSeg ? w.K - k0 : kSeg);
        DEC(w, e, r, k0, n, wf);
        const int n16 = n & ~15;
        for (int t = 0; t < nt; ++t) {
          const float* x = reinterpret_cast<const float*>(acts[t0 + t]) + k0;
          float* a = acc[t];
          for (int i = 0; i < n16; i += 16)
            for (int l = 0; l < 16; ++l) a[l] += wf[i + l] * x[i + l];
          for (int i = n16; i < n; ++i) a[i & 15] += wf[i] * x[i];
        }
      }
      for (int t = 0; t < nt; ++t) out[(t0 + t) * os + (r - r0)] = reduce_lanes(acc[t]);
    }
  }
}

// ---------------------------------------------------------------------------
// GGUF integer formats: block -> int8 q[bs], scale per 16 `sw`, min per 32 `mw`
// (value = sw * q - mw)
// ---------------------------------------------------------------------------
static void decode_q8_0(const uint8_t* b, int8_t* q, float* sw, float* mw) {
  const float d = f16_to_f32(static_cast<uint16_t>(b[0] | (b[1] << 8)));
  std::memcpy(q, b + 2, 32);
  sw[0] = sw[1] = d;
  mw[0] = 0.0f;
}
static void decode_q4_0(const uint8_t* b, int8_t* q, float* sw, float* mw) {
  const float d = f16_to_f32(static_cast<uint16_t>(b[0] | (b[1] << 8)));
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((b[2 + j] & 15) - 8);
    q[j + 16] = static_cast<int8_t>((b[2 + j] >> 4) - 8);
  }
  sw[0] = sw[1] = d;
  mw[0] = 0.0f;
}
static void decode_q4_k(const uint8_t* b, int8_t* q, float* sw, float* mw) {
  const float d = f16_to_f32(static_cast<uint16_t>(b[0] | (b[1] << 8)));
  const float dmin = f16_to_f32(static_cast<uint16_t>(b[2] | (b[3] << 8)));
  const uint8_t* s = b + 4;
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {  // 6-bit scale and min of sub-block j (llama.cpp get_scale_min_k4)
    int sc, m;
    if (j < 4) {
      sc = s[j] & 63;
      m = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    sw[2 * j] = sw[2 * j + 1] = d * sc;
    mw[j] = dmin * m;
  }
  for (int g = 0; g < 4; ++g)  // 64 values per group: low nibbles, then high nibbles
    for (int l = 0; l < 32; ++l) {
      q[g * 64 + l] = static_cast<int8_t>(qs[g * 32 + l] & 15);
      q[g * 64 + 32 + l] = static_cast<int8_t>(qs[g * 32 + l] >> 4);
    }
}
static void decode_q6_k(const uint8_t* b, int8_t* q, float* sw, float* mw) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16_to_f32(static_cast<uint16_t>(b[208] | (b[209] << 8)));
  for (int i = 0; i < 16; ++i) sw[i] = d * sc[i];
  for (int i = 0; i < 8; ++i) mw[i] = 0.0f;
  for (int h = 0; h < 2; ++h) {  // two halves of 128 values
    const uint8_t* L = ql + 64 * h;
    const uint8_t* H = qh + 32 * h;
    int8_t* o = q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      o[l] = static_cast<int8_t>(((L[l] & 15) | (((H[l] >> 0) & 3) << 4)) - 32);
      o[l + 32] = static_cast<int8_t>(((L[l + 32] & 15) | (((H[l] >> 2) & 3) << 4)) - 32);
      o[l + 64] = static_cast<int8_t>(((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32);
      o[l + 96] = static_cast<int8_t>(((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32);
    }
  }
}

// Q4_1 (fp16 d, fp16 m, 16 bytes of nibbles as Q4_0): value = d * q + m.
static void decode_q4_1(const uint8_t* b, int8_t* q, float* sw, float* mw) {
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(b[4 + j] & 15);
    q[j + 16] = static_cast<int8_t>(b[4 + j] >> 4);
  }
  sw[0] = sw[1] = f16_at(b);
  mw[0] = -f16_at(b + 2);
}
// The 5-bit codes of Q5_0 / Q5_1: nibbles as Q4_0 at qs, bit j of the u32 at qh the 5th bit of
// value j; minus `off`.
static void q5_codes(const uint8_t* qh, const uint8_t* qs, int off, int8_t* q) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 15) | (((h >> j) & 1) << 4)) - off);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4)) - off);
  }
}
// Q5_0 (fp16 d, qh[4], qs[16]): value = d * (q - 16).
static void decode_q5_0(const uint8_t* b, int8_t* q, float* sw, float* mw) {
  q5_codes(b + 2, b + 6, 16, q);
  sw[0] = sw[1] = f16_at(b);
  mw[0] = 0.0f;
}
// Q5_1 (fp16 d, fp16 m, qh[4], qs[16]): value = d * q + m.
static void decode_q5_1(const uint8_t* b, int8_t* q, float* sw, float* mw) {
  q5_codes(b + 4, b + 8, 0, q);
  sw[0] = sw[1] = f16_at(b);
  mw[0] = -f16_at(b + 2);
}
// Q5_K (Q4_K's header, qh[32], qs[128]): Q4_K's nibbles with bit s of qh[l] the 5th bit of
// value l of sub-block s.
static void decode_q5_k(const uint8_t* b, int8_t* q, float* sw, float* mw) {
  uint8_t hdr[144];
  std::memcpy(hdr, b, 16);
  std::memcpy(hdr + 16, b + 48, 128);
  decode_q4_k(hdr, q, sw, mw);
  for (int s = 0; s < 8; ++s)
    for (int l = 0; l < 32; ++l) q[32 * s + l] = static_cast<int8_t>(q[32 * s + l] | (((b[16 + l] >> s) & 1) << 4));
}
// GGUF MXFP4 (E8M0 e, 16 bytes of codes as Q4_0): value = kMxfp4Int[code] * 2^(e - 128).
static void decode_gguf_mxfp4(const uint8_t* b, int8_t* q, float* sw, float* mw) {
  for (int j = 0; j < 16; ++j) {
    q[j] = kMxfp4Int[b[1 + j] & 15];
    q[j + 16] = kMxfp4Int[b[1 + j] >> 4];
  }
  sw[0] = sw[1] = e8m0_half_to_f32(b[0]);
  mw[0] = 0.0f;
}

using BlockDecoder = void (*)(const uint8_t*, int8_t*, float*, float*);

static inline int32_t idot16(const int8_t* a, const int8_t* b) {
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += static_cast<int32_t>(a[i]) * b[i];
  return s;
}

template <BlockDecoder DEC, int BS, int BBYTES>
static void dot_q8(const Bank& w, int64_t e, int64_t r0, int64_t nrows,
                   const uint8_t* const* acts, int ntok, float* out, int64_t os,
                   const ReadNext& /*next*/) {
  alignas(64) int8_t q[BS];
  float sw[BS / 16], mw[BS / 32];
  const int64_t nblk = w.K / BS;
  for (int64_t r = r0; r < r0 + nrows; ++r) {
    const uint8_t* row = w.row(e, r);
    for (int t0 = 0; t0 < ntok; t0 += kTokGroup) {
      const int nt = ntok - t0 < kTokGroup ? ntok - t0 : kTokGroup;
      float acc[kTokGroup] = {};
      for (int64_t blk = 0; blk < nblk; ++blk) {
        DEC(row + blk * BBYTES, q, sw, mw);
        for (int t = 0; t < nt; ++t) {
          const uint8_t* A = acts[t0 + t];
          const int8_t* aq = reinterpret_cast<const int8_t*>(A) + blk * BS;
          const float* ad = reinterpret_cast<const float*>(A + w.K) + blk * (BS / 32);
          const int32_t* as = reinterpret_cast<const int32_t*>(A + w.K + w.K / 8) + blk * (BS / 32);
          float s = 0.0f;
          for (int b = 0; b < BS / 32; ++b) {
            const float i0 = static_cast<float>(idot16(q + 32 * b, aq + 32 * b));
            const float i1 = static_cast<float>(idot16(q + 32 * b + 16, aq + 32 * b + 16));
            s += ad[b] * (sw[2 * b] * i0 + sw[2 * b + 1] * i1 - mw[b] * static_cast<float>(as[b]));
          }
          acc[t] += s;
        }
      }
      for (int t = 0; t < nt; ++t) out[(t0 + t) * os + (r - r0)] = acc[t];
    }
  }
}

#include "dequant_rows.h"

// ---------------------------------------------------------------------------
// streaming read (portable fallback) and the table
// ---------------------------------------------------------------------------
static uint64_t stream_read_generic(const uint8_t* p, int64_t n, int64_t dist, int64_t far) {
  const uint64_t* q = reinterpret_cast<const uint64_t*>(p);
  uint64_t a[8] = {};
  for (int64_t i = 0; i < n / 8; i += 8) {
    if (dist > 0 && 8 * i + dist < n) prefetch_lines(p + 8 * i + dist, 1);
    if (far > 0 && 8 * i + far < n) prefetch_lines_l2(p + 8 * i + far, 1);
    for (int l = 0; l < 8; ++l) a[l] ^= q[i + l];
  }
  return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}

static void glu_generic(float* g, const float* u, int64_t n, float s_gate, float s_up, int act) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i] * s_gate, y = u[i] * s_up;
    g[i] = act == 0 ? x / (1.0f + std::exp(-x)) * y
                    : 0.5f * x * (1.0f + std::tanh(c * (x + 0.044715f * x * x * x))) * y;
  }
}

static Kernels make_generic_table(const char* name) {
  Kernels k;
  k.name = name;
  auto set = [&](Fmt f, ActBytesFn ab, PrepFn pr, DotFn dot) {
    k.fmt[static_cast<int>(f)] = FormatKernels{ab, pr, dot};
  };
  set(Fmt::F32, f32_act_bytes, f32_prep, dot_float<decode_f32_seg>);
  set(Fmt::F16, f32_act_bytes, f32_prep, dot_float<decode_f16_seg>);
  set(Fmt::BF16, f32_act_bytes, f32_prep, dot_float<decode_bf16_seg>);
  set(Fmt::NVFP4, f32_act_bytes, f32_prep, dot_float<decode_nvfp4_seg>);
  set(Fmt::MXFP4, f32_act_bytes, f32_prep, dot_float<decode_mxfp4_seg>);
  set(Fmt::FP8_BLOCK, f32_act_bytes, f32_prep, dot_float<decode_fp8_seg>);
  set(Fmt::Q8_0, q8_32_bytes, q8_32_prep, dot_q8<decode_q8_0, 32, 34>);
  set(Fmt::Q4_0, q8_32_bytes, q8_32_prep, dot_q8<decode_q4_0, 32, 18>);
  set(Fmt::Q4_K, q8_32_bytes, q8_32_prep, dot_q8<decode_q4_k, 256, 144>);
  set(Fmt::Q6_K, q8_32_bytes, q8_32_prep, dot_q8<decode_q6_k, 256, 210>);
  set(Fmt::Q4_1, q8_32_bytes, q8_32_prep, dot_q8<decode_q4_1, 32, 20>);
  set(Fmt::Q5_0, q8_32_bytes, q8_32_prep, dot_q8<decode_q5_0, 32, 22>);
  set(Fmt::Q5_1, q8_32_bytes, q8_32_prep, dot_q8<decode_q5_1, 32, 24>);
  set(Fmt::Q5_K, q8_32_bytes, q8_32_prep, dot_q8<decode_q5_k, 256, 176>);
  set(Fmt::GGUF_MXFP4, q8_32_bytes, q8_32_prep, dot_q8<decode_gguf_mxfp4, 32, 17>);
  set_dequant(k);
  k.stream_read = stream_read_generic;
  k.glu = glu_generic;
  return k;
}
