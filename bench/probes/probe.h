// What every hardware probe (bench/probes/*.cu) starts with: its command line (no options but
// --help), a CUDA check that names the probe and exits, and the gate that finds an sm_90 GPU or
// says why there is nothing to probe.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "bench/common/status.h"

// `probe` is the probe's name, a string literal in scope where the macro is used (kProbe).
#define PROBE_CHECK(call)                                                            \
  do {                                                                               \
    const cudaError_t err_ = (call);                                                 \
    if (err_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s: %s\n", kProbe, #call, cudaGetErrorString(err_)); \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

// A probe takes no options: --help (or -h) prints `about`, what the probe answers, and exits 0;
// any other argument is refused (kExitUsage) rather than ignored.
inline void probe_command_line(const char* probe, const char* about, int argc, char** argv) {
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf(
        "%s: %s\nUsage: %s (no options)\nExit status: 0 probed; 1 a check of the probe's own "
        "failed; 2 nothing probed (a wrong command line, no sm_90 GPU)\n",
        probe, about, probe);
    std::exit(0);
  }
  if (argc > 1) {
    std::fprintf(stderr, "%s: %s: a probe takes no options\nRun %s --help for what it does.\n",
                 probe, argv[1], probe);
    std::exit(cudp::bench::kExitUsage);
  }
}

// Device 0's properties, or false with a line saying why there is nothing to probe: no usable CUDA
// device, or one that is not sm_90 (`feature`: what the probe needs of it). The probe then
// measured nothing, and main returns kExitUsage, as the bench programs do without a GPU.
inline bool probe_sm90_device(const char* probe, const char* feature, cudaDeviceProp* prop) {
  if (!cudp::bench::usable_cuda_device(probe)) return false;
  const cudaError_t err = cudaGetDeviceProperties(prop, 0);
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: cudaGetDeviceProperties: %s\n", probe, cudaGetErrorString(err));
    std::exit(2);
  }
  if (prop->major != 9) {
    std::fprintf(stderr,
                 "%s: %s is compute capability %d.%d; the probe needs sm_90's %s (a Hopper "
                 "GPU): nothing probed\n",
                 probe, prop->name, prop->major, prop->minor, feature);
    return false;
  }
  return true;
}
