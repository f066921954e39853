// Python bindings of the async_io op: the handle works on (data_ptr, nbytes); every call that
// waits or does I/O releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "aio_handle.h"
#include "errors.h"

namespace py = pybind11;
using ds_io::AioHandle;

PYBIND11_MODULE(DS_OP_MODULE, m) {
  m.doc() = "ds-io async_io core (C++17, no torch headers; pointers in, GIL released)";
  py::register_exception<ds_io::IoError>(m, "IoError", PyExc_OSError);
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("have_libaio", &ds_io::have_libaio, "Whether this build uses Linux AIO (libaio).");
  m.attr("ALIGNMENT") = ds_io::kAlign;
  m.def("alloc_locked",
        [](int64_t nbytes) {
          std::string note;
          const uintptr_t ptr = ds_io::alloc_locked(nbytes, &note);
          return py::make_tuple(ptr, note);
        },
        "Page-aligned, zeroed, mlock()ed memory: (address, note about mlock failure or '').");
  m.def("free_locked", &ds_io::free_locked, nogil);
  py::class_<AioHandle>(m, "AioHandle")
      .def(py::init<int64_t, int, bool, bool, int, bool>(), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("single_submit"), py::arg("overlap_events"), py::arg("intra_op_parallelism"),
           py::arg("use_libaio"))
      .def("submit", &AioHandle::submit, nogil)
      .def("run", &AioHandle::run, nogil)
      .def("wait", &AioHandle::wait, nogil)
      .def("pending", &AioHandle::pending)
      .def("take_notes", &AioHandle::take_notes)
      .def("close", &AioHandle::close, nogil)
      .def("uses_libaio", &AioHandle::uses_libaio);
}
