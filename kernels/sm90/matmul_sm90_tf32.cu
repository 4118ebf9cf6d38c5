// The TF32 entry points of the sm_90a mainloop (kernels/sm90/matmul_sm90.cuh): each picks the
// instantiation for its tile width and feed; those live in matmul_sm90_tf32_*.cu.
#include "kernels/sm90/matmul_sm90.cuh"
#include "kernels/sm90/matmul_sm90.h"

namespace cudp::kernels::sm90 {

// Instantiated in their own units (matmul_sm90.cuh).
CUDP_SM90_TF32_64(extern);
CUDP_SM90_TF32_128(extern);
CUDP_SM90_TF32_256(extern);

void matmul_tf32(const MatmulProblem& problem, const MatmulPlan& plan, float* workspace,
                 cudaStream_t stream) {
  const int mode = problem.b_transposed ? kGemmBT : kGemm;
  switch (plan.tile_n) {
    case 64:
      return launch_mainloop<float, 64>(problem, plan, workspace, stream, nullptr, mode);
    case 128:
      return launch_mainloop<float, 128>(problem, plan, workspace, stream, nullptr, mode);
    case 256:
      return launch_mainloop<float, 256>(problem, plan, workspace, stream, nullptr, mode);
    default: CUDP_CHECK(false, "matmul: no tf32 kernel with tile width ", plan.tile_n);
  }
}

void conv_tf32(const MatmulProblem& problem, const ConvGather& conv, const MatmulPlan& plan,
               float* workspace, cudaStream_t stream) {
  switch (plan.tile_n) {
    case 64: return launch_mainloop<float, 64>(problem, plan, workspace, stream, &conv);
    case 128: return launch_mainloop<float, 128>(problem, plan, workspace, stream, &conv);
    case 256: return launch_mainloop<float, 256>(problem, plan, workspace, stream, &conv);
    default: CUDP_CHECK(false, "conv: no tf32 kernel with tile width ", plan.tile_n);
  }
}

void conv_tma_tf32(const MatmulProblem& problem, const ConvGather& conv, const PatchTiles& patch,
                   const MatmulPlan& plan, float* workspace, cudaStream_t stream,
                   float* column_partials) {
  switch (plan.tile_n) {
    case 64:
      return launch_mainloop<float, 64>(problem, plan, workspace, stream, &conv, kConvTma, &patch,
                                        nullptr, column_partials);
    case 128:
      return launch_mainloop<float, 128>(problem, plan, workspace, stream, &conv, kConvTma, &patch,
                                         nullptr, column_partials);
    case 256:
      return launch_mainloop<float, 256>(problem, plan, workspace, stream, &conv, kConvTma, &patch,
                                         nullptr, column_partials);
    default: CUDP_CHECK(false, "conv: no tf32 kernel with tile width ", plan.tile_n);
  }
}

void conv_wgrad_tf32(const MatmulProblem& problem, const PatchTiles& patch, const MatmulPlan& plan,
                     float* workspace, cudaStream_t stream, bool transposed) {
  const int mode = transposed ? kWgradShiftT : kWgradShift;
  switch (plan.tile_n) {
    case 64:
      return launch_mainloop<float, 64>(problem, plan, workspace, stream, nullptr, mode, &patch);
    case 128:
      return launch_mainloop<float, 128>(problem, plan, workspace, stream, nullptr, mode, &patch);
    case 256:
      return launch_mainloop<float, 256>(problem, plan, workspace, stream, nullptr, mode, &patch);
    default:
      CUDP_CHECK(false, "conv: no tf32 kernel with tile width ", plan.tile_n);
  }
}

void conv_wgrad_tf32_patch(const MatmulProblem& problem, const ConvGather& conv,
                           const PatchTiles& patch, const MatmulPlan& plan, float* workspace,
                           cudaStream_t stream, bool transposed) {
  const int mode = transposed ? kWgradTmaT : kWgradTma;
  switch (plan.tile_n) {
    case 64:
      return launch_mainloop<float, 64>(problem, plan, workspace, stream, &conv, mode, &patch);
    case 128:
      return launch_mainloop<float, 128>(problem, plan, workspace, stream, &conv, mode, &patch);
    case 256:
      return launch_mainloop<float, 256>(problem, plan, workspace, stream, &conv, mode, &patch);
    default:
      CUDP_CHECK(false, "conv: no tf32 kernel with tile width ", plan.tile_n);
  }
}

}  // namespace cudp::kernels::sm90
