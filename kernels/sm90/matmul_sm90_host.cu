// Host helpers of the sm_90a kernels: tensor-map encoding and the shared-memory opt-in.
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

}  // namespace cudp::kernels::sm90
