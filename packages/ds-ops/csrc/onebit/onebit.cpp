// 1-bit compression kernels (see onebit.h). Every loop works on groups of eight floats, one
// byte of signs: one AVX2 register where the build has AVX2 (AVX-512 builds too: the kernels are
// bounded by memory, not by the width), eight scalars otherwise. Threads take contiguous ranges of
// the elements (parallel.h), cut further at chunk boundaries, so each streams through memory in
// order and no two write the same byte. Each kernel is one pass: the error of the last call is
// recomputed from the state as it is read (onebit.h), so no pass has to wait for a scale.
//
// The results are exactly those of the PyTorch reference (ds_comm's torch path) for the same
// scales: a sign is `w >= 0`, an error is `previous - (+-scale)`, a value `x + error` and an average
// `((+-s0 +-s1) ...) / world + error`, the same float32 operations in the same order. Only the
// scales' sums of squares are summed in another order (both in double, from exact float32 squares),
// so a scale could differ in its last bit in rare cases; in the tests they are identical. The op is built with
// -ffp-contract=off: a multiply and an add fused into one rounding would not be the reference's.
#include "onebit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtype.h"
#include "parallel.h"
#include "simd.h"

namespace ds {
namespace {

// Lane j of entry b is all ones where bit j of b is set: a sign byte becomes a blend mask in one
// load (8 KiB, stays in L1) instead of a broadcast, an and and a compare.
struct LaneMasks {
  alignas(32) uint32_t lanes[256][8];
  constexpr LaneMasks() : lanes() {
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) lanes[b][j] = (b >> j) & 1 ? 0xffffffffU : 0U;
  }
};
constexpr LaneMasks kLaneMasks{};

#if defined(__AVX2__)
// +scale and -scale in every lane
struct Scale {
  __m256 pos, neg;
  explicit Scale(float s) : pos(_mm256_set1_ps(s)), neg(_mm256_set1_ps(-s)) {}
};

// Eight floats in one AVX2 register.
struct Eight {
  __m256 v;
  static Eight load(const float* p) { return {_mm256_loadu_ps(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void stream(float* p) const { _mm256_stream_ps(p, v); }  // p 32-byte aligned; no read of the line
  Eight operator+(Eight o) const { return {_mm256_add_ps(v, o.v)}; }
  Eight operator/(float d) const { return {_mm256_div_ps(v, _mm256_set1_ps(d))}; }
  Eight operator*(float m) const { return {_mm256_mul_ps(v, _mm256_set1_ps(m))}; }
  __m256 nonnegative() const { return _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ); }  // nan: false
  // bit i set where element i is >= 0
  uint8_t signs() const { return static_cast<uint8_t>(_mm256_movemask_ps(nonnegative())); }
  // the compression error: this minus +scale where >= 0, minus -scale elsewhere
  Eight minus_signed(const Scale& s) const { return {_mm256_sub_ps(v, _mm256_blendv_ps(s.neg, s.pos, nonnegative()))}; }
  // +scale where bit i of `bits` is set, -scale elsewhere
  static Eight signed_scale(uint8_t bits, const Scale& s) {
    return {_mm256_blendv_ps(s.neg, s.pos, _mm256_load_ps(reinterpret_cast<const float*>(kLaneMasks.lanes[bits])))};
  }
};
inline void stream_fence() { _mm_sfence(); }

// Sum of squares in double: each float32 square is exact in double; two accumulators of four.
struct SquareSum {
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  void add(Eight w) {
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(w.v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(w.v, 1));
    low = _mm256_fmadd_pd(a, a, low);
    high = _mm256_fmadd_pd(b, b, high);
  }
  double total() const {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(low, high));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
};
#else
struct Scale {
  float pos, neg;
  explicit Scale(float s) : pos(s), neg(-s) {}
};

// Eight floats, portable (the compiler vectorises what it can).
struct Eight {
  float v[8];
  static Eight load(const float* p) {
    Eight e;
    std::memcpy(e.v, p, sizeof e.v);
    return e;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof v); }
  void stream(float* p) const { store(p); }
  Eight operator+(Eight o) const {
    Eight e;
    for (int j = 0; j < 8; ++j) e.v[j] = v[j] + o.v[j];
    return e;
  }
  Eight operator/(float d) const {
    Eight e;
    for (int j = 0; j < 8; ++j) e.v[j] = v[j] / d;
    return e;
  }
  Eight operator*(float m) const {
    Eight e;
    for (int j = 0; j < 8; ++j) e.v[j] = v[j] * m;
    return e;
  }
  uint8_t signs() const {
    unsigned bits = 0;
    for (int j = 0; j < 8; ++j) bits |= static_cast<unsigned>(v[j] >= 0.f) << j;
    return static_cast<uint8_t>(bits);
  }
  Eight minus_signed(const Scale& s) const {
    Eight e;
    for (int j = 0; j < 8; ++j) e.v[j] = v[j] - (v[j] >= 0.f ? s.pos : s.neg);
    return e;
  }
  static Eight signed_scale(uint8_t bits, const Scale& s) {
    Eight e;
    for (int j = 0; j < 8; ++j) e.v[j] = kLaneMasks.lanes[bits][j] ? s.pos : s.neg;
    return e;
  }
};
inline void stream_fence() {}

struct SquareSum {
  double sum = 0.0;
  void add(Eight w) {
    for (float x : w.v) sum += static_cast<double>(x) * x;
  }
  double total() const { return sum; }
};
#endif

inline int64_t byte_of(int64_t i) { return i >> 3; }  // the byte of element i's sign (i >= 0)

// Software prefetch this many elements (4 KiB of floats) ahead of the loop, one cache line per stream
// per 16 elements. The hardware prefetchers alone leave the one-pass loops 20-30 % below a plain
// read-modify-write over the same streams here (their work per element keeps fewer loads in
// flight); with it, about 10 % (compress) and at it (average).
constexpr int64_t kPrefetchAhead = 1024;
inline void prefetch(const float* p) { __builtin_prefetch(p, 0, 3); }

// The worker's values: w = x + e, with x read as 0 from element n on, where e, the error of the
// last compression, is recomputed from the state: e = previous - (+-scale of the previous).
struct WorkerValues {
  const float* x;
  const float* previous;
  int64_t n;
  int64_t total;  // elements of previous
  void prefetch_ahead(int64_t i) const {
    if (i + kPrefetchAhead < n) prefetch(x + i + kPrefetchAhead);
    if (i + kPrefetchAhead < total) prefetch(previous + i + kPrefetchAhead);
  }
  Eight at(int64_t i, const Scale& previous_scale) const {
    const Eight e = Eight::load(previous + i).minus_signed(previous_scale);
    if (i + 8 <= n) return Eight::load(x + i) + e;
    if (i >= n) return e;
    float w[8];  // the one group that straddles n
    e.store(w);
    for (int64_t j = 0; j < 8 && i + j < n; ++j) w[j] = x[i + j] + w[j];
    return Eight::load(w);
  }
};

// The server's values: the average of `world` decompressed frames, plus its error feedback (from
// its state, as the worker's). With a power-of-two world the division is a multiplication by
// 1/world, which rounds identically (both are exact up to the one rounding of the sum) and costs a
// fraction of a divide. kWorld: 2 unrolls the two ranks' terms, 0 loops over `world` of them.
template <bool kPowerOfTwo, int kWorld>
struct AverageValues {
  const uint8_t* frames;  // world frames of one chunk
  int64_t frame_stride;
  const Scale* scales;  // one per rank
  int64_t world;
  const float* previous;
  int64_t total;  // elements of previous (one chunk)
  void prefetch_ahead(int64_t i) const {
    if (i + kPrefetchAhead < total) prefetch(previous + i + kPrefetchAhead);
  }
  Eight at(int64_t i, const Scale& previous_scale) const {
    const int64_t byte = byte_of(i);
    Eight sum = Eight::signed_scale(frames[byte], scales[0]);
    if constexpr (kWorld == 2) {
      sum = sum + Eight::signed_scale(frames[frame_stride + byte], scales[1]);
    } else {
      for (int64_t r = 1; r < world; ++r) sum = sum + Eight::signed_scale(frames[r * frame_stride + byte], scales[r]);
    }
    const float count = static_cast<float>(kWorld ? kWorld : world);
    return (kPowerOfTwo ? sum * (1.f / count) : sum / count) + Eight::load(previous + i).minus_signed(previous_scale);
  }
};

#ifndef DS_ONEBIT_STREAM_BYTES
#define DS_ONEBIT_STREAM_BYTES (16 << 20)
#endif
constexpr int64_t kStreamBytes = DS_ONEBIT_STREAM_BYTES;

float scale_of(const uint8_t* frame, int64_t chunk) {
  float scale;
  std::memcpy(&scale, frame + chunk / 8, sizeof scale);
  return scale;
}

// fn(c, begin, end) for each piece of [lo, hi) inside one chunk c
template <class F>
void for_chunk_pieces(int64_t lo, int64_t hi, int64_t chunk, F&& fn) {
  while (lo < hi) {
    const int64_t c = lo / chunk, end = std::min(hi, (c + 1) * chunk);
    fn(c, lo, end);
    lo = end;
  }
}

// The scale of a chunk from its sum of squares: its root mean square, sqrt(sum) / sqrt(chunk) in
// double, rounded once to float32 (as the reference: vector_norm in float64 / sqrt(chunk)).
float rms(double square_sum, int64_t chunk) {
  return static_cast<float>(std::sqrt(square_sum) / std::sqrt(static_cast<double>(chunk)));
}

// The one pass: for every group of eight values w (total a multiple of 8), its signs into the
// frame of its chunk and w over the state's `previous` (which the values read: each group is read
// before it is written), the chunk's sum of squares accumulated; then every chunk's scale into its
// frame and over `scales` (read by the values with the previous ones until then).
template <class Values>
void compress(const Values& values, float* previous, float* scales, int64_t chunks, int64_t chunk, uint8_t* frames,
              int num_threads) {
  const int64_t total = chunks * chunk, stride = frame_bytes(chunk);
  const std::vector<double> sums =
      parallel_sum(total, num_threads, static_cast<int>(chunks), [&](int64_t lo, int64_t hi, double* partial) {
        for_chunk_pieces(lo, hi, chunk, [&](int64_t c, int64_t i, int64_t end) {
          uint8_t* bits = frames + c * stride - byte_of(c * chunk);  // bits[byte_of(i)]: i's signs
          const Scale previous_scale(scales[c]);
          const Values v = values;  // a local copy: the byte stores below cannot alias its fields
          float* out = previous;
          SquareSum a, b;  // two chains, so the adds wait on memory, not on each other
          for (; i + 16 <= end; i += 16) {
            v.prefetch_ahead(i);
            const Eight w0 = v.at(i, previous_scale), w1 = v.at(i + 8, previous_scale);
            bits[byte_of(i)] = w0.signs();
            bits[byte_of(i) + 1] = w1.signs();
            w0.store(out + i);
            w1.store(out + i + 8);
            a.add(w0);
            b.add(w1);
          }
          if (i < end) {
            const Eight w = v.at(i, previous_scale);
            bits[byte_of(i)] = w.signs();
            w.store(out + i);
            a.add(w);
          }
          partial[c] += a.total() + b.total();
        });
      });
  for (int64_t c = 0; c < chunks; ++c) {
    scales[c] = rms(sums[c], chunk);
    std::memcpy(frames + c * stride + chunk / 8, &scales[c], sizeof(float));
  }
}

void check_chunk(const char* what, int64_t chunks, int64_t chunk) {
  if (chunks < 1 || chunk < 8 || chunk % 8)
    throw std::invalid_argument(std::string(what) + ": need at least one chunk of a positive multiple of 8 "
                                "elements, got " + std::to_string(chunks) + " of " + std::to_string(chunk));
}

}  // namespace

void onebit_compress(int64_t x, int64_t n, int64_t values, int64_t scales, int64_t chunks, int64_t chunk,
                     int64_t frames, int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  check_chunk("onebit_compress", chunks, chunk);
  if (n < 0 || n > chunks * chunk)
    throw std::invalid_argument("onebit_compress: n must be in [0, chunks * chunk], got " + std::to_string(n));
  const WorkerValues w{as_ptr<const float>(x), as_ptr<const float>(values), n, chunks * chunk};
  compress(w, as_ptr<float>(values), as_ptr<float>(scales), chunks, chunk, as_ptr<uint8_t>(frames), num_threads);
}

void onebit_average(int64_t frames, int64_t world, int64_t chunk, int64_t values, int64_t scale, int64_t out_frame,
                    int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  check_chunk("onebit_average", world, chunk);
  const uint8_t* in = as_ptr<const uint8_t>(frames);
  const int64_t stride = frame_bytes(chunk);
  std::vector<Scale> scales;
  for (int64_t r = 0; r < world; ++r) scales.emplace_back(scale_of(in + r * stride, chunk));
  float* previous = as_ptr<float>(values);
  float* previous_scale = as_ptr<float>(scale);
  uint8_t* out = as_ptr<uint8_t>(out_frame);
  if (world == 2) {
    compress(AverageValues<true, 2>{in, stride, scales.data(), world, previous, chunk}, previous, previous_scale, 1,
             chunk, out, num_threads);
  } else if ((world & (world - 1)) == 0) {
    compress(AverageValues<true, 0>{in, stride, scales.data(), world, previous, chunk}, previous, previous_scale, 1,
             chunk, out, num_threads);
  } else {
    compress(AverageValues<false, 0>{in, stride, scales.data(), world, previous, chunk}, previous, previous_scale, 1,
             chunk, out, num_threads);
  }
}

void onebit_decompress(int64_t frames, int64_t chunks, int64_t chunk, int64_t out, int64_t n, int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  check_chunk("onebit_decompress", chunks, chunk);
  if (n < 0 || n > chunks * chunk)
    throw std::invalid_argument("onebit_decompress: n must be in [0, chunks * chunk], got " + std::to_string(n));
  const uint8_t* in = as_ptr<const uint8_t>(frames);
  float* o = as_ptr<float>(out);
  const int64_t stride = frame_bytes(chunk);
  // Streaming stores skip reading each output line before it is written (a third of the traffic)
  // when the output is bigger than the caches anyway; they need 32-byte aligned groups (thread and
  // chunk boundaries fall on multiples of 8 elements, so an aligned start keeps every group aligned).
  const bool stream = n * static_cast<int64_t>(sizeof(float)) >= kStreamBytes && out % 32 == 0;
  parallel_over({n}, num_threads, [&](size_t, int64_t lo, int64_t hi) {
    for_chunk_pieces(lo, hi, chunk, [&](int64_t c, int64_t i, int64_t end) {
      const uint8_t* bits = in + c * stride - byte_of(c * chunk);
      const float value = scale_of(in + c * stride, chunk);
      const Scale scale(value);
      if (stream) {
        for (; i + 8 <= end; i += 8) Eight::signed_scale(bits[byte_of(i)], scale).stream(o + i);
        stream_fence();
      } else {
        for (; i + 8 <= end; i += 8) Eight::signed_scale(bits[byte_of(i)], scale).store(o + i);
      }
      for (; i < end; ++i) o[i] = (bits[byte_of(i)] >> (i % 8)) & 1 ? value : -value;  // the last, partial group
    });
  });
}

}  // namespace ds
