// The sm_90a mainloop's instantiations for the halo tiles of the wide layers (bf16),
// 128 columns a tile
// (kernels/sm90/matmul_sm90.cuh: one translation unit each, compiled in parallel).
#include "kernels/sm90/matmul_sm90.cuh"

namespace cudp::kernels::sm90 {

CUDP_SM90_BF16_HALO128();

}  // namespace cudp::kernels::sm90
