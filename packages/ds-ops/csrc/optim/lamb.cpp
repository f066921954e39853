// CPU LAMB (You et al. 2020), per tensor, two passes and no temporary: pass 1 updates m and v and
// accumulates |p|^2 and |u|^2; pass 2 recomputes u from the stored m, v and applies
// p -= lr * clamp(|p| / |u|, min_coeff, max_coeff) * u, with u = m^/(sqrt(v^) + eps) + wd*p.
#include <algorithm>
#include <cmath>

#include "dispatch.h"
#include "optim.h"
#include "parallel.h"

namespace ds {
namespace {

constexpr int64_t kChunk = 4096;  // float partial sums over at most this many elements, then double

template <class B>
struct LambConsts {
  using V = typename B::V;
  V b1c, b2, b2c, inv_bc1, inv_bc2, eps, wd, scale;
  explicit LambConsts(const LambArgs& a)
      : b1c(B::set1(1.f - a.beta1)), b2(B::set1(a.beta2)), b2c(B::set1(1.f - a.beta2)),
        inv_bc1(B::set1(1.f / a.bias_correction1)), inv_bc2(B::set1(1.f / a.bias_correction2)),
        eps(B::set1(a.eps)), wd(B::set1(a.weight_decay)), scale(B::set1(a.grad_scale)) {}
};

template <class B>
inline typename B::V lamb_direction(typename B::V param, typename B::V mm, typename B::V vv,
                                    const LambConsts<B>& c, bool eps_inside_sqrt) {
  const auto v_hat = B::mul(vv, c.inv_bc2);
  const auto denom = eps_inside_sqrt ? B::sqrt(B::add(v_hat, c.eps)) : B::add(B::sqrt(v_hat), c.eps);
  return B::fmadd(param, c.wd, B::div(B::mul(mm, c.inv_bc1), denom));
}

template <class B, class G, class S>
int64_t lamb_moments(const float* p, const G* g, S* m, S* v, int64_t i, int64_t end, const LambArgs& a,
                     uint32_t seed, double* sums) {
  using V = typename B::V;
  const LambConsts<B> c(a);
  StateNoise<B, S> rounding(i, seed);
  while (i + B::W <= end) {
    const int64_t stop = std::min(end, i + kChunk);
    V acc_p = B::set1(0.f), acc_u = B::set1(0.f);
    for (; i + B::W <= stop; i += B::W, rounding.advance()) {
      const V param = B::load(p + i);
      const V grad = B::mul(B::load(g + i), c.scale);
      V mm = B::load(m + i), vv = B::load(v + i);
      mm = B::fmadd(B::sub(grad, mm), c.b1c, mm);
      vv = B::fmadd(B::mul(grad, c.b2c), grad, B::mul(vv, c.b2));  // torch's order (adam.cpp)
      const auto noise = rounding.noise();
      store_state<B>(m, i, mm, B::low16(noise));
      store_state<B>(v, i, vv, B::high16(noise));
      const V u = lamb_direction<B>(param, B::load(m + i), B::load(v + i), c, a.eps_inside_sqrt);
      acc_p = B::fmadd(param, param, acc_p);
      acc_u = B::fmadd(u, u, acc_u);
    }
    sums[0] += B::sum(acc_p);
    sums[1] += B::sum(acc_u);
  }
  return i;
}

template <class B, class S>
int64_t lamb_apply(float* p, const S* m, const S* v, int64_t i, int64_t end, const LambArgs& a, float step) {
  const LambConsts<B> c(a);
  const auto vstep = B::set1(step);
  for (; i + B::W <= end; i += B::W) {
    const auto param = B::load(p + i);
    const auto u = lamb_direction<B>(param, B::load(m + i), B::load(v + i), c, a.eps_inside_sqrt);
    B::store(p + i, B::fnmadd(u, vstep, param));
  }
  return i;
}

}  // namespace

std::vector<float> lamb_update(const Pointers& params, const Pointers& grads, const Pointers& exp_avg,
                               const Pointers& exp_avg_sq, const Sizes& sizes, int grad_dtype, int state_dtype,
                               const LambArgs& args, uint32_t seed, int num_threads) {
  const IeeeDenormals ieee;  // the caller's thread too (parallel.h)
  std::vector<float> trust(sizes.size(), 1.f);
  with_dtype(grad_dtype, "gradient", [&](auto gtag) {
    with_state_dtype(state_dtype, [&](auto stag) {
      using G = Elem<decltype(gtag)>;
      using S = Elem<decltype(stag)>;
      for (size_t t = 0; t < sizes.size(); ++t) {
        float* p = as_ptr<float>(params[t]);
        const G* g = as_ptr<const G>(grads[t]);
        S* m = as_ptr<S>(exp_avg[t]);
        S* v = as_ptr<S>(exp_avg_sq[t]);
        const uint32_t seed_t = stream_seed(seed, t);
        const std::vector<double> norms = parallel_sum(sizes[t], num_threads, 2, [&](int64_t lo, int64_t hi, double* out) {
          int64_t i = lamb_moments<Simd>(p, g, m, v, lo, hi, args, seed_t, out);
          lamb_moments<Scalar>(p, g, m, v, i, hi, args, seed_t, out);
        });
        const double p_norm = std::sqrt(norms[0]), u_norm = std::sqrt(norms[1]);
        double ratio = (p_norm > 0.0 && u_norm > 0.0) ? p_norm / u_norm : 1.0;
        ratio = std::min<double>(args.max_coeff, std::max<double>(args.min_coeff, ratio));
        trust[t] = static_cast<float>(ratio);
        const float step = static_cast<float>(args.lr * ratio);
        parallel_sum(sizes[t], num_threads, 0, [&](int64_t lo, int64_t hi, double*) {
          int64_t i = lamb_apply<Simd>(p, m, v, lo, hi, args, step);
          lamb_apply<Scalar>(p, m, v, i, hi, args, step);
        });
      }
    });
  });
  return trust;
}

}  // namespace ds
