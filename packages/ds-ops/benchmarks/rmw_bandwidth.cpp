// The hardware limit CPU-Adam is measured against: an in-place read-modify-write stream,
// b[i] += s * c[i], with OpenMP. Like Adam it writes back only what it read (no write-allocate
// traffic), so its bytes/second is the bandwidth a streaming optimizer step can reach.
#include <omp.h>
#include <pybind11/pybind11.h>

#include <cstdint>

namespace {
void rmw(int64_t b_address, int64_t c_address, int64_t n, float s, int threads) {
  float* __restrict b = reinterpret_cast<float*>(b_address);
  const float* __restrict c = reinterpret_cast<const float*>(c_address);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) b[i] += s * c[i];
}
}  // namespace

PYBIND11_MODULE(DS_OP_MODULE, m) {
  m.def("rmw", &rmw, pybind11::call_guard<pybind11::gil_scoped_release>());
}
