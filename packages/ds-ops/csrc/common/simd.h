// SIMD layer of ds-ops: one kernel source, compiled for the widest instruction set the build
// targets. `Simd` is the widest backend (AVX-512: 16 lanes, AVX2: 8, else scalar); `Scalar` is
// used for the tails. Storage types: float, f16 and bf16 (16-bit patterns), no torch headers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace ds {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

inline const char* simd_level() {
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__)
  return "AVX2";
#else
  return "scalar";
#endif
}

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
  return x;
}
// The noise of stochastic rounding: a counter-based hash (no state, so the result does not depend
// on how elements are split among threads or lanes). Element i at a given seed always gets the
// same 32 bits; the low 16 round one state, the high 16 another. The counter is linear in i, so a
// loop advances it with one add; one multiply between two xor-shifts mixes it well enough for
// rounding noise (the tests check the rounding is unbiased).
constexpr uint32_t kCounterStep = 0x9E3779B9U;
inline uint32_t random_counter(int64_t index, uint32_t seed) {
  return static_cast<uint32_t>(index) * kCounterStep + seed;
}
inline uint32_t hash_counter(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352dU;
  return x ^ (x >> 15);
}

// ---- scalar conversions -------------------------------------------------------------------
inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float to_float(bf16 h) { return bits_to_float(uint32_t(h.bits) << 16); }
inline bf16 to_bf16_nearest(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffU) > 0x7f800000U) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffU + ((u >> 16) & 1U);
  return bf16{uint16_t(u >> 16)};
}
// Stochastic rounding: round up with probability (dropped bits / 2^16), so E[result] == f.
// `noise16` is uniform in [0, 2^16). A nan keeps its quiet bit so it stays a nan.
inline bf16 to_bf16_stochastic(float f, uint32_t noise16) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffU) > 0x7f800000U) return bf16{uint16_t((u >> 16) | 0x40)};
  return bf16{uint16_t((u + noise16) >> 16)};
}

inline float to_float(f16 h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.bits);
#else
  uint32_t sign = uint32_t(h.bits & 0x8000) << 16, exp = (h.bits >> 10) & 0x1f, man = h.bits & 0x3ff;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000U | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    float v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
#endif
}
inline f16 to_f16(float f) {
#if defined(__F16C__)
  return f16{_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)};
#else
  uint32_t u = float_to_bits(f), sign = (u >> 16) & 0x8000;
  uint32_t a = u & 0x7fffffffU;
  if (a >= 0x7f800000U) return f16{uint16_t(sign | 0x7c00 | (a > 0x7f800000U ? 0x200 : 0))};
  if (a >= 0x477ff000U) return f16{uint16_t(sign | 0x7c00)};  // rounds to inf
  if (a < 0x38800000U) {  // subnormal or zero: scale, round to nearest even
    float v = bits_to_float(a) * 16777216.0f;  // 2^24
    return f16{uint16_t(sign | uint32_t(std::nearbyint(v)))};
  }
  uint32_t r = a + 0xfffU + ((a >> 13) & 1U) - (112U << 23);
  return f16{uint16_t(sign | (r >> 13))};
#endif
}

// ---- e^x ------------------------------------------------------------------------------------
constexpr float kExpLow = -87.3f, kExpHigh = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 = high + low, high exact in 9 bits
// e^f for |f| <= ln2/2: 1 + f + f^2 (1/2 + f/6 + f^2/24 + ...), Taylor coefficients to 1/7!
// (truncation error below 2^-24 on the interval).
template <class B>
inline typename B::V exp_polynomial(typename B::V f) {
  typename B::V p = B::set1(1.f / 5040.f);
  p = B::fmadd(p, f, B::set1(1.f / 720.f));
  p = B::fmadd(p, f, B::set1(1.f / 120.f));
  p = B::fmadd(p, f, B::set1(1.f / 24.f));
  p = B::fmadd(p, f, B::set1(1.f / 6.f));
  p = B::fmadd(p, f, B::set1(0.5f));
  return B::fmadd(p, B::mul(f, f), B::add(f, B::set1(1.f)));
}

// ---- backends -------------------------------------------------------------------------------
struct Scalar {
  using V = float;
  using IV = uint32_t;
  static constexpr int W = 1;
  static IV counter(int64_t index, uint32_t seed) { return random_counter(index, seed); }
  static IV next(IV c) { return c + kCounterStep; }
  static IV hash(IV c) { return hash_counter(c); }
  static IV low16(IV r) { return r & 0xffffU; }
  static IV high16(IV r) { return r >> 16; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static V load(const f16* p) { return to_float(*p); }
  static V load(const bf16* p) { return to_float(*p); }
  static void store(float* p, V x) { *p = x; }
  static void store(f16* p, V x) { *p = to_f16(x); }
  static void store(bf16* p, V x) { *p = to_bf16_nearest(x); }
  static void store_stochastic(bf16* p, V x, IV noise16) { *p = to_bf16_stochastic(x, noise16); }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V fmadd(V a, V b, V c) { return std::fma(a, b, c); }   // a*b + c
  static V fnmadd(V a, V b, V c) { return std::fma(-a, b, c); } // c - a*b
  static V sqrt(V a) { return std::sqrt(a); }
  static V sqrt_fast(V a) { return std::sqrt(a); }
  static V rcp_fast(V a) { return 1.f / a; }
  static V sqrt_coarse(V a) { return std::sqrt(a); }
  static V rcp_coarse(V a) { return 1.f / a; }
  static bool estimates_serve(V) { return true; }  // exact here
  static bool coarse_estimates_serve(V) { return true; }
  static V sign(V a) { return a > 0.f ? 1.f : (a < 0.f ? -1.f : 0.f); }
  static float sum(V a) { return a; }
  static V max(V a, V b) { return a > b ? a : b; }
  static float reduce_max(V a) { return a; }
  // as the vector backends: e^x under FLT_MIN (x < -87.3, -inf too) is exactly 0, never a subnormal
  static V exp(V a) { return a < kExpLow ? 0.f : std::exp(a); }
};

#if defined(__AVX512F__)
struct Avx512 {
  using V = __m512;
  using IV = __m512i;
  static constexpr int W = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const bf16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void store(f16* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store(bf16* p, V x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
  // the counters of 16 consecutive elements, and their hashes
  static IV counter(int64_t index, uint32_t seed) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(index))), lanes);
    return _mm512_add_epi32(_mm512_mullo_epi32(idx, _mm512_set1_epi32(static_cast<int>(kCounterStep))),
                            _mm512_set1_epi32(static_cast<int>(seed)));
  }
  static IV next(IV c) { return _mm512_add_epi32(c, _mm512_set1_epi32(static_cast<int>(16U * kCounterStep))); }
  static IV hash(IV x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  }
  static IV low16(IV r) { return _mm512_and_si512(r, _mm512_set1_epi32(0xffff)); }
  static IV high16(IV r) { return _mm512_srli_epi32(r, 16); }
  // the integer add and truncation of the scalar definition, exactly: AVX512_BF16's one-instruction
  // form (round to nearest of x + noise - 1/2 ulp) breaks ties to even and flushes subnormals, so it
  // would give other bits than the AVX2 and scalar builds in rare cases
  static void store_stochastic(bf16* p, V x, IV noise16) {
    const __mmask16 number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);  // nan gets no noise: stays nan
    __m512i rounded = _mm512_mask_add_epi32(_mm512_castps_si512(x), number, _mm512_castps_si512(x), noise16);
    rounded = _mm512_mask_or_epi32(rounded, static_cast<__mmask16>(~number), rounded, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  // sqrt and 1/x from the 14-bit estimates plus one Newton step (about 2^-22 relative error):
  // a few cycles per vector instead of the divider's 10-12, which bounds a memory-bound kernel.
  // The estimates serve a range (`estimates_serve`), and a kernel takes the exact instructions for a
  // vector with a lane outside it (README, "Denormals"). sqrt_fast: 0 <= a <= FLT_MAX, subnormals
  // included: the Newton step is ordered to overflow nowhere, y*(1.5 - (a/2*y)*y); the former
  // y*(1.5 - a/2*(y*y)) squared y = 1/sqrt(a) to inf for every a < 2^-126, and gave nan. rcp_fast:
  // FLT_MIN <= a <= FLT_MAX.
  static V sqrt_fast(V a) {
    const V y = _mm512_rsqrt14_ps(a);
    const V half_a_y = _mm512_mul_ps(_mm512_mul_ps(a, _mm512_set1_ps(0.5f)), y);
    const V refined = _mm512_mul_ps(y, _mm512_fnmadd_ps(half_a_y, y, _mm512_set1_ps(1.5f)));
    return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ), a, refined);
  }
  static V rcp_fast(V a) {
    const V y = _mm512_rcp14_ps(a);
    return _mm512_mul_ps(y, _mm512_fnmadd_ps(a, y, _mm512_set1_ps(2.f)));
  }
  // the bare 14-bit estimates, for results stored in bf16 (8-bit mantissa) anyway; the same ranges
  static V sqrt_coarse(V a) {
    return _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ), a, _mm512_rsqrt14_ps(a));
  }
  static V rcp_coarse(V a) { return _mm512_rcp14_ps(a); }
  // whether every lane is in the range sqrt_fast and sqrt_coarse serve: +0, subnormal or a finite
  // positive number (as unsigned bits: at most FLT_MAX's; -0, negatives, inf and nan are above)
  static bool estimates_serve(V a) {
    return _mm512_cmple_epu32_mask(_mm512_castps_si512(a), _mm512_set1_epi32(0x7f7fffff)) == 0xffff;
  }
  static bool coarse_estimates_serve(V a) { return estimates_serve(a); }
  static V sign(V a) {
    __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
    __mmask16 neg = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mask_mov_ps(_mm512_maskz_mov_ps(pos, _mm512_set1_ps(1.f)), neg, _mm512_set1_ps(-1.f));
  }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float reduce_max(V a) { return _mm512_reduce_max_ps(a); }
  // e^x, about 1 ulp: x = n ln2 + f with |f| <= ln2/2, e^f by a degree-7 polynomial, times 2^n.
  // Below -87.3 (e^x under FLT_MIN, and -inf) gives exactly 0; a nan stays a nan.
  static V exp(V x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_NLT_UQ);
    x = _mm512_min_ps(_mm512_set1_ps(kExpHigh), _mm512_max_ps(_mm512_set1_ps(kExpLow), x));
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(keep, exp_poly(reduce_ln2(x, n)), n);
  }
  static V reduce_ln2(V x, V n) {
    return _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x));
  }
  static V exp_poly(V f) { return exp_polynomial<Avx512>(f); }
};
using Simd = Avx512;
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
struct Avx2 {
  using V = __m256;
  using IV = __m256i;
  static constexpr int W = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load(const bf16* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static void store(f16* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static void pack_high_halves(bf16* p, __m256i u) {
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store(bf16* p, V x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    pack_high_halves(p, rounded);
  }
  static IV counter(int64_t index, uint32_t seed) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(index))),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_add_epi32(_mm256_mullo_epi32(idx, _mm256_set1_epi32(static_cast<int>(kCounterStep))),
                            _mm256_set1_epi32(static_cast<int>(seed)));
  }
  static IV next(IV c) { return _mm256_add_epi32(c, _mm256_set1_epi32(static_cast<int>(8U * kCounterStep))); }
  static IV hash(IV x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  }
  static IV low16(IV r) { return _mm256_and_si256(r, _mm256_set1_epi32(0xffff)); }
  static IV high16(IV r) { return _mm256_srli_epi32(r, 16); }
  static void store_stochastic(bf16* p, V x, IV noise16) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    pack_high_halves(p, _mm256_blendv_epi8(_mm256_add_epi32(u, noise16),
                                           _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan));
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V sqrt_fast(V a) { return _mm256_sqrt_ps(a); }  // the 12-bit estimates need two Newton steps
  static V rcp_fast(V a) { return _mm256_div_ps(_mm256_set1_ps(1.f), a); }
  static V sqrt_coarse(V a) {
    const V positive = _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GT_OQ);
    return _mm256_and_ps(positive, _mm256_mul_ps(a, _mm256_rsqrt_ps(a)));
  }
  static V rcp_coarse(V a) { return _mm256_rcp_ps(a); }
  static bool estimates_serve(V) { return true; }  // sqrt_fast and rcp_fast are exact here
  // The legacy RSQRTPS/RCPPS answer inf for inputs below about 2^-126 (a subnormal's square root came
  // out inf): the coarse estimates serve +0 and 2^-125 <= a <= FLT_MAX (as unsigned bits).
  static bool coarse_estimates_serve(V a) {
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i above = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x01000000), bits);  // bits < 2^-125's (or negative)
    const __m256i huge = _mm256_cmpgt_epi32(bits, _mm256_set1_epi32(0x7f7fffff));  // inf, nan
    const __m256i zero = _mm256_cmpeq_epi32(bits, _mm256_setzero_si256());
    return _mm256_testz_si256(_mm256_andnot_si256(zero, _mm256_or_si256(above, huge)), _mm256_set1_epi32(-1));
  }
  static V sign(V a) {
    V pos = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_set1_ps(1.f));
    V neg = _mm256_and_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ), _mm256_set1_ps(1.f));
    return _mm256_sub_ps(pos, neg);
  }
  static float sum(V a) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, a);
    float s = 0.f;
    for (float t : tmp) s += t;
    return s;
  }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float reduce_max(V a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static V exp(V x) {  // as Avx512::exp; 2^n built in the exponent field (n in [-126, 127])
    const V keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_NLT_UQ);
    x = _mm256_min_ps(_mm256_set1_ps(kExpHigh), _mm256_max_ps(_mm256_set1_ps(kExpLow), x));
    const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x));
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    const V scale = _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
    return _mm256_and_ps(keep, _mm256_mul_ps(exp_polynomial<Avx2>(f), scale));
  }
};
using Simd = Avx2;
#else
using Simd = Scalar;
#endif

}  // namespace ds
