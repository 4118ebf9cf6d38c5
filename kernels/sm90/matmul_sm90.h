// Host entry points of the sm_90a tensor-core kernels (kernels/sm90/*.cu, built for sm_90a only).
// kernels/matmul.cpp calls them after validating the problem and choosing the plan; nothing else
// should. Each precision lives in its own translation unit (matmul_sm90_bf16.cu, _tf32.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/matmul.h"

namespace cudp::kernels::sm90 {

// The tile widths a plan may choose (tile_m is always 128).
constexpr int kTileWidths[] = {128, 256};

// Enqueues the mainloop for `plan`; with plan.splits > 1 it writes fp32 partial tiles to
// `workspace` ([split][m][n]) instead of C, and the caller runs the split-K reduction.
void matmul_bf16(const MatmulProblem& problem, const MatmulPlan& plan, float* workspace,
                 cudaStream_t stream);
void matmul_tf32(const MatmulProblem& problem, const MatmulPlan& plan, float* workspace,
                 cudaStream_t stream);

// Blocks that fit on one SM for the kernels above (1: they use most of the shared memory).
constexpr int kBlocksPerSm = 1;

}  // namespace cudp::kernels::sm90
