// cudp-vgg, the trainer, run as a user runs it (host tests: CI has no GPU).
//
// Each test runs the built program (CUDP_VGG_BINARY, set by tests/CMakeLists.txt) with
// CUDA_VISIBLE_DEVICES="" so that it takes the CPU path on every machine, GPU machines included,
// and checks its exit code and output:
//   - a short synthetic VGG-11 run on the CPU trains one epoch and reports a finite loss and a test
//     accuracy;
//   - a checkpoint round trip: --eval-only --resume prints the checksum the training run printed;
//   - an exact resume on the CPU: 2 epochs straight and 1 + 1 give the same checksum (the GPU test
//     does the same at a larger scale on 1 and 2 GPUs);
//   - refusals: --precision tf32/bf16 (exit 2), CLI11 usage errors (exit != 0), an invalid --gpus
//     id (the message names the valid range, or says no GPU is visible), --eval-only without
//     --resume, a resume with another --seed or --batch-size.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "engine/core/device.h"
#include "examples/run_binary.h"

namespace {

using namespace cudp::testing;

// Runs cudp-vgg with `args` on the CPU: no GPU visible.
RunResult run_on_cpu(const TempDir& dir, const std::string& args) {
  return run_vgg(dir, args, "CUDA_VISIBLE_DEVICES= ");
}

// The smallest setting that trains a real VGG (VGG-11-BN, compact head) on the CPU references,
// which run a few images per second (plain loops accumulating in double): a few dozen images.
const std::string kSmall = "--data synthetic --arch vgg11 --workers 2 ";

TEST(VggTrainer, TrainsOneEpochOnTheCpu) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const RunResult r = run_on_cpu(dir, kSmall +
                                          "--epochs 1 --limit-train 64 --limit-test 32 "
                                          "--batch-size 32 --print-checksum");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "0 visible GPU(s)")) << r.output;
  EXPECT_TRUE(contains(r.output, "first 64 of 10000 train images")) << r.output;
  EXPECT_TRUE(contains(r.output, "first 32 of 2000 test images")) << r.output;
  EXPECT_TRUE(contains(r.output, "epoch 1/1 step 2/2")) << r.output;
  EXPECT_TRUE(contains(r.output, "on the CPU")) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      r.output, m,
      std::regex(R"(epoch 1/1: train loss (\S+), train accuracy (\S+)%, test loss (\S+), )"
                 R"(test accuracy ([0-9.]+)%)")))
      << r.output;
  const double train_loss = std::stod(m[1]), test_loss = std::stod(m[3]);
  const double test_accuracy = std::stod(m[4]);
  EXPECT_TRUE(std::isfinite(train_loss)) << r.output;
  EXPECT_TRUE(std::isfinite(test_loss)) << r.output;
  EXPECT_GE(test_accuracy, 0.0);
  EXPECT_LE(test_accuracy, 100.0);
  EXPECT_TRUE(contains(r.output, "done: best test accuracy")) << r.output;
  EXPECT_NE(checksum_of(r), "") << r.output;
}

// The checkpoint holds the model bit for bit: evaluating it prints the training run's checksum.
// And an exact resume: 2 epochs straight == 1 epoch, then --resume for the second, with the
// default onecycle schedule stopped by --stop-after as an interrupted run is (the GPU test also
// does --schedule constant with --epochs 1 then --epochs 2; the CPU is too slow for both here).
TEST(VggTrainer, CheckpointRoundTripAndExactResumeOnTheCpu) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string base = kSmall +
                           "--limit-train 32 --limit-test 16 --batch-size 16 "
                           "--print-checksum ";
  const std::string common = base + "--schedule onecycle ";
  const RunResult a =
      run_on_cpu(dir, common + "--epochs 2 --checkpoint '" + (dir / "a.safetensors") + "'");
  ASSERT_EQ(a.code, 0) << a.output;
  const std::string sum_a = checksum_of(a);
  ASSERT_NE(sum_a, "") << a.output;

  const RunResult eval =
      run_on_cpu(dir, base + "--eval-only --resume '" + (dir / "a.safetensors") + "'");
  ASSERT_EQ(eval.code, 0) << eval.output;
  EXPECT_TRUE(contains(eval.output, "test accuracy")) << eval.output;
  EXPECT_EQ(checksum_of(eval), sum_a) << eval.output;

  const std::string first = "--epochs 2 --stop-after 1 ";
  const RunResult b1 =
      run_on_cpu(dir, common + first + "--checkpoint '" + (dir / "b.safetensors") + "'");
  ASSERT_EQ(b1.code, 0) << b1.output;
  EXPECT_NE(checksum_of(b1), sum_a) << "one epoch left the weights as two did";
  const RunResult b2 =
      run_on_cpu(dir, common + "--epochs 2 --resume '" + (dir / "b.safetensors") + "'");
  ASSERT_EQ(b2.code, 0) << b2.output;
  EXPECT_TRUE(contains(b2.output, "resumed from")) << b2.output;
  EXPECT_TRUE(contains(b2.output, "epoch 2/2:")) << b2.output;
  EXPECT_FALSE(contains(b2.output, "epoch 1/2:")) << b2.output;
  EXPECT_EQ(checksum_of(b2), sum_a) << "resumed run differs from the straight one:\n" << b2.output;

  // A resume that would be another run is refused; settings left out come from the checkpoint.
  const std::string ckpt = "--resume '" + (dir / "b.safetensors") + "' ";
  RunResult r = run_on_cpu(dir, base + ckpt + "--seed 7");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "written with --seed 0, this run has --seed 7")) << r.output;
  r = run_on_cpu(dir, kSmall + "--limit-test 16 --batch-size 32 " + ckpt);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--batch-size 16, this run has --batch-size 32")) << r.output;
  // data, arch, --limit-train, --batch-size, --seed: taken from the checkpoint
  r = run_on_cpu(dir, "--eval-only --print-checksum --limit-test 16 " + ckpt);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "vgg11-bn")) << r.output;
  EXPECT_TRUE(contains(r.output, "first 32 of 10000 train images")) << r.output;
}

TEST(VggTrainer, RefusesTensorCorePrecisions) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  for (const std::string precision : {"tf32", "bf16"}) {
    const RunResult r = run_on_cpu(dir, "--data synthetic --precision " + precision);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "--precision " + precision + " is not implemented yet"))
        << r.output;
    EXPECT_TRUE(contains(r.output, "use --precision fp32")) << r.output;
  }
}

TEST(VggTrainer, UsageErrors) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  RunResult r = run_on_cpu(dir, "--no-such-option");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "no-such-option")) << r.output;
  r = run_on_cpu(dir, "--arch vgg99");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--arch")) << r.output;
  r = run_on_cpu(dir, "--batch-size 0");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--batch-size")) << r.output;
  r = run_on_cpu(dir, "--epochs many");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--epochs")) << r.output;
  r = run_on_cpu(dir, "--gpus x");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "\"x\" is not a device id")) << r.output;
  r = run_on_cpu(dir, "--help");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--limit-train")) << r.output;
  EXPECT_TRUE(contains(r.output, "--print-checksum")) << r.output;
}

TEST(VggTrainer, InvalidGpuIdNamesTheValidRange) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  // Without a GPU (forced), then with the machine's GPUs as they are.
  RunResult r = run_on_cpu(dir, "--data synthetic --gpus 0");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "invalid device id 0: no CUDA device is visible")) << r.output;

  const int count = cudp::cuda::device_count();
  r = run_vgg(dir, "--data synthetic --gpus 99");
  EXPECT_EQ(r.code, 2) << r.output;
  if (count == 0) {
    EXPECT_TRUE(contains(r.output, "invalid device id 99: no CUDA device is visible")) << r.output;
  } else {
    EXPECT_TRUE(
        contains(r.output, "invalid device id 99: valid ids are 0.." + std::to_string(count - 1)))
        << r.output;
  }
}

TEST(VggTrainer, EvalOnlyNeedsResume) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const RunResult r = run_on_cpu(dir, "--data synthetic --eval-only");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--eval-only needs --resume")) << r.output;
}

TEST(VggTrainer, MissingCheckpointIsAnError) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const RunResult r =
      run_on_cpu(dir, "--data synthetic --resume '" + (dir / "absent.safetensors") + "'");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "absent")) << r.output;
}

}  // namespace
