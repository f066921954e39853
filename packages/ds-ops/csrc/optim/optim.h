// The CPU optimizer kernels of ds-ops. Python owns the tensors and passes raw pointers (as
// integers), element counts and dtype codes (ds::DType); parameters are fp32 (Adam, Lion: also fp16/bf16).
#pragma once

#include <cstdint>
#include <vector>

namespace ds {

using Pointers = std::vector<int64_t>;
using Sizes = std::vector<int64_t>;

struct AdamArgs {  // double: 1 - beta2 of a float beta2 would be off by 1e-5 relative
  double lr, beta1, beta2, eps, weight_decay;
  double bias_correction1, bias_correction2;  // 1 - beta^step, or 1 without bias correction
  bool adamw;                                 // decoupled weight decay (AdamW) vs L2 (Adam)
  double grad_multiplier;                     // every gradient is multiplied by it (1 / loss scale) ...
  bool scaled;                                // ... when set, which also reports non-finite gradients
};

// One fused pass per element: read p, g, m, v; write p, m, v (and the 16-bit copy of p when
// `out_dtype` >= 0). `state_dtype` kBF16 stores m and v as bf16 with stochastic rounding.
// Parameters are fp32 (gradients of any dtype), or fp16/bf16 with gradients of the same dtype.
// With `scaled`: returns true when a gradient (times grad_multiplier) was inf or nan; the update
// has then been written anyway (callers that must not write check with `all_finite` first).
// Without: gradients are used as they are, and it returns false.
bool adam_update(const Pointers& params, const Pointers& grads, const Pointers& exp_avg,
                 const Pointers& exp_avg_sq, const Pointers& outs, const Sizes& sizes, int param_dtype,
                 int grad_dtype, int state_dtype, int out_dtype, const AdamArgs& args, uint32_t seed,
                 int num_threads);

// True when every g * multiplier is finite: a read-only pass over the gradients that stops at
// the first inf or nan.
bool all_finite(const Pointers& grads, const Sizes& sizes, int grad_dtype, float multiplier, int num_threads);

// torch.optim.Adagrad: sum += g*g; p -= clr * g / (sqrt(sum) + eps); L2 weight decay.
void adagrad_update(const Pointers& params, const Pointers& grads, const Pointers& sums, const Sizes& sizes,
                    int grad_dtype, int state_dtype, float clr, float eps, float weight_decay, uint32_t seed,
                    int num_threads);

// Lion: p = p*(1 - lr*wd) - lr*sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g. Parameters are fp32
// (gradients of any dtype) or fp16/bf16 (gradients of their dtype; float32 math, stored rounded to nearest).
void lion_update(const Pointers& params, const Pointers& grads, const Pointers& exp_avg, const Sizes& sizes,
                 int param_dtype, int grad_dtype, int state_dtype, double lr, double beta1, double beta2,
                 double weight_decay, uint32_t seed, int num_threads);

struct LambArgs {
  float lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2, max_coeff, min_coeff;
  float grad_scale;  // multiplies every gradient (global gradient-norm clipping), 1 for none
  bool eps_inside_sqrt;
};

// LAMB, per tensor: m, v as Adam; u = m^/(sqrt(v^)+eps) + wd*p; p -= lr * clamp(|p|/|u|) * u.
// Returns each tensor's trust ratio.
std::vector<float> lamb_update(const Pointers& params, const Pointers& grads, const Pointers& exp_avg,
                               const Pointers& exp_avg_sq, const Sizes& sizes, int grad_dtype, int state_dtype,
                               const LambArgs& args, uint32_t seed, int num_threads);

}  // namespace ds
