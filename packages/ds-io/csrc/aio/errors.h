// IoError becomes Python's OSError (a subclass registered in module.cpp); invalid_argument
// becomes ValueError. Messages name the path, the file offset and the sizes.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace ds_io {

class IoError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline std::string join(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t k = 0; k < parts.size(); ++k) out += (k ? "; " : "") + parts[k];
  return out;
}

}  // namespace ds_io
