// Python bindings of the CPU optimizer ops. The same file is built as each op's module (the
// builder defines DS_OP_MODULE and DS_OP_<NAME>), so every op exports exactly its own kernel.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "optim.h"
#include "simd.h"

namespace py = pybind11;
using ds::Pointers;
using ds::Sizes;

PYBIND11_MODULE(DS_OP_MODULE, m) {
  m.doc() = "ds-ops CPU optimizer kernel (C++17, no torch headers; pointers in, GIL released)";
  m.def("simd_level", &ds::simd_level, "The instruction set this build vectorises with.");
  const auto nogil = py::call_guard<py::gil_scoped_release>();
#if defined(DS_OP_CPU_ADAM)
  m.def("adam_update",
        [](const Pointers& params, const Pointers& grads, const Pointers& exp_avg, const Pointers& exp_avg_sq,
           const Pointers& outs, const Sizes& sizes, int param_dtype, int grad_dtype, int state_dtype,
           int out_dtype, double lr, double beta1, double beta2, double eps, double weight_decay,
           double bias_correction1, double bias_correction2, bool adamw, double grad_multiplier, bool scaled,
           uint32_t seed, int num_threads) {
          return ds::adam_update(params, grads, exp_avg, exp_avg_sq, outs, sizes, param_dtype, grad_dtype,
                                 state_dtype, out_dtype,
                                 {lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2, adamw,
                                  grad_multiplier, scaled},
                                 seed, num_threads);
        },
        nogil);
  m.def("all_finite", &ds::all_finite, nogil);
#endif
#if defined(DS_OP_CPU_ADAGRAD)
  m.def("adagrad_update", &ds::adagrad_update, nogil);
#endif
#if defined(DS_OP_CPU_LION)
  m.def("lion_update", &ds::lion_update, nogil);
#endif
#if defined(DS_OP_CPU_LAMB)
  m.def("lamb_update",
        [](const Pointers& params, const Pointers& grads, const Pointers& exp_avg, const Pointers& exp_avg_sq,
           const Sizes& sizes, int grad_dtype, int state_dtype, float lr, float beta1, float beta2, float eps,
           float weight_decay, float bias_correction1, float bias_correction2, float max_coeff, float min_coeff,
           float grad_scale, bool eps_inside_sqrt, uint32_t seed, int num_threads) {
          return ds::lamb_update(params, grads, exp_avg, exp_avg_sq, sizes, grad_dtype, state_dtype,
                                 {lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2,
                                  max_coeff, min_coeff, grad_scale, eps_inside_sqrt},
                                 seed, num_threads);
        },
        nogil);
#endif
}
