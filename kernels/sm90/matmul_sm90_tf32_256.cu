// The sm_90a mainloop's instantiations for TF32, 256 columns a tile
// (kernels/sm90/matmul_sm90.cuh: one translation unit each, compiled in parallel).
#include "kernels/sm90/matmul_sm90.cuh"

namespace cudp::kernels::sm90 {

CUDP_SM90_TF32_256();

}  // namespace cudp::kernels::sm90
