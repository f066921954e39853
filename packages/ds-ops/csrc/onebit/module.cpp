// Python bindings of the 1-bit compression kernels: pointers and sizes in, GIL released.
#include <pybind11/pybind11.h>

#include "onebit.h"
#include "simd.h"

namespace py = pybind11;

PYBIND11_MODULE(DS_OP_MODULE, m) {
  m.doc() = "ds-ops 1-bit compression with error feedback on CPU float32 buffers (C++17, no torch headers; "
            "pointers in, GIL released)";
  m.def("simd_level", &ds::simd_level, "The instruction set this build vectorises with.");
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("compress", &ds::onebit_compress, nogil, py::arg("x"), py::arg("n"), py::arg("values"), py::arg("scales"),
        py::arg("chunks"), py::arg("chunk"), py::arg("frames"), py::arg("num_threads"));
  m.def("average", &ds::onebit_average, nogil, py::arg("frames"), py::arg("world"), py::arg("chunk"),
        py::arg("values"), py::arg("scale"), py::arg("out_frame"), py::arg("num_threads"));
  m.def("decompress", &ds::onebit_decompress, nogil, py::arg("frames"), py::arg("chunks"), py::arg("chunk"),
        py::arg("out"), py::arg("n"), py::arg("num_threads"));
}
