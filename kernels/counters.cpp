// The arrival counters' sets (kernels/counters.h).
#include "kernels/counters.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/memory.h"

namespace cudp::kernels {
namespace {

// The sets of the process. They live as long as it does (a captured graph may use a set at any
// later replay), never destroyed, as the default streams are (engine/core/stream.cpp: no CUDA call
// may run from a static destructor); release_arrival_counters frees them when a program says that
// nothing will use them again.
struct CounterSets {
  struct Set {
    int device;
    cudaStream_t stream;
    bool captured;
    int* counters;
    int64_t units;
  };
  std::mutex mutex;
  std::vector<Set> sets;      // one per (device, stream) that ran such a launch: a handful
  std::vector<int*> retired;  // sets outgrown by a larger launch, kept for graphs that use them
};

CounterSets& counter_sets() {
  static auto* sets = new CounterSets;
  return *sets;
}

}  // namespace

int* arrival_counters(cudaStream_t stream, int64_t units, const char* what) {
  CounterSets& registry = counter_sets();
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool captured = capture != cudaStreamCaptureStatusNone;
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto& sets = registry.sets;
  auto it = std::find_if(sets.begin(), sets.end(), [&](const CounterSets::Set& s) {
    return s.device == device && s.stream == stream && s.captured == captured;
  });
  if (it != sets.end() && it->units >= units) return it->counters;
  // A new or larger set (the old one is retired, not freed: a captured graph may use it).
  // Allocated and zeroed outside any capture open on this thread (relaxed mode: a step's first
  // such launch may be inside one), on a stream of its own, waited for here.
  int64_t size = 4096;
  while (size < units) size *= 2;
  const size_t bytes = size_t(size) * sizeof(int);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  CUDP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  int* counters = nullptr;
  cudaStream_t side = nullptr;
  const char* call = "cudaMalloc";
  cudaError_t status = cudaMalloc(reinterpret_cast<void**>(&counters), bytes);
  if (status == cudaSuccess) {
    call = "cudaStreamCreateWithFlags";
    status = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
  }
  if (status == cudaSuccess) {
    call = "cudaMemsetAsync";
    status = cudaMemsetAsync(counters, 0, bytes, side);
  }
  if (status == cudaSuccess) {
    call = "cudaStreamSynchronize";
    status = cudaStreamSynchronize(side);
  }
  if (side != nullptr) cudaStreamDestroy(side);
  const cudaError_t restored = cudaThreadExchangeStreamCaptureMode(&mode);
  if (status == cudaSuccess && restored != cudaSuccess) {
    call = "cudaThreadExchangeStreamCaptureMode";
    status = restored;
  }
  if (status != cudaSuccess && counters != nullptr) cudaFree(counters);
  cuda::check_allocation(status, bytes, what, call);
  if (it != sets.end()) {
    registry.retired.push_back(it->counters);
    it->counters = counters;
    it->units = size;
  } else {
    sets.push_back({device, stream, captured, counters, size});
  }
  return counters;
}

void release_arrival_counters() noexcept {
  CounterSets& registry = counter_sets();
  std::lock_guard<std::mutex> lock(registry.mutex);
  for (const CounterSets::Set& s : registry.sets) static_cast<void>(cudaFree(s.counters));
  for (int* counters : registry.retired) static_cast<void>(cudaFree(counters));
  registry.sets.clear();
  registry.retired.clear();
}

}  // namespace cudp::kernels
