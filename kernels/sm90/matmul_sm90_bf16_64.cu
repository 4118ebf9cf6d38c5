// The sm_90a mainloop's instantiations for bf16, 64 columns a tile (the swapped 64-channel layers
// among them) (kernels/sm90/matmul_sm90.cuh: one translation unit each, compiled in parallel).
#include "kernels/sm90/matmul_sm90.cuh"

namespace cudp::kernels::sm90 {

CUDP_SM90_BF16_64();

}  // namespace cudp::kernels::sm90
