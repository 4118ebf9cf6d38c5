// GPU tests of checkpoints: real training steps on one GPU resumed from a checkpoint, K + K steps
// against 2K straight, bit for bit (tests/layers/resume_testing.h), under fp32 and under bf16 and
// tf32 on the tensor cores. The host twin (checkpoint_test) runs the same check on the CPU path.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "tests/layers/resume_testing.h"

namespace cudp {
namespace {

TEST(CheckpointResumeGpu, Fp32TrainingResumesBitExactly) {
  CUDP_REQUIRE_GPU();
  testing::expect_exact_resume(Device::cuda(0), Precision::fp32, 3);
}

TEST(CheckpointResumeGpu, Bf16TrainingResumesBitExactly) {
  CUDP_REQUIRE_TENSOR_CORES();
  testing::expect_precision_changes_training(Device::cuda(0), Precision::bf16, 3);
  testing::expect_exact_resume(Device::cuda(0), Precision::bf16, 3);
}

TEST(CheckpointResumeGpu, Tf32TrainingResumesBitExactly) {
  CUDP_REQUIRE_TENSOR_CORES();
  testing::expect_precision_changes_training(Device::cuda(0), Precision::tf32, 3);
  testing::expect_exact_resume(Device::cuda(0), Precision::tf32, 3);
}

// The snapshot in two halves (stage_checkpoint): device copies taken on the stream, brought to
// the host later on the writer's thread while the next step runs.
TEST(CheckpointStagedGpu, AStagedCheckpointHoldsItsMoment) {
  CUDP_REQUIRE_GPU();
  testing::expect_staged_checkpoint_holds_its_moment(Device::cuda(0), Precision::fp32, 2);
}

TEST(CheckpointStagedGpu, AStagedBf16CheckpointHoldsItsMoment) {
  CUDP_REQUIRE_TENSOR_CORES();
  testing::expect_staged_checkpoint_holds_its_moment(Device::cuda(0), Precision::bf16, 2);
}

}  // namespace
}  // namespace cudp
