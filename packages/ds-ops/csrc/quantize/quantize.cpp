// Block quantization kernels (see quantize.h for the contract). Each group is two passes over its
// elements: the absolute maximum (and whether any is inf or nan), then the quantization, one vector
// of the widest backend (simd.h: AVX-512 16 lanes, AVX2 8, else scalar) at a time, the group's tail
// element by element. Every path computes the same float32 operations (a division, a rounding half
// to even, a clamp; a product for the dequantization, sums in tensor order), so the bytes equal
// those of the PyTorch reference (ds_ops.quantize's torch path) at every SIMD level. The op is built
// with -ffp-contract=off: a product and a sum fused into one rounding would not be the reference's.
#include "quantize.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtype.h"
#include "parallel.h"
#include "simd.h"

namespace ds {
namespace {

inline float qmax_of(int bits) { return bits == 8 ? 127.f : 7.f; }
inline int64_t quantized_bytes(int64_t n, int bits) { return bits == 8 ? n : (n + 1) / 2; }

// ---- one element ------------------------------------------------------------------------------------
inline int quantize_one(float x, float scale, float qmax) {
  const float r = std::nearbyint(x / scale);  // the default rounding mode: half to even
  return static_cast<int>(std::min(std::max(r, -qmax), qmax));
}
inline uint8_t pack_pair(int even, int odd) { return static_cast<uint8_t>(((even & 0xf) << 4) | (odd & 0xf)); }
inline int high_nibble(uint8_t b) { return static_cast<int8_t>(b) >> 4; }
inline int low_nibble(uint8_t b) { return static_cast<int8_t>(static_cast<uint8_t>(b << 4)) >> 4; }

// ---- one vector -------------------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int W = 16;
using V = __m512;
inline V vabs(V x) { return _mm512_abs_ps(x); }
struct NonFinite {  // whether a lane was ever inf or nan
  __mmask16 any = 0;
  void add(V a) { any |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ); }
  bool seen() const { return any != 0; }
};
inline V vquantize(V x, V scale, V qmax) {
  const V r = _mm512_roundscale_ps(_mm512_div_ps(x, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_min_ps(_mm512_max_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), qmax)), qmax);
}
inline __m128i to_bytes(V q) { return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)); }  // 16 int8
inline void store_q8(uint8_t* p, V q) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bytes(q)); }
inline __m128i pack_nibbles(__m128i b) {  // 16 int8 -> 8 bytes (in the low half)
  const __m128i low4 = _mm_set1_epi16(0x000f);
  const __m128i even = _mm_slli_epi16(_mm_and_si128(b, low4), 4), odd = _mm_and_si128(_mm_srli_epi16(b, 8), low4);
  return _mm_packus_epi16(_mm_or_si128(even, odd), _mm_setzero_si128());
}
inline void store_q4(uint8_t* p, V q) { _mm_storel_epi64(reinterpret_cast<__m128i*>(p), pack_nibbles(to_bytes(q))); }
inline __m128i unpack_nibbles(__m128i raw) {  // the low 8 bytes -> 16 int8, high nibble first
  const __m128i w = _mm_cvtepi8_epi16(raw);
  const __m128i even = _mm_srai_epi16(w, 4), odd = _mm_srai_epi16(_mm_slli_epi16(w, 12), 12);
  return _mm_or_si128(_mm_and_si128(even, _mm_set1_epi16(0x00ff)), _mm_slli_epi16(odd, 8));
}
inline V load_q8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline V load_q4(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(unpack_nibbles(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr int W = 8;
using V = __m256;
inline V vabs(V x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
struct NonFinite {
  __m256 any = _mm256_setzero_ps();
  void add(V a) { any = _mm256_or_ps(any, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ)); }
  bool seen() const { return _mm256_movemask_ps(any) != 0; }
};
inline V vquantize(V x, V scale, V qmax) {
  const V r = _mm256_round_ps(_mm256_div_ps(x, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_min_ps(_mm256_max_ps(r, _mm256_sub_ps(_mm256_setzero_ps(), qmax)), qmax);
}
inline __m128i to_bytes(V q) {  // 8 int8 in the low half
  const __m256i i = _mm256_cvtps_epi32(q);
  const __m128i s = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  return _mm_packs_epi16(s, s);
}
inline void store_q8(uint8_t* p, V q) { _mm_storel_epi64(reinterpret_cast<__m128i*>(p), to_bytes(q)); }
inline void store_q4(uint8_t* p, V q) {
  const __m128i low4 = _mm_set1_epi16(0x000f), b = to_bytes(q);
  const __m128i even = _mm_slli_epi16(_mm_and_si128(b, low4), 4), odd = _mm_and_si128(_mm_srli_epi16(b, 8), low4);
  const int32_t packed = _mm_cvtsi128_si32(_mm_packus_epi16(_mm_or_si128(even, odd), _mm_setzero_si128()));
  std::memcpy(p, &packed, 4);
}
inline V load_q8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V load_q4(const uint8_t* p) {
  int32_t raw;
  std::memcpy(&raw, p, 4);
  const __m128i w = _mm_cvtepi8_epi16(_mm_cvtsi32_si128(raw));
  const __m128i even = _mm_srai_epi16(w, 4), odd = _mm_srai_epi16(_mm_slli_epi16(w, 12), 12);
  const __m128i bytes = _mm_or_si128(_mm_and_si128(even, _mm_set1_epi16(0x00ff)), _mm_slli_epi16(odd, 8));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
#else
constexpr int W = 1;  // the scalar build: the element loops below do all the work
#endif

// ---- one group --------------------------------------------------------------------------------------
// The largest |x| of a group, and whether some x is inf or nan.
template <class T>
float group_absmax(const T* x, int64_t len, bool& nonfinite) {
  float m = 0.f;
  bool bad = false;
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
  if (len >= W) {
    V acc = Simd::set1(0.f);
    NonFinite nf;
    for (; i + W <= len; i += W) {
      const V a = vabs(Simd::load(x + i));
      nf.add(a);
      acc = Simd::max(acc, a);  // a nan lane leaves acc as it was; nf has seen it
    }
    m = Simd::reduce_max(acc);
    bad = nf.seen();
  }
#endif
  for (; i < len; ++i) {
    const float a = std::fabs(Scalar::load(x + i));
    bad |= !(a < INFINITY);
    m = a > m ? a : m;
  }
  nonfinite = bad;
  return m;
}

// Quantize a group of `len` elements into `q` (its first byte) and its scale into `*scale_out`.
template <class T>
void quantize_group(const T* x, int64_t len, int bits, uint8_t* q, float* scale_out) {
  const float qmax = qmax_of(bits);
  bool nonfinite;
  const float absmax = group_absmax(x, len, nonfinite);
  const float scale = nonfinite ? std::numeric_limits<float>::quiet_NaN() : absmax / qmax;
  *scale_out = scale;
  if (!(scale > 0.f)) {  // zeros, an underflowed scale, or inf/nan: q = 0
    std::memset(q, 0, static_cast<size_t>(quantized_bytes(len, bits)));
    return;
  }
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
  const V vs = Simd::set1(scale), vq = Simd::set1(qmax);
  if (bits == 8) {
    for (; i + W <= len; i += W) store_q8(q + i, vquantize(Simd::load(x + i), vs, vq));
  } else {
    for (; i + W <= len; i += W) store_q4(q + i / 2, vquantize(Simd::load(x + i), vs, vq));
  }
#endif
  if (bits == 8) {
    for (; i < len; ++i) q[i] = static_cast<uint8_t>(static_cast<int8_t>(quantize_one(Scalar::load(x + i), scale, qmax)));
  } else {
    for (; i < len; i += 2) {  // i is even here (W is even)
      const int even = quantize_one(Scalar::load(x + i), scale, qmax);
      const int odd = i + 1 < len ? quantize_one(Scalar::load(x + i + 1), scale, qmax) : 0;
      q[i / 2] = pack_pair(even, odd);
    }
  }
}

inline float q_at(const uint8_t* q, int64_t i, int bits) {  // element i of a quantized group, as float
  if (bits == 8) return static_cast<float>(static_cast<int8_t>(q[i]));
  return static_cast<float>(i % 2 ? low_nibble(q[i / 2]) : high_nibble(q[i / 2]));
}

template <class T>
void dequantize_group(const uint8_t* q, float scale, int64_t len, int bits, T* out) {
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
  const V vs = Simd::set1(scale);
  if (bits == 8) {
    for (; i + W <= len; i += W) Simd::store(out + i, Simd::mul(load_q8(q + i), vs));
  } else {
    for (; i + W <= len; i += W) Simd::store(out + i, Simd::mul(load_q4(q + i / 2), vs));
  }
#endif
  for (; i < len; ++i) Scalar::store(out + i, q_at(q, i, bits) * scale);
}

// The sum of k dequantized groups (tensor t's group at q + t * stride, scale scales[t * groups]), in
// tensor order, into out (len elements of T).
template <class T>
void sum_group(const uint8_t* q, int64_t stride, const float* scales, int64_t groups, int64_t k, int64_t len,
               int bits, T* out) {
  int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
  for (; i + W <= len; i += W) {
    V acc = Simd::set1(0.f);
    for (int64_t t = 0; t < k; ++t) {
      const uint8_t* qt = q + t * stride;
      const V x = Simd::mul(bits == 8 ? load_q8(qt + i) : load_q4(qt + i / 2), Simd::set1(scales[t * groups]));
      acc = t == 0 ? x : Simd::add(acc, x);
    }
    Simd::store(out + i, acc);
  }
#endif
  for (; i < len; ++i) {
    float acc = 0.f;
    for (int64_t t = 0; t < k; ++t) {
      const float x = q_at(q + t * stride, i, bits) * scales[t * groups];
      acc = t == 0 ? x : acc + x;
    }
    Scalar::store(out + i, acc);
  }
}

// ---- over the groups --------------------------------------------------------------------------------
// fn(g, scratch) for every group g, on up to num_threads threads (one below kSerialBelow elements);
// scratch: a float buffer of group_size elements private to the thread.
template <class F>
void for_each_group(int64_t n, int64_t group_size, int num_threads, bool with_scratch, F&& fn) {
  const int64_t groups = (n + group_size - 1) / group_size;
  const int nt = (num_threads <= 1 || n < kSerialBelow) ? 1 : static_cast<int>(std::min<int64_t>(num_threads, groups));
  if (nt == 1) {
    const IeeeDenormals ieee;
    std::vector<float> scratch(with_scratch ? static_cast<size_t>(group_size) : 0);
    for (int64_t g = 0; g < groups; ++g) fn(g, scratch.data());
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    const IeeeDenormals ieee;
    std::vector<float> scratch(with_scratch ? static_cast<size_t>(group_size) : 0);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) fn(g, scratch.data());
  }
}

void check(int64_t n, int64_t group_size, int bits) {
  if (bits != 8 && bits != 4) throw std::invalid_argument("block quantization: bits must be 8 or 4, got " + std::to_string(bits));
  if (group_size < 1 || (bits == 4 && group_size % 2))
    throw std::invalid_argument("block quantization: group_size must be positive (and even for int4), got " +
                                std::to_string(group_size));
  if (n < 0) throw std::invalid_argument("block quantization: negative element count " + std::to_string(n));
}

}  // namespace

void block_quantize(int64_t x, int dtype, int64_t n, int64_t group_size, int bits, int64_t q, int64_t scales,
                    int num_threads) {
  check(n, group_size, bits);
  with_dtype(dtype, "block_quantize", [&](auto tag) {
    using T = Elem<decltype(tag)>;
    const T* in = as_ptr<T>(x);
    uint8_t* out = as_ptr<uint8_t>(q);
    float* s = as_ptr<float>(scales);
    for_each_group(n, group_size, num_threads, false, [&](int64_t g, float*) {
      const int64_t start = g * group_size, len = std::min(group_size, n - start);
      quantize_group(in + start, len, bits, out + quantized_bytes(start, bits), s + g);
    });
  });
}

void block_dequantize(int64_t q, int64_t scales, int64_t n, int64_t group_size, int bits, int64_t out,
                      int out_dtype, int num_threads) {
  check(n, group_size, bits);
  with_dtype(out_dtype, "block_dequantize", [&](auto tag) {
    using T = Elem<decltype(tag)>;
    const uint8_t* in = as_ptr<const uint8_t>(q);
    const float* s = as_ptr<const float>(scales);
    T* o = as_ptr<T>(out);
    for_each_group(n, group_size, num_threads, false, [&](int64_t g, float*) {
      const int64_t start = g * group_size, len = std::min(group_size, n - start);
      dequantize_group(in + quantized_bytes(start, bits), s[g], len, bits, o + start);
    });
  });
}

void block_dequantize_sum(int64_t q, int64_t scales, int64_t k, int64_t n, int64_t group_size, int bits,
                          int64_t out_q, int64_t out_scales, int out_bits, int64_t out, int out_dtype,
                          int num_threads) {
  check(n, group_size, bits);
  if (k < 1) throw std::invalid_argument("block_dequantize_sum: need at least one tensor, got " + std::to_string(k));
  const int64_t groups = (n + group_size - 1) / group_size, stride = quantized_bytes(n, bits);
  const uint8_t* in = as_ptr<const uint8_t>(q);
  const float* s = as_ptr<const float>(scales);
  if (out_q != 0) {
    check(n, group_size, out_bits);
    uint8_t* oq = as_ptr<uint8_t>(out_q);
    float* os = as_ptr<float>(out_scales);
    for_each_group(n, group_size, num_threads, true, [&](int64_t g, float* scratch) {
      const int64_t start = g * group_size, len = std::min(group_size, n - start);
      sum_group(in + quantized_bytes(start, bits), stride, s + g, groups, k, len, bits, scratch);
      quantize_group(static_cast<const float*>(scratch), len, out_bits, oq + quantized_bytes(start, out_bits), os + g);
    });
    return;
  }
  with_dtype(out_dtype, "block_dequantize_sum", [&](auto tag) {
    using T = Elem<decltype(tag)>;
    T* o = as_ptr<T>(out);
    for_each_group(n, group_size, num_threads, false, [&](int64_t g, float*) {
      const int64_t start = g * group_size, len = std::min(group_size, n - start);
      sum_group(in + quantized_bytes(start, bits), stride, s + g, groups, k, len, bits, o + start);
    });
  });
}

}  // namespace ds
