// Work splitting for the optimizer kernels: the tensors of one call are seen as one concatenated
// index space, cut into one contiguous range per thread (so every thread streams through memory
// in order and the split is even however the sizes are distributed).
#pragma once

#include <omp.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ds {

// The denormal policy of every kernel (README, "Denormals"): IEEE subnormals, in and out, whatever
// the flush modes of the thread that runs it. MXCSR is per thread: torch.set_flush_denormal(True)
// sets flush-to-zero and denormals-are-zero in the thread that calls it, and an OpenMP worker keeps
// whatever it inherited when it was made, so the same kernel could flush on one call path and not
// on another. Each thread of a kernel clears both bits for its work and restores them after.
struct IeeeDenormals {
#if defined(__SSE__)
  static constexpr unsigned kFlushBits = 0x8040U;  // FTZ (bit 15) and DAZ (bit 6)
  unsigned saved;
  IeeeDenormals() : saved(_mm_getcsr()) {
    if (saved & kFlushBits) _mm_setcsr(saved & ~kFlushBits);
  }
  ~IeeeDenormals() {
    if (saved & kFlushBits) _mm_setcsr(saved);
  }
  IeeeDenormals(const IeeeDenormals&) = delete;
  IeeeDenormals& operator=(const IeeeDenormals&) = delete;
#endif
};

// Below this many elements a step runs on one thread: waking threads costs more than it saves.
constexpr int64_t kSerialBelow = 1 << 15;
// Thread boundaries fall on multiples of this many elements (whole cache lines and pages).
constexpr int64_t kAlign = 1024;

template <class F>
void parallel_over(const std::vector<int64_t>& sizes, int num_threads, F&& fn) {
  std::vector<int64_t> offsets(sizes.size() + 1, 0);
  for (size_t t = 0; t < sizes.size(); ++t) offsets[t + 1] = offsets[t] + sizes[t];
  const int64_t total = offsets.back();
  auto run_range = [&](int64_t lo, int64_t hi) {
    for (size_t t = 0; t < sizes.size(); ++t) {
      const int64_t begin = std::max(lo, offsets[t]), end = std::min(hi, offsets[t + 1]);
      if (begin < end) fn(t, begin - offsets[t], end - offsets[t]);
    }
  };
  if (num_threads <= 1 || total < kSerialBelow) {
    const IeeeDenormals ieee;
    run_range(0, total);
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    const IeeeDenormals ieee;
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    auto cut = [&](int64_t k) { return k >= nt ? total : std::min(total, (total * k / nt) / kAlign * kAlign); };
    run_range(cut(tid), cut(tid + 1));
  }
}

// Per-thread partial sums for reductions (LAMB's norms), combined in a fixed order.
template <class F>
std::vector<double> parallel_sum(int64_t n, int num_threads, int num_sums, F&& fn) {
  const int nt = (num_threads <= 1 || n < kSerialBelow) ? 1 : num_threads;
  std::vector<double> partial(static_cast<size_t>(nt) * num_sums, 0.0);
#pragma omp parallel num_threads(nt)
  {
    const IeeeDenormals ieee;
    const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
    const int64_t lo = (n * t / count) / kAlign * kAlign;
    const int64_t hi = t + 1 == count ? n : (n * (t + 1) / count) / kAlign * kAlign;
    if (lo < hi) fn(lo, hi, partial.data() + static_cast<size_t>(t) * num_sums);
  }
  std::vector<double> out(num_sums, 0.0);
  for (int t = 0; t < nt; ++t)
    for (int k = 0; k < num_sums; ++k) out[k] += partial[static_cast<size_t>(t) * num_sums + k];
  return out;
}

}  // namespace ds
