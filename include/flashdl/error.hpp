// The one exception type flashdl throws, and the Python exception each kind becomes.
#pragma once

#include <stdexcept>
#include <string>

namespace flashdl {

enum class ErrorKind : int {
  value = 0,            // a bad shape, stride, option value: Python ValueError
  type = 1,             // a bad dtype or array type: Python TypeError
  unsupported = 2,      // valid request this build or device cannot serve: Python RuntimeError
  runtime = 3,          // a failure while running (CUDA error, allocation): Python RuntimeError
  not_implemented = 4,  // a feature not yet on this path (backend, entry): NotImplementedError
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace flashdl
