// The bf16 entry points of the sm_90a mainloop (kernels/sm90/matmul_sm90.cuh): each picks the
// instantiation for its tile width and feed; those live in matmul_sm90_bf16_*.cu.
#include "kernels/sm90/matmul_sm90.cuh"
#include "kernels/sm90/matmul_sm90.h"

namespace cudp::kernels::sm90 {

// Instantiated in their own units (matmul_sm90.cuh).
CUDP_SM90_BF16_64(extern);
CUDP_SM90_BF16_128(extern);
CUDP_SM90_BF16_256(extern);
CUDP_SM90_BF16_SWAPPED(extern);
CUDP_SM90_BF16_RESIDENT(extern);
CUDP_SM90_BF16_HALO128(extern);
CUDP_SM90_BF16_HALO256(extern);

void matmul_bf16(const MatmulProblem& problem, const MatmulPlan& plan, float* workspace,
                 cudaStream_t stream) {
  const int mode = problem.a_transposed ? kGemmTT : problem.b_transposed ? kGemmBT : kGemm;
  switch (plan.tile_n) {
    case 64:
      return launch_mainloop<__nv_bfloat16, 64>(problem, plan, workspace, stream, nullptr, mode);
    case 128:
      return launch_mainloop<__nv_bfloat16, 128>(problem, plan, workspace, stream, nullptr, mode);
    case 256:
      return launch_mainloop<__nv_bfloat16, 256>(problem, plan, workspace, stream, nullptr, mode);
    default: CUDP_CHECK(false, "matmul: no bf16 kernel with tile width ", plan.tile_n);
  }
}

void conv_bf16(const MatmulProblem& problem, const ConvGather& conv, const MatmulPlan& plan,
               float* workspace, cudaStream_t stream) {
  switch (plan.tile_n) {
    case 64: return launch_mainloop<__nv_bfloat16, 64>(problem, plan, workspace, stream, &conv);
    case 128: return launch_mainloop<__nv_bfloat16, 128>(problem, plan, workspace, stream, &conv);
    case 256: return launch_mainloop<__nv_bfloat16, 256>(problem, plan, workspace, stream, &conv);
    default: CUDP_CHECK(false, "conv: no bf16 kernel with tile width ", plan.tile_n);
  }
}

void conv_wgrad_bf16(const MatmulProblem& problem, const ConvGather& conv, const MatmulPlan& plan,
                     float* workspace, cudaStream_t stream, bool alt, const PatchTiles* patch,
                     bool transposed, float* bias_partials) {
  const int mode = patch ? (transposed ? kWgradTmaT : kWgradTma) : alt ? kWgradAlt : kWgrad;
  switch (plan.tile_n) {
    case 64:
      return launch_mainloop<__nv_bfloat16, 64>(problem, plan, workspace, stream, &conv, mode,
                                                patch, bias_partials);
    case 128:
      return launch_mainloop<__nv_bfloat16, 128>(problem, plan, workspace, stream, &conv, mode,
                                                 patch, bias_partials);
    case 256:
      return launch_mainloop<__nv_bfloat16, 256>(problem, plan, workspace, stream, &conv, mode,
                                                 patch, bias_partials);
    default: CUDP_CHECK(false, "conv: no bf16 backward-weight kernel with tile width ", plan.tile_n);
  }
}

int resident_filter_blocks(const MatmulProblem& problem, const MatmulPlan& plan,
                           const PatchTiles& patch) {
  // One tile column, and few enough k-blocks (9: VGG's 64-channel forward and backward-data; 18:
  // the backward-data of 64 -> 128, whose reduction is 128 channels x 9 taps) to leave >= 4
  // stages for x. Swapped tiles keep 32 KB for their staging of C: 9 at most.
  const int k_blocks = (problem.k + 63) / 64;
  if (!patch.filters_resident || problem.math != Math::BF16 || problem.n > plan.tile_n) return 0;
  if (conv_swapped_applies(problem, plan, patch)) return k_blocks <= 9 ? 9 : 0;
  if (plan.tile_n == 64) return k_blocks <= 9 ? 9 : k_blocks <= 18 ? 18 : 0;
  if (plan.tile_n == 128) return k_blocks <= 9 ? 9 : 0;
  return 0;
}

void conv_tma_bf16(const MatmulProblem& problem, const ConvGather& conv, const PatchTiles& patch,
                   const MatmulPlan& plan, float* workspace, cudaStream_t stream, bool unrotated,
                   float* column_partials) {
  const int resident = resident_filter_blocks(problem, plan, patch);
  if (conv_swapped_applies(problem, plan, patch)) {
    const int mode = patch.halo ? (unrotated ? kConvHaloBTSwap : kConvHaloSwap)
                                : (unrotated ? kConvTmaBTSwap : kConvTmaSwap);
    CUDP_CHECK(!patch.halo || resident == 9,
               "conv: halo tiles keep their 9 k-blocks of filters resident (got ", resident, ")");
    if (resident == 9) {
      return launch_mainloop<__nv_bfloat16, 64, 9>(problem, plan, workspace, stream, &conv, mode,
                                                   &patch, nullptr, column_partials);
    }
    return launch_mainloop<__nv_bfloat16, 64>(problem, plan, workspace, stream, &conv, mode, &patch,
                                              nullptr, column_partials);
  }
  if (patch.halo) {  // the wide layers' halo tiles (two rings)
    CUDP_CHECK(resident == 0, "conv: halo tiles of wide layers stream their filters");
    if (plan.tile_n == 128) {
      return launch_conv_halo<128>(problem, plan, conv, patch, unrotated, column_partials, stream);
    }
    if (plan.tile_n == 256) {
      return launch_conv_halo<256>(problem, plan, conv, patch, unrotated, column_partials, stream);
    }
    CUDP_CHECK(false, "conv: no halo-tile kernel with tile width ", plan.tile_n);
  }
  const int mode = unrotated ? kConvTmaBT : kConvTma;
  switch (plan.tile_n) {
    case 64:
      if (resident == 9) {
        return launch_mainloop<__nv_bfloat16, 64, 9>(problem, plan, workspace, stream, &conv, mode,
                                                     &patch, nullptr, column_partials);
      }
      if (resident == 18) {
        return launch_mainloop<__nv_bfloat16, 64, 18>(problem, plan, workspace, stream, &conv, mode,
                                                      &patch, nullptr, column_partials);
      }
      return launch_mainloop<__nv_bfloat16, 64>(problem, plan, workspace, stream, &conv, mode,
                                                &patch, nullptr, column_partials);
    case 128:
      if (resident == 9) {
        return launch_mainloop<__nv_bfloat16, 128, 9>(problem, plan, workspace, stream, &conv, mode,
                                                      &patch, nullptr, column_partials);
      }
      return launch_mainloop<__nv_bfloat16, 128>(problem, plan, workspace, stream, &conv, mode,
                                                 &patch, nullptr, column_partials);
    case 256:
      return launch_mainloop<__nv_bfloat16, 256>(problem, plan, workspace, stream, &conv, mode,
                                                 &patch, nullptr, column_partials);
    default: CUDP_CHECK(false, "conv: no bf16 kernel with tile width ", plan.tile_n);
  }
}

}  // namespace cudp::kernels::sm90
