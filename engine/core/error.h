// cudp's error model.
//
// Every failure is a C++ exception derived from cudp::Error. A library never calls exit() or uses
// assert() for run-time conditions: the caller (a test, a trainer, a user's program) decides what
// to do. The message carries what was called and the library's own status text, so
// "cudaMallocAsync(...) failed: out of memory" is readable without a debugger; what() adds where it
// happened (" (at engine/core/memory.cpp:313)") after it.
//
// Check macros:
//   CUDP_CUDA_CHECK(call)        cudaError_t
//   CUDP_CHECK(cond, msg...)     a precondition on arguments; throws ValueError with the message
//   CUDP_CUBLAS_CHECK / CUDP_CUDNN_CHECK / CUDP_NCCL_CHECK live in vendor_check.h, so that this
//   header does not pull cuBLAS, cuDNN or NCCL into every translation unit.
#pragma once

#include <cuda_runtime_api.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace cudp {

// The base of every cudp exception. what() is the message with the location after it.
class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file, int line)
      : std::runtime_error(format(message, file, line)), message_(message), file_(file), line_(line) {}

  // The message without the location.
  const std::string& message() const noexcept { return message_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  static std::string format(const std::string& message, const char* file, int line);
  std::string message_;
  const char* file_;
  int line_;
};

// A CUDA runtime call failed; code() is the cudaError_t.
class CudaError : public Error {
 public:
  CudaError(cudaError_t code, const std::string& message, const char* file, int line)
      : Error(message, file, line), code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

// Device, pinned or host memory could not be allocated. The message names the device, the bytes
// asked for (where the allocation went through engine/core/memory.h), what the memory was for (the
// thread's cuda::AllocationPurpose) and what to change.
class OutOfMemoryError : public CudaError {
 public:
  using CudaError::CudaError;
};

// A vendor library (cuBLAS, cuDNN, NCCL) returned an error status.
class LibraryError : public Error {
 public:
  using Error::Error;
};

// A caller passed something invalid: a bad shape, a wrong device, an id out of range.
class ValueError : public Error {
 public:
  using Error::Error;
};

// A file could not be read or written, or its contents are not what they claim to be.
class IoError : public Error {
 public:
  using Error::Error;
};

namespace detail {

[[noreturn]] void throw_cuda(cudaError_t code, const char* call, const char* file, int line);

// Concatenates its arguments with operator<< into one string (for error messages).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

}  // namespace detail
}  // namespace cudp

#define CUDP_CUDA_CHECK(call)                                            \
  do {                                                                   \
    const cudaError_t cudp_status_ = (call);                             \
    if (cudp_status_ != cudaSuccess) {                                   \
      ::cudp::detail::throw_cuda(cudp_status_, #call, __FILE__, __LINE__); \
    }                                                                    \
  } while (0)

// Throws ValueError with the streamed arguments when cond is false.
#define CUDP_CHECK(cond, ...)                                                          \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      throw ::cudp::ValueError(::cudp::detail::str(__VA_ARGS__), __FILE__, __LINE__); \
    }                                                                                  \
  } while (0)

// Throws the given Error subclass with the streamed arguments.
#define CUDP_THROW(Type, ...) throw Type(::cudp::detail::str(__VA_ARGS__), __FILE__, __LINE__)
