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
  py::dict limits;
  limits["block_size"] = py::make_tuple(ds_io::kMinBlockSize, ds_io::kMaxBlockSize);
  limits["queue_depth"] = py::make_tuple(ds_io::kMinQueueDepth, ds_io::kMaxQueueDepth);
  limits["intra_op_parallelism"] = py::make_tuple(ds_io::kMinIntraOpParallelism, ds_io::kMaxIntraOpParallelism);
  m.attr("LIMITS") = limits;
  py::class_<ds_io::Operation, std::shared_ptr<ds_io::Operation>>(m, "Operation")
      .def("done", &ds_io::Operation::is_done, "Whether the operation has completed (successfully or not).")
      .def("wait", &ds_io::Operation::wait_done, nogil, "Blocks until it completes; raises its errors.");
  py::class_<AioHandle>(m, "AioHandle")
      .def(py::init<int64_t, int64_t, bool, bool, int64_t, bool>(), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("single_submit"), py::arg("overlap_events"), py::arg("intra_op_parallelism"),
           py::arg("use_libaio"))
      .def("submit", &AioHandle::submit, py::arg("write"), py::arg("ptr"), py::arg("nbytes"), py::arg("path"),
           py::arg("file_offset"), py::arg("direct"), py::arg("track"), py::arg("rename_to") = std::string(),
           py::arg("defer_open") = false, py::arg("keep_size") = false, nogil)
      .def("run", &AioHandle::run, nogil)
      .def("wait", &AioHandle::wait, nogil)
      .def("pending", &AioHandle::pending)
      .def("take_notes", &AioHandle::take_notes)
      .def("close", &AioHandle::close, nogil)
      .def("uses_libaio", &AioHandle::uses_libaio);
}
