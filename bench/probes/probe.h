// What every hardware probe (bench/probes/*.cu) starts with: a CUDA check that names the probe and
// exits, and the gate that finds an sm_90 GPU or says why there is nothing to probe.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

// `probe` is the probe's name, a string literal in scope where the macro is used (kProbe).
#define PROBE_CHECK(call)                                                            \
  do {                                                                               \
    const cudaError_t err_ = (call);                                                 \
    if (err_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s: %s\n", kProbe, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

// Device 0's properties, or false with a line saying why there is nothing to probe: no CUDA
// device, or one that is not sm_90 (`feature`: what the probe needs of it).
inline bool probe_sm90_device(const char* probe, const char* feature, cudaDeviceProp* prop) {
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::printf("%s: no CUDA device; nothing to probe\n", probe);
    return false;
  }
  const cudaError_t err = cudaGetDeviceProperties(prop, 0);
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: cudaGetDeviceProperties: %s\n", probe, cudaGetErrorString(err));
    std::exit(2);
  }
  if (prop->major != 9) {
    std::printf("%s: %s is not sm_90 (%s); nothing to probe\n", probe, prop->name, feature);
    return false;
  }
  return true;
}
