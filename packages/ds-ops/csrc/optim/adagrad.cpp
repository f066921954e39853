// CPU-Adagrad, torch.optim.Adagrad's formulas: g += wd*p; sum += g*g; p -= clr * g / (sqrt(sum) + eps).
#include "dispatch.h"
#include "optim.h"
#include "parallel.h"

namespace ds {
namespace {

template <class B, class G, class S>
int64_t adagrad_span(float* p, const G* g, S* sum, int64_t i, int64_t end, float clr, float eps,
                     float weight_decay, uint32_t seed) {
  using V = typename B::V;
  const V vclr = B::set1(clr), veps = B::set1(eps), wd = B::set1(weight_decay);
  StateNoise<B, S> rounding(i, seed);
  for (; i + B::W <= end; i += B::W, rounding.advance()) {
    V param = B::load(p + i);
    V grad = B::load(g + i);
    if (weight_decay != 0.f) grad = B::fmadd(param, wd, grad);
    const V s = B::fmadd(grad, grad, B::load(sum + i));
    param = B::fnmadd(B::div(grad, B::add(B::sqrt(s), veps)), vclr, param);
    B::store(p + i, param);
    store_state<B>(sum, i, s, B::low16(rounding.noise()));
  }
  return i;
}

}  // namespace

void adagrad_update(const Pointers& params, const Pointers& grads, const Pointers& sums, const Sizes& sizes,
                    int grad_dtype, int state_dtype, float clr, float eps, float weight_decay, uint32_t seed,
                    int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  with_dtype(grad_dtype, "gradient", [&](auto gtag) {
    with_state_dtype(state_dtype, [&](auto stag) {
      using G = Elem<decltype(gtag)>;
      using S = Elem<decltype(stag)>;
      parallel_over(sizes, num_threads, [&](size_t t, int64_t begin, int64_t end) {
        float* p = as_ptr<float>(params[t]);
        const G* g = as_ptr<const G>(grads[t]);
        S* s = as_ptr<S>(sums[t]);
        const uint32_t seed_t = stream_seed(seed, t);
        int64_t i = adagrad_span<Simd>(p, g, s, begin, end, clr, eps, weight_decay, seed_t);
        adagrad_span<Scalar>(p, g, s, i, end, clr, eps, weight_decay, seed_t);
      });
    });
  });
}

}  // namespace ds
