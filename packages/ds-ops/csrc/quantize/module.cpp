// Python bindings of the block quantization kernels: pointers and sizes in, GIL released.
#include <pybind11/pybind11.h>

#include "quantize.h"
#include "simd.h"

namespace py = pybind11;

PYBIND11_MODULE(DS_OP_MODULE, m) {
  m.doc() = "ds-ops block quantization (symmetric int8/int4, a float32 scale per group) on CPU buffers (C++17, "
            "no torch headers; pointers in, GIL released)";
  m.def("simd_level", &ds::simd_level, "The instruction set this build vectorises with.");
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("quantize", &ds::block_quantize, nogil, py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("group_size"),
        py::arg("bits"), py::arg("q"), py::arg("scales"), py::arg("num_threads"));
  m.def("dequantize", &ds::block_dequantize, nogil, py::arg("q"), py::arg("scales"), py::arg("n"),
        py::arg("group_size"), py::arg("bits"), py::arg("out"), py::arg("out_dtype"), py::arg("num_threads"));
  m.def("dequantize_sum", &ds::block_dequantize_sum, nogil, py::arg("q"), py::arg("scales"), py::arg("k"),
        py::arg("n"), py::arg("group_size"), py::arg("bits"), py::arg("out_q"), py::arg("out_scales"),
        py::arg("out_bits"), py::arg("out"), py::arg("out_dtype"), py::arg("num_threads"));
}
