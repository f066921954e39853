// CPU-Adam / AdamW: one fused pass over memory per step, vectorised, threads over one
// concatenated index space (see parallel.h). Matches torch.optim.Adam/AdamW's formulas:
//   m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g; p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
// with g = gradient * grad_multiplier (1 / loss scale) when `scaled`: the unscaling costs one
// multiply in the same pass, which also notices a non-finite g (g*0 is nan exactly when g is inf
// or nan: one fused multiply-add per vector, no branch). Unscaled steps (the optimizer classes)
// run a variant without those two instructions. `all_finite` checks before anything is written.
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

template <class B, bool kScaled, class P, class G, class S, class O>
int64_t adam_span(P* p, const G* g, S* m, S* v, O* out, int64_t i, int64_t end, const AdamArgs& a,
                  uint32_t seed, bool* nonfinite) {
  using V = typename B::V;
  const auto f = [](double x) { return B::set1(static_cast<float>(x)); };
  const V multiplier = f(a.grad_multiplier), zero = B::set1(0.f);
  V poison = zero;
  const V beta1c = f(1.0 - a.beta1), beta2 = f(a.beta2), beta2c = f(1.0 - a.beta2);
  const V l2 = f(a.adamw ? 0.0 : a.weight_decay);
  const V decay = f(a.adamw ? 1.0 - a.lr * a.weight_decay : 1.0);
  const V inv_bc2_sqrt = f(1.0 / std::sqrt(a.bias_correction2));
  const V eps = f(a.eps), step_size = f(a.lr / a.bias_correction1);
  const bool l2_decay = !a.adamw && a.weight_decay != 0.0, decoupled = a.adamw && a.weight_decay != 0.0;
  StateNoise<B, S> rounding(i, seed);
  for (; i + B::W <= end; i += B::W, rounding.advance()) {
    prefetch(p + i + kPrefetchAhead, g + i + kPrefetchAhead, m + i + kPrefetchAhead, v + i + kPrefetchAhead);
    V param = B::load(p + i);
    V grad = B::load(g + i);
    if constexpr (kScaled) {
      grad = B::mul(grad, multiplier);
      poison = B::fmadd(grad, zero, poison);
    }
    if (l2_decay) grad = B::fmadd(param, l2, grad);
    if (decoupled) param = B::mul(param, decay);
    V mm = B::load(m + i), vv = B::load(v + i);
    mm = B::fmadd(B::sub(grad, mm), beta1c, mm);
    vv = B::fmadd(B::mul(grad, grad), beta2c, B::mul(vv, beta2));
    // With bf16 states (8-bit mantissas) the 12-14-bit hardware estimates are exact enough; with
    // fp32 states one Newton step brings them to ~2^-22.
    V denom, ratio;
    if constexpr (std::is_same_v<S, bf16>) {
      denom = B::fmadd(B::sqrt_coarse(vv), inv_bc2_sqrt, eps);
      ratio = B::mul(mm, B::rcp_coarse(denom));
    } else {
      denom = B::fmadd(B::sqrt_fast(vv), inv_bc2_sqrt, eps);
      ratio = B::mul(mm, B::rcp_fast(denom));
    }
    param = B::fnmadd(ratio, step_size, param);
    B::store(p + i, param);
    const auto noise = rounding.noise();
    store_state<B>(m, i, mm, B::low16(noise));
    store_state<B>(v, i, vv, B::high16(noise));
    if constexpr (!std::is_same_v<O, NoOut>) B::store(out + i, param);
  }
  if constexpr (kScaled) {
    if (is_nan_sum<B>(poison)) *nonfinite = true;
  }
  return i;
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
      if (args.scaled) {
        const int64_t i = adam_span<Simd, true>(p, g, m, v, out, begin, end, args, seed_t, &seen);
        adam_span<Scalar, true>(p, g, m, v, out, i, end, args, seed_t, &seen);
      } else {
        const int64_t i = adam_span<Simd, false>(p, g, m, v, out, begin, end, args, seed_t, &seen);
        adam_span<Scalar, false>(p, g, m, v, out, i, end, args, seed_t, &seen);
      }
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
