#include "engine/core/launch.h"

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

#include "engine/core/error.h"

namespace cudp::detail {
namespace {

std::atomic<bool> g_programmatic{true};
// Per visible device: 0 unknown, 1 capable (compute capability >= 9.0), 2 not.
constexpr int kMaxDevices = 64;
std::array<std::atomic<int>, kMaxDevices> g_capable{};

}  // namespace

// CMakeLists.txt defines it: 1 when every CUDA architecture the kernels were built for is sm_90 or
// later, so that each of them waits in kernel_entry(); otherwise launches stay ordinary.
#ifndef CUDP_PDL_ARCHITECTURES
#define CUDP_PDL_ARCHITECTURES 0
#endif

bool programmatic_launch() {
  if (!CUDP_PDL_ARCHITECTURES || !g_programmatic.load(std::memory_order_relaxed)) return false;
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return false;
  int known = g_capable[device].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0;
    CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    known = major >= 9 ? 1 : 2;
    g_capable[device].store(known, std::memory_order_relaxed);
  }
  return known == 1;
}

void set_programmatic_launch(bool on) {
  g_programmatic.store(on);
}

}  // namespace cudp::detail
