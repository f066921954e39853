// Python bindings of the block-sparse attention kernels: pointers and strides in, GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "attention.h"
#include "simd.h"

namespace py = pybind11;

PYBIND11_MODULE(DS_OP_MODULE, m) {
  m.doc() = "ds-ops block-sparse attention on CPU (C++17, no torch headers; pointers in, GIL released)";
  m.def("simd_level", &ds::simd_level, "The instruction set this build vectorises with.");
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("forward", &ds::sparse_attention_forward, nogil, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("probs"), py::arg("shape"), py::arg("layout"), py::arg("masks"), py::arg("scale"),
        py::arg("causal"), py::arg("dtype"), py::arg("num_threads"));
  m.def("backward", &ds::sparse_attention_backward, nogil, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("grad_out"), py::arg("grad_q"), py::arg("grad_k"), py::arg("grad_v"), py::arg("probs"),
        py::arg("shape"), py::arg("layout"), py::arg("scale"), py::arg("dtype"), py::arg("num_threads"));
}
