// Host helpers of the sm_90a kernels: tensor-map encoding, the shared-memory opt-in and the
// in-kernel split-K sum's counters.
#include <cudaTypedefs.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/core/memory.h"
#include "kernels/sm90/matmul_sm90.cuh"

namespace cudp::kernels::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found{};
    CUDP_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000,
                                                     cudaEnableDefault, &found));
    CUDP_CHECK(found == cudaDriverEntryPointSuccess && entry != nullptr,
               "the CUDA driver has no cuTensorMapEncodeTiled: tensor-core kernels need a driver "
               "for CUDA 12 or newer; update the driver or use Math::FP32");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  }();
  return fn;
}

}  // namespace

CUtensorMap encode_k_major(const void* ptr, CUtensorMapDataType type, int elem_bytes, int rows,
                           int cols, int64_t ld, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * cuuint64_t(elem_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(kRowBytes / elem_bytes), cuuint32_t(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status = encode_tiled()(
      &map, type, 2, const_cast<void*>(ptr), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  CUDP_CHECK(status == CUDA_SUCCESS, "matmul: cuTensorMapEncodeTiled failed (CUresult ", int(status),
             ") for a ", rows, " x ", cols, " operand with row stride ", ld,
             ": the operand must be 16-byte aligned with a row stride that is a multiple of 16 bytes");
  return map;
}

CUtensorMap encode_patch_map(const ConvGather& g, CUtensorMapDataType type, int elem_bytes,
                             const PatchTiles& t) {
  CUtensorMap map{};
  const cuuint64_t dims[4] = {cuuint64_t(g.c), cuuint64_t(g.w), cuuint64_t(g.h), cuuint64_t(g.n)};
  const cuuint64_t row = cuuint64_t(g.c) * elem_bytes;
  const cuuint64_t strides[3] = {row, row * g.w, row * g.w * g.h};
  const cuuint32_t box[4] = {cuuint32_t(kRowBytes / elem_bytes), cuuint32_t(t.wb), cuuint32_t(t.hb),
                             cuuint32_t(t.nb)};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult status = encode_tiled()(
      &map, type, 4, const_cast<void*>(g.x), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  CUDP_CHECK(status == CUDA_SUCCESS, "conv: cuTensorMapEncodeTiled failed (CUresult ", int(status),
             ") for an NHWC tensor of ", g.n, " x ", g.h, " x ", g.w, " x ", g.c,
             " with a ", t.wb, " x ", t.hb, " x ", t.nb, " box");
  return map;
}

void allow_shared_memory(const void* kernel, int bytes) {
  // One flag per (kernel, device): the attribute belongs to the function on the current device.
  static std::mutex mutex;
  static std::vector<std::pair<const void*, int>> done;
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [k, d] : done) {
    if (k == kernel && d == device) return;
  }
  CUDP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.emplace_back(kernel, device);
}

namespace {

// The split-K counter sets of the process. They live as long as it does (a captured graph may use
// a set at any later replay), never destroyed, as the default streams are (engine/core/stream.cpp:
// no CUDA call may run from a static destructor); release_splitk_counters frees them when a
// program says that nothing will use them again.
struct SplitKCounterSets {
  struct Set {
    int device;
    cudaStream_t stream;
    bool captured;
    int* counters;
    int64_t units;
  };
  std::mutex mutex;
  std::vector<Set> sets;      // one per (device, stream) that ran such a product: a handful
  std::vector<int*> retired;  // sets outgrown by a larger product, kept for graphs that use them
};

SplitKCounterSets& splitk_counter_sets() {
  static auto* sets = new SplitKCounterSets;
  return *sets;
}

}  // namespace

int* splitk_counters(cudaStream_t stream, int64_t units) {
  SplitKCounterSets& registry = splitk_counter_sets();
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool captured = capture != cudaStreamCaptureStatusNone;
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto& sets = registry.sets;
  auto it = std::find_if(sets.begin(), sets.end(), [&](const SplitKCounterSets::Set& s) {
    return s.device == device && s.stream == stream && s.captured == captured;
  });
  if (it != sets.end() && it->units >= units) return it->counters;
  // A new or larger set (the old one is retired, not freed: a captured graph may use it).
  // Allocated and zeroed outside any capture open on this thread (relaxed mode: a step's first
  // product may be inside one), on a stream of its own, waited for here.
  int64_t size = 4096;
  while (size < units) size *= 2;
  const size_t bytes = size_t(size) * sizeof(int);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  CUDP_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  int* counters = nullptr;
  cudaStream_t side = nullptr;
  const char* call = "cudaMalloc";
  cudaError_t status = cudaMalloc(&counters, bytes);
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
  cuda::check_allocation(status, bytes, "the split-K sum's arrival counters", call);
  if (it != sets.end()) {
    registry.retired.push_back(it->counters);
    it->counters = counters;
    it->units = size;
  } else {
    sets.push_back({device, stream, captured, counters, size});
  }
  return counters;
}

void release_splitk_counters() noexcept {
  SplitKCounterSets& registry = splitk_counter_sets();
  std::lock_guard<std::mutex> lock(registry.mutex);
  for (const SplitKCounterSets::Set& s : registry.sets) static_cast<void>(cudaFree(s.counters));
  for (int* counters : registry.retired) static_cast<void>(cudaFree(counters));
  registry.sets.clear();
  registry.retired.clear();
}

}  // namespace cudp::kernels::sm90
