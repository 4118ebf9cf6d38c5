// The tf32 instantiations of the sm_90a mainloop (kernels/sm90/matmul_sm90.cuh), one per tile width.
#include "kernels/sm90/matmul_sm90.cuh"
#include "kernels/sm90/matmul_sm90.h"

namespace cudp::kernels::sm90 {

void matmul_tf32(const MatmulProblem& problem, const MatmulPlan& plan, float* workspace,
                 cudaStream_t stream) {
  switch (plan.tile_n) {
    case 128: return launch_mainloop<float, 128>(problem, plan, workspace, stream);
    case 256: return launch_mainloop<float, 256>(problem, plan, workspace, stream);
    default: CUDP_CHECK(false, "matmul: no tf32 kernel with tile width ", plan.tile_n);
  }
}

}  // namespace cudp::kernels::sm90
