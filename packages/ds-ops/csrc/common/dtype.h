// Runtime dtype codes to template arguments, and pointers passed from Python as integers.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "simd.h"

namespace ds {

template <class F>
void with_dtype(int code, const char* what, F&& f) {
  switch (code) {
    case kF32: f(static_cast<float*>(nullptr)); break;
    case kF16: f(static_cast<f16*>(nullptr)); break;
    case kBF16: f(static_cast<bf16*>(nullptr)); break;
    default: throw std::invalid_argument(std::string(what) + ": unknown dtype code " + std::to_string(code));
  }
}

template <class Tag>
using Elem = std::remove_pointer_t<Tag>;

template <class T>
T* as_ptr(int64_t address) { return reinterpret_cast<T*>(static_cast<uintptr_t>(address)); }

}  // namespace ds
