// The sm_90a mainloop's instantiations for bf16 with 18 (64 columns) or 9 (128 columns)
// k-blocks of filters resident in shared memory
// (kernels/sm90/matmul_sm90.cuh: one translation unit each, compiled in parallel).
#include "kernels/sm90/matmul_sm90.cuh"

namespace cudp::kernels::sm90 {

CUDP_SM90_BF16_RESIDENT();

}  // namespace cudp::kernels::sm90
