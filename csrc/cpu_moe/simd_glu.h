// The GLU of the SIMD tiers, one template for every vector width: exp by Cephes expf (range
// reduction by ln 2 in two parts, degree-5 polynomial, 2^n by the exponent bits), ~1 ulp on
// [-87.3, 88.4] (clamped there); tanh(y) = 1 - 2 / (exp(2y) + 1). V is the width's float
// vector (F8: AVX2 + FMA, F16: AVX-512 F), a handful of one-line operations.
// Include inside the tier's namespace, after generic_kernels.h (the tail runs glu_generic).
#pragma once

struct F8 {
  using T = __m256;
  static constexpr int kWidth = 8;
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T min(T a, T b) { return _mm256_min_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T fnmadd(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T pow2(T n) {  // 2^n for integral n in the normal range
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};

#ifdef __AVX512F__
struct F16 {
  using T = __m512;
  static constexpr int kWidth = 16;
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T min(T a, T b) { return _mm512_min_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T fnmadd(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }
  static T round(T x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static T pow2(T n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};
#endif

template <class V>
static inline typename V::T exp_simd(typename V::T x) {
  x = V::min(V::max(x, V::set1(-87.33654475f)), V::set1(88.37626266f));
  const typename V::T n = V::round(V::mul(x, V::set1(1.44269504089f)));
  typename V::T r = V::fnmadd(n, V::set1(0.693359375f), x);
  r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
  typename V::T p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  p = V::fmadd(V::mul(p, r), r, V::add(r, V::set1(1.0f)));
  return V::mul(p, V::pow2(n));
}

// Kernels::glu: g[i] = act(g[i] * s_gate) * (u[i] * s_up), act 0 = silu, 1 = gelu_tanh.
template <class V>
static void glu_simd(float* g, const float* u, int64_t n, float s_gate, float s_up, int act) {
  using T = typename V::T;
  const T sg = V::set1(s_gate), su = V::set1(s_up), one = V::set1(1.0f);
  int64_t i = 0;
  for (; i + V::kWidth <= n; i += V::kWidth) {
    const T x = V::mul(V::load(g + i), sg);
    const T y = V::mul(V::load(u + i), su);
    T a;
    if (act == 0) {
      a = V::div(x, V::add(one, exp_simd<V>(V::sub(V::set1(0.0f), x))));
    } else {
      const T x3 = V::mul(V::mul(x, x), x);
      const T z = V::mul(V::set1(0.7978845608028654f), V::fmadd(V::set1(0.044715f), x3, x));
      const T t = V::sub(one, V::div(V::set1(2.0f), V::add(exp_simd<V>(V::add(z, z)), one)));
      a = V::mul(V::mul(V::set1(0.5f), x), V::add(one, t));
    }
    V::store(g + i, V::mul(a, y));
  }
  if (i < n) glu_generic(g + i, u + i, n - i, s_gate, s_up, act);
}
