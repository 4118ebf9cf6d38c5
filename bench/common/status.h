// What the bench programs and probes do when they cannot measure at all: one exit status for it,
// and the check, before anything else touches CUDA, that device 0 can be used, which says so in
// words rather than as the first CUDA call's failure. CUDA's runtime only, so that the probes
// (bench/probes/, linked with cudart alone) share it.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace cudp::bench {

// The exit status of every bench program and probe that measured nothing because what was asked
// cannot be done: a mistake on the command line, a --json path that cannot be written, no usable
// CUDA device. (1 keeps each program's own meaning: a failed validation, a failed run.)
constexpr int kExitUsage = 2;

// Why device 0 cannot be used, in CUDA's words, or nullptr when it can: the runtime finds a device
// and creates its context (a driver older than the runtime, or none, fails here).
inline const char* cuda_device_problem() {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess && count == 0) status = cudaErrorNoDevice;
  if (status == cudaSuccess) status = cudaSetDevice(0);
  if (status == cudaSuccess) status = cudaFree(nullptr);
  if (status == cudaSuccess) return nullptr;
  cudaGetLastError();  // the error is reported here, not left to the next call
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
    return "no NVIDIA driver is installed";  // CUDA calls that "driver version is insufficient"
  }
  return cudaGetErrorString(status);
}

// True when device 0 can be used; otherwise prints to stderr, naming `program`, what is missing
// and what it needs, and returns false (main then returns kExitUsage).
inline bool usable_cuda_device(const char* program) {
  const char* problem = cuda_device_problem();
  if (problem == nullptr) return true;
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  std::fprintf(stderr,
               "%s: no usable CUDA device (CUDA says: %s); it needs an NVIDIA GPU of compute "
               "capability 9.0 or more and its driver%s%s%s\n",
               program, problem, visible ? " (CUDA_VISIBLE_DEVICES=\"" : "", visible ? visible : "",
               visible ? "\" may hide it)" : "");
  return false;
}

}  // namespace cudp::bench
