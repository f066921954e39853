// Turning runtime dtype codes into template arguments, and state stores that round stochastically
// when the state is bf16.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__SSE__)
#include <xmmintrin.h>  // _mm_prefetch, also in the scalar (portable) build
#endif

#include "dtype.h"
#include "simd.h"

namespace ds {

struct NoOut {};  // "no 16-bit copy of the parameters"

template <class F>
void with_state_dtype(int code, F&& f) {
  if (code == kF32) f(static_cast<float*>(nullptr));
  else if (code == kBF16) f(static_cast<bf16*>(nullptr));
  else throw std::invalid_argument("optimizer state dtype must be float32 or bfloat16, got code " + std::to_string(code));
}

template <class F>
void with_out_dtype(int code, F&& f) {
  if (code < 0) f(static_cast<NoOut*>(nullptr));
  else if (code == kF16) f(static_cast<f16*>(nullptr));
  else if (code == kBF16) f(static_cast<bf16*>(nullptr));
  else throw std::invalid_argument("the parameter copy must be float16 or bfloat16, got code " + std::to_string(code));
}

// Software prefetch this many elements ahead: a core has more memory requests in flight than its
// hardware prefetchers alone keep there, which is what a streaming kernel is bounded by.
#ifndef DS_PREFETCH_AHEAD
#define DS_PREFETCH_AHEAD 1024
#endif
constexpr int64_t kPrefetchAhead = DS_PREFETCH_AHEAD;

template <class... T>
inline void prefetch(const T*... addresses) {
#if defined(__SSE__)
  (_mm_prefetch(reinterpret_cast<const char*>(addresses), _MM_HINT_T0), ...);
#endif
}

// Store a state vector: bf16 states round stochastically with the given 16-bit noise.
template <class B, class S>
inline void store_state(S* base, int64_t i, typename B::V x, typename B::IV noise16) {
  if constexpr (std::is_same_v<S, bf16>) B::store_stochastic(base + i, x, noise16);
  else B::store(base + i, x);
}

// The rounding noise of bf16 states: `noise()` hashes the counter of the current elements,
// `advance()` moves it one vector on. Free (no-op) when the state is float32.
template <class B, class S>
struct StateNoise {
  typename B::IV counter{};
  StateNoise(int64_t i, uint32_t seed) {
    if constexpr (std::is_same_v<S, bf16>) counter = B::counter(i, seed);
  }
  typename B::IV noise() const {
    if constexpr (std::is_same_v<S, bf16>) return B::hash(counter);
    else return typename B::IV{};
  }
  void advance() {
    if constexpr (std::is_same_v<S, bf16>) counter = B::next(counter);
  }
};

// The last, partial vector of a span, stepped by the same vector code as the whole ones: its `n`
// elements are copied into zeroed lanes (zeros are harmless inputs to every kernel: no inf, no nan),
// the kernel runs on `lanes`, and `write_back` copies the `n` results out. A scalar tail would give
// those elements other bits wherever the vector code uses hardware estimates (AVX-512's rsqrt14 and
// rcp14, the bf16 states' coarse sqrt and reciprocal on AVX2 and AVX-512): an element's result would
// depend on the length of the tensor or chunk it is stepped in (ZeRO steps a partition whole with CPU
// offload, in sub-group chunks with NVMe offload, and between two threads wherever the cut falls).
// T may be const (read only); a null source (no 16-bit copy) gives null lanes and copies nothing.
template <int W, class T>
struct TailLanes {
  using E = std::remove_const_t<T>;
  E storage[W]{};
  T* source;
  int64_t n;
  E* lanes;
  TailLanes(T* src, int64_t count) : source(src), n(count), lanes(src == nullptr ? nullptr : storage) {
    if (src != nullptr) std::copy(src, src + count, storage);
  }
  void write_back() {
    if constexpr (!std::is_const_v<T>) {
      if (source != nullptr) std::copy(storage, storage + n, source);
    }
  }
};

// The seed of the stochastic rounding of one tensor: different per step (the caller's seed) and tensor.
inline uint32_t stream_seed(uint32_t seed, size_t tensor) {
  return mix32(seed ^ mix32(static_cast<uint32_t>(tensor) * 0x85ebca6bU + 1U));
}

}  // namespace ds
