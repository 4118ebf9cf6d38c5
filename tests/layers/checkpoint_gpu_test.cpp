// GPU tests of checkpoints: real training steps on one GPU resumed from a checkpoint, K + K steps
// against 2K straight, bit for bit (tests/layers/resume_testing.h), under fp32 and under bf16 and
// tf32 on the tensor cores. The host twin (checkpoint_test) runs the same check on the CPU path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "common/gpu.h"
#include "engine/core/memory.h"
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

// The staging buffer's two halves cut the tensors into pieces of at most a half and take turns;
// whatever the half's size (one piece a half at 256 bytes; several tensors a half at 1 MiB, which
// the first get() cuts to about half the state), and through one buffer used again, the host
// copies have the bits of snapshot_checkpoint's. The halves are filled with another pattern before
// each round, so that a copy out of a half before its DMA completed would be seen.
TEST(CheckpointStagedGpu, AnyStagingHalfGivesTheSameBits) {
  CUDP_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  testing::ResumeRun run = testing::make_resume_run(7, gpu, Precision::fp32);
  testing::train_step(run, 0, gpu);
  const CheckpointSnapshot then = snapshot_checkpoint(*run.model, run.sgd.get());
  const StagedCheckpoint staged = stage_checkpoint(*run.model, run.sgd.get());
  size_t largest = 0, state = 0;
  for (const auto& [name, t] : then.model) largest = std::max(largest, t.nbytes());
  for (const auto& item : staged.model.items) state += item.copy.nbytes();
  for (const auto& [key, t] : staged.train) state += t.nbytes();
  ASSERT_GT(largest, 4 * size_t(256)) << "no tensor spans several 256-byte halves";
  for (const size_t half : {size_t(256), size_t(1024), size_t(1) << 20}) {
    SCOPED_TRACE(::testing::Message() << "halves of " << half << " bytes");
    PinnedStaging staging(half);
    char* base = nullptr;
    ASSERT_NO_THROW(base = staging.get(state)) << "no page-locked memory: the test would check "
                                                  "the pageable copies instead";
    EXPECT_LE(staging.half_bytes(), half);
    EXPECT_GE(2 * staging.half_bytes(), std::min(2 * half, state))
        << "halves cut below half the state";
    for (int round = 0; round < 2; ++round) {
      std::memset(base, 0xA5 + round, 2 * staging.half_bytes());
      const CheckpointSnapshot later = staged.to_host(&staging);
      testing::expect_bitwise_same(later.model, then.model, "the model");
      testing::expect_bitwise_same(later.train, then.train, "the optimizer state");
    }
  }
  EXPECT_THROW(PinnedStaging(100), ValueError) << "a half not a multiple of 256 bytes";
}

// Without page-locked memory to spare (the allocation hook refuses the staging buffer), a staged
// checkpoint still reaches the host, through pageable copies, with the same bits; and a writer
// whose buffer could not be had saves all the same.
bool refuse_the_staging_buffer(size_t, int device) {
  return device == -1 &&
         cuda::AllocationPurpose::current_what().find(kPinnedStagingPurpose) != std::string::npos;
}

TEST(CheckpointStagedGpu, WithoutPageLockedMemoryTheCopiesArePageable) {
  CUDP_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  testing::ResumeRun run = testing::make_resume_run(7, gpu, Precision::fp32);
  testing::train_step(run, 0, gpu);
  const CheckpointSnapshot then = snapshot_checkpoint(*run.model, run.sgd.get());
  StagedCheckpoint staged = stage_checkpoint(*run.model, run.sgd.get());
  StagedCheckpoint written = stage_checkpoint(*run.model, run.sgd.get());
  testing::TempDir dir;
  const std::string path = dir.file("pageable.safetensors");
  CheckpointSnapshot later;
  {
    struct Refusing {
      Refusing() { detail::set_allocation_fault_hook(refuse_the_staging_buffer); }
      ~Refusing() { detail::set_allocation_fault_hook(nullptr); }
    } refusing;
    PinnedStaging staging;
    later = staged.to_host(&staging);
    EXPECT_THROW(staging.get(1 << 20), OutOfMemoryError) << "the hook refused nothing";
    CheckpointWriter writer;
    writer.save({path}, std::move(written));
    writer.wait();
  }
  testing::expect_bitwise_same(later.model, then.model, "the model, through pageable copies");
  testing::expect_bitwise_same(later.train, then.train, "the optimizer state, likewise");
  testing::ResumeRun loaded = testing::make_resume_run(99, gpu, Precision::fp32);
  load_checkpoint(path, *loaded.model, loaded.sgd.get());
  testing::expect_bitwise_same(loaded.model->state_dict(), then.model, "the model written");
}

}  // namespace
}  // namespace cudp
