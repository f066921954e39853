// CPU-Adam / AdamW: one fused pass over memory per step, vectorised, threads over one
// concatenated index space (see parallel.h). Matches torch.optim.Adam/AdamW's formulas:
//   m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g; p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
// with g = gradient * grad_multiplier (1 / loss scale) when `scaled`: the unscaling costs one
// multiply in the same pass, which also notices a non-finite g (g*0 is nan exactly when g is inf
// or nan: one fused multiply-add per vector, no branch). Unscaled steps (the optimizer classes)
// run a variant without those two instructions. `all_finite` checks before anything is written.
// Every element goes through the vector code, a span's last partial vector too (TailLanes): its
// result is the same bits wherever its tensor, chunk or thread's range ends.
#include <algorithm>
#include <atomic>
#include <cmath>

#include "dispatch.h"
#include "optim.h"
#include "parallel.h"

namespace ds {
namespace {

// nan exactly when some g*0 added to it was nan, i.e. some g was inf or nan
template <class B>
inline bool is_nan_sum(typename B::V acc) {
  const float total = B::sum(acc);
  return total != total;
}

// The per-step constants of the update, as vectors.
template <class B>
struct AdamVectors {
  using V = typename B::V;
  V multiplier, zero, beta1c, beta2, beta2c, l2, decay, inv_bc2_sqrt, eps, step_size;
  bool l2_decay, decoupled;
  // 1/denom's estimates serve denominators of at least 2^-125 (denom >= eps), and denominators stay
  // far below their upper limit (sqrt(FLT_MAX) / sqrt(1 - beta2)); a smaller eps takes exact division
  bool estimates;
  explicit AdamVectors(const AdamArgs& a)
      : multiplier(f(a.grad_multiplier)), zero(B::set1(0.f)), beta1c(f(1.0 - a.beta1)), beta2(f(a.beta2)),
        beta2c(f(1.0 - a.beta2)), l2(f(a.adamw ? 0.0 : a.weight_decay)),
        decay(f(a.adamw ? 1.0 - a.lr * a.weight_decay : 1.0)), inv_bc2_sqrt(f(1.0 / std::sqrt(a.bias_correction2))),
        eps(f(a.eps)), step_size(f(a.lr / a.bias_correction1)),
        l2_decay(!a.adamw && a.weight_decay != 0.0), decoupled(a.adamw && a.weight_decay != 0.0),
        estimates(static_cast<float>(a.eps) >= 0x1p-125f && a.bias_correction2 >= 1e-30) {}
  static V f(double x) { return B::set1(static_cast<float>(x)); }
};

// m / (sqrt(v)/sqrt(bc2) + eps). With bf16 states (kCoarse: 8-bit mantissas) the 12-14-bit hardware
// estimates are exact enough; with fp32 states one Newton step brings them to ~2^-22. A vector with a
// second moment the estimates do not serve (inf, nan, negative; AVX2's coarse ones: subnormal), or any
// vector when eps is too small for 1/denom's estimate, takes the exact instructions: the denormal
// policy (README), at the cost of one compare per vector on ordinary data.
template <class B, bool kCoarse>
inline typename B::V adam_ratio(typename B::V mm, typename B::V vv, const AdamVectors<B>& c) {
  const bool served = kCoarse ? B::coarse_estimates_serve(vv) : B::estimates_serve(vv);
  if (!(c.estimates && served)) return B::div(mm, B::fmadd(B::sqrt(vv), c.inv_bc2_sqrt, c.eps));
  if constexpr (kCoarse) return B::mul(mm, B::rcp_coarse(B::fmadd(B::sqrt_coarse(vv), c.inv_bc2_sqrt, c.eps)));
  else return B::mul(mm, B::rcp_fast(B::fmadd(B::sqrt_fast(vv), c.inv_bc2_sqrt, c.eps)));
}

// One vector of elements: p, g, m, v (and out) point at its first element.
template <class B, bool kScaled, class P, class G, class S, class O>
inline void adam_vector(P* p, const G* g, S* m, S* v, O* out, const AdamVectors<B>& c, typename B::IV noise,
                        typename B::V& poison) {
  using V = typename B::V;
  V param = B::load(p);
  V grad = B::load(g);
  if constexpr (kScaled) {
    grad = B::mul(grad, c.multiplier);
    poison = B::fmadd(grad, c.zero, poison);
  }
  if (c.l2_decay) grad = B::fmadd(param, c.l2, grad);
  if (c.decoupled) param = B::mul(param, c.decay);
  V mm = B::load(m), vv = B::load(v);
  mm = B::fmadd(B::sub(grad, mm), c.beta1c, mm);
  // ((1-b2)*g)*g, torch's order: g*g first would overflow to inf for |g| > 1.8e19, where torch's does not
  vv = B::fmadd(B::mul(grad, c.beta2c), grad, B::mul(vv, c.beta2));
  const V ratio = adam_ratio<B, std::is_same_v<S, bf16>>(mm, vv, c);
  param = B::fnmadd(ratio, c.step_size, param);
  B::store(p, param);
  store_state<B>(m, 0, mm, B::low16(noise));
  store_state<B>(v, 0, vv, B::high16(noise));
  if constexpr (!std::is_same_v<O, NoOut>) B::store(out, param);
}

// Elements [i, end) of one tensor, all through the vector code: the last, partial vector too (see
// TailLanes), so an element's bits do not depend on where its span ends.
template <bool kScaled, class P, class G, class S, class O>
void adam_span(P* p, const G* g, S* m, S* v, O* out, int64_t i, int64_t end, const AdamArgs& a, uint32_t seed,
               bool* nonfinite) {
  using B = Simd;
  const AdamVectors<B> c(a);
  typename B::V poison = c.zero;
  StateNoise<B, S> rounding(i, seed);
  for (; i + B::W <= end; i += B::W, rounding.advance()) {
    prefetch(p + i + kPrefetchAhead, g + i + kPrefetchAhead, m + i + kPrefetchAhead, v + i + kPrefetchAhead);
    adam_vector<B, kScaled>(p + i, g + i, m + i, v + i, out == nullptr ? out : out + i, c, rounding.noise(), poison);
  }
  if (i < end) {
    const int64_t n = end - i;
    TailLanes<B::W, P> tp(p + i, n);
    TailLanes<B::W, const G> tg(g + i, n);
    TailLanes<B::W, S> tm(m + i, n), tv(v + i, n);
    TailLanes<B::W, O> to(out == nullptr ? out : out + i, n);
    adam_vector<B, kScaled>(tp.lanes, tg.lanes, tm.lanes, tv.lanes, to.lanes, c, rounding.noise(), poison);
    tp.write_back();
    tm.write_back();
    tv.write_back();
    to.write_back();
  }
  if constexpr (kScaled) {
    if (is_nan_sum<B>(poison)) *nonfinite = true;
  }
}

// Chunks of the finite check: the stop flag is read once per chunk. Software prefetch keeps more
// reads in flight than the hardware prefetchers do (as in the update, see dispatch.h).
constexpr int64_t kCheckChunk = 1 << 14, kLine = 64;
#ifndef DS_CHECK_AHEAD
#define DS_CHECK_AHEAD 4096
#endif
constexpr int64_t kCheckAhead = DS_CHECK_AHEAD;

template <class B, class G>
int64_t finite_span(const G* g, int64_t i, int64_t end, float multiplier, std::atomic<bool>& bad) {
  using V = typename B::V;
  const V mult = B::set1(multiplier), zero = B::set1(0.f);
  while (i + B::W <= end) {
    if (bad.load(std::memory_order_relaxed)) return end;
    const int64_t stop = std::min(end, i + kCheckChunk);
    // four independent sums: one chain would wait on the fma latency, not on memory
    V p0 = zero, p1 = zero, p2 = zero, p3 = zero;
    for (; i + 4 * B::W <= stop; i += 4 * B::W) {
      for (int64_t line = 0; line < 4 * B::W; line += kLine / static_cast<int64_t>(sizeof(G)))
        prefetch(g + i + kCheckAhead + line);
      p0 = B::fmadd(B::mul(B::load(g + i), mult), zero, p0);
      p1 = B::fmadd(B::mul(B::load(g + i + B::W), mult), zero, p1);
      p2 = B::fmadd(B::mul(B::load(g + i + 2 * B::W), mult), zero, p2);
      p3 = B::fmadd(B::mul(B::load(g + i + 3 * B::W), mult), zero, p3);
    }
    for (; i + B::W <= stop; i += B::W) p0 = B::fmadd(B::mul(B::load(g + i), mult), zero, p0);
    if (is_nan_sum<B>(B::add(B::add(p0, p1), B::add(p2, p3)))) {
      bad.store(true, std::memory_order_relaxed);
      return end;
    }
  }
  return i;
}

}  // namespace

bool all_finite(const Pointers& grads, const Sizes& sizes, int grad_dtype, float multiplier, int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  std::atomic<bool> bad{false};
  with_dtype(grad_dtype, "gradient", [&](auto gtag) {
    using G = Elem<decltype(gtag)>;
    parallel_over(sizes, num_threads, [&](size_t t, int64_t begin, int64_t end) {
      const G* g = as_ptr<const G>(grads[t]);
      const int64_t i = finite_span<Simd>(g, begin, end, multiplier, bad);
      finite_span<Scalar>(g, i, end, multiplier, bad);
    });
  });
  return !bad.load();
}

bool adam_update(const Pointers& params, const Pointers& grads, const Pointers& exp_avg,
                 const Pointers& exp_avg_sq, const Pointers& outs, const Sizes& sizes, int param_dtype,
                 int grad_dtype, int state_dtype, int out_dtype, const AdamArgs& args, uint32_t seed,
                 int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  std::atomic<bool> nonfinite{false};
  // P, G, S, O: the element types of parameters, gradients, states and the 16-bit copy
  auto run = [&](auto ptag, auto gtag, auto stag, auto otag) {
    using P = Elem<decltype(ptag)>;
    using G = Elem<decltype(gtag)>;
    using S = Elem<decltype(stag)>;
    using O = Elem<decltype(otag)>;
    parallel_over(sizes, num_threads, [&](size_t t, int64_t begin, int64_t end) {
      bool seen = false;
      P* p = as_ptr<P>(params[t]);
      const G* g = as_ptr<const G>(grads[t]);
      S* m = as_ptr<S>(exp_avg[t]);
      S* v = as_ptr<S>(exp_avg_sq[t]);
      O* out = std::is_same_v<O, NoOut> ? nullptr : as_ptr<O>(outs[t]);
      const uint32_t seed_t = stream_seed(seed, t);
      if (args.scaled) adam_span<true>(p, g, m, v, out, begin, end, args, seed_t, &seen);
      else adam_span<false>(p, g, m, v, out, begin, end, args, seed_t, &seen);
      if (seen) nonfinite.store(true, std::memory_order_relaxed);
    });
  };
  if (param_dtype == kF32) {
    with_dtype(grad_dtype, "gradient", [&](auto gtag) {
      with_state_dtype(state_dtype, [&](auto stag) {
        with_out_dtype(out_dtype, [&](auto otag) { run(static_cast<float*>(nullptr), gtag, stag, otag); });
      });
    });
  } else {
    // 16-bit parameters (DeepSpeed's CPU-Adam takes them): updated in float32, stored rounded to
    // nearest; their gradients have their dtype, and they need no 16-bit copy.
    if (grad_dtype != param_dtype || out_dtype >= 0)
      throw std::invalid_argument("16-bit parameters need gradients of their own dtype and no 16-bit copy");
    with_dtype(param_dtype, "parameter", [&](auto ptag) {
      if constexpr (!std::is_same_v<Elem<decltype(ptag)>, float>) {
        with_state_dtype(state_dtype, [&](auto stag) { run(ptag, ptag, stag, static_cast<NoOut*>(nullptr)); });
      }
    });
  }
  return nonfinite.load();
}

}  // namespace ds
