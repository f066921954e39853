// CPU-Adam / AdamW: one fused pass over memory per step, vectorised, threads over one
// concatenated index space (see parallel.h). Matches torch.optim.Adam/AdamW's formulas:
//   m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g; p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
#include <cmath>

#include "dispatch.h"
#include "optim.h"
#include "parallel.h"

namespace ds {
namespace {

template <class B, class G, class S, class O>
int64_t adam_span(float* p, const G* g, S* m, S* v, O* out, int64_t i, int64_t end, const AdamArgs& a,
                  uint32_t seed) {
  using V = typename B::V;
  const V beta1c = B::set1(1.f - a.beta1), beta2 = B::set1(a.beta2), beta2c = B::set1(1.f - a.beta2);
  const V l2 = B::set1(a.adamw ? 0.f : a.weight_decay);
  const V decay = B::set1(a.adamw ? 1.f - a.lr * a.weight_decay : 1.f);
  const V inv_bc2_sqrt = B::set1(1.f / std::sqrt(a.bias_correction2));
  const V eps = B::set1(a.eps), step_size = B::set1(a.lr / a.bias_correction1);
  const bool l2_decay = !a.adamw && a.weight_decay != 0.f, decoupled = a.adamw && a.weight_decay != 0.f;
  StateNoise<B, S> rounding(i, seed);
  for (; i + B::W <= end; i += B::W, rounding.advance()) {
    prefetch(p + i + kPrefetchAhead, g + i + kPrefetchAhead, m + i + kPrefetchAhead, v + i + kPrefetchAhead);
    V param = B::load(p + i);
    V grad = B::load(g + i);
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
  return i;
}

}  // namespace

void adam_update(const Pointers& params, const Pointers& grads, const Pointers& exp_avg,
                 const Pointers& exp_avg_sq, const Pointers& outs, const Sizes& sizes, int grad_dtype,
                 int state_dtype, int out_dtype, const AdamArgs& args, uint32_t seed, int num_threads) {
  with_dtype(grad_dtype, "gradient", [&](auto gtag) {
    with_state_dtype(state_dtype, [&](auto stag) {
      with_out_dtype(out_dtype, [&](auto otag) {
        using G = Elem<decltype(gtag)>;
        using S = Elem<decltype(stag)>;
        using O = Elem<decltype(otag)>;
        parallel_over(sizes, num_threads, [&](size_t t, int64_t begin, int64_t end) {
          float* p = as_ptr<float>(params[t]);
          const G* g = as_ptr<const G>(grads[t]);
          S* m = as_ptr<S>(exp_avg[t]);
          S* v = as_ptr<S>(exp_avg_sq[t]);
          O* out = std::is_same_v<O, NoOut> ? nullptr : as_ptr<O>(outs[t]);
          const uint32_t seed_t = stream_seed(seed, t);
          int64_t i = adam_span<Simd>(p, g, m, v, out, begin, end, args, seed_t);
          adam_span<Scalar>(p, g, m, v, out, i, end, args, seed_t);
        });
      });
    });
  });
}

}  // namespace ds
