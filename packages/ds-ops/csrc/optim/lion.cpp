// CPU-Lion (Chen et al. 2023): p = p*(1 - lr*wd) - lr*sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g.
// Parameters are fp32 (gradients of any dtype), or fp16/bf16 with gradients of their dtype: those
// are loaded as float32, updated in float32 and stored rounded to nearest even (as DeepSpeed's).
#include "dispatch.h"
#include "optim.h"
#include "parallel.h"

namespace ds {
namespace {

template <class B, class P, class G, class S>
int64_t lion_span(P* p, const G* g, S* m, int64_t i, int64_t end, double lr, double beta1, double beta2,
                  double weight_decay, uint32_t seed) {
  using V = typename B::V;
  // the constants in double, rounded once (as torch's Python floats): 1 - 0.99f is 1e-6 off 0.01
  auto f = [](double x) { return B::set1(static_cast<float>(x)); };
  const V b1 = f(beta1), b1c = f(1.0 - beta1), b2 = f(beta2), b2c = f(1.0 - beta2);
  const V vlr = f(lr), decay = f(1.0 - lr * weight_decay);
  StateNoise<B, S> rounding(i, seed);
  for (; i + B::W <= end; i += B::W, rounding.advance()) {
    V param = B::load(p + i);
    const V grad = B::load(g + i), mm = B::load(m + i);
    if (weight_decay != 0.0) param = B::mul(param, decay);
    const V direction = B::sign(B::fmadd(grad, b1c, B::mul(mm, b1)));
    B::store(p + i, B::fnmadd(direction, vlr, param));
    store_state<B>(m, i, B::fmadd(grad, b2c, B::mul(mm, b2)), B::low16(rounding.noise()));
  }
  return i;
}

}  // namespace

void lion_update(const Pointers& params, const Pointers& grads, const Pointers& exp_avg, const Sizes& sizes,
                 int param_dtype, int grad_dtype, int state_dtype, double lr, double beta1, double beta2,
                 double weight_decay, uint32_t seed, int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  // P, G, S: the element types of parameters, gradients and the momentum
  auto run = [&](auto ptag, auto gtag, auto stag) {
    using P = Elem<decltype(ptag)>;
    using G = Elem<decltype(gtag)>;
    using S = Elem<decltype(stag)>;
    parallel_over(sizes, num_threads, [&](size_t t, int64_t begin, int64_t end) {
      P* p = as_ptr<P>(params[t]);
      const G* g = as_ptr<const G>(grads[t]);
      S* m = as_ptr<S>(exp_avg[t]);
      const uint32_t seed_t = stream_seed(seed, t);
      int64_t i = lion_span<Simd>(p, g, m, begin, end, lr, beta1, beta2, weight_decay, seed_t);
      lion_span<Scalar>(p, g, m, i, end, lr, beta1, beta2, weight_decay, seed_t);
    });
  };
  if (param_dtype == kF32) {
    with_dtype(grad_dtype, "gradient", [&](auto gtag) {
      with_state_dtype(state_dtype, [&](auto stag) { run(static_cast<float*>(nullptr), gtag, stag); });
    });
    return;
  }
  if (grad_dtype != param_dtype) throw std::invalid_argument("16-bit parameters need gradients of their own dtype");
  with_dtype(param_dtype, "parameter", [&](auto ptag) {
    if constexpr (!std::is_same_v<Elem<decltype(ptag)>, float>) {
      with_state_dtype(state_dtype, [&](auto stag) { run(ptag, ptag, stag); });
    }
  });
}

}  // namespace ds
