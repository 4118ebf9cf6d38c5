// cudp-vgg's exact resume on GPUs: the trainer run as a user runs it (CUDP_VGG_BINARY, set by
// tests/CMakeLists.txt), comparing --print-checksum (FNV-1a over the final state_dict) bitwise.
//
//   A  = 4 epochs straight, writing a checkpoint every epoch
//   B  = 2 epochs with --checkpoint b, then --resume b --epochs 4
// A and B must end with bit-identical weights and BatchNorm buffers, with --schedule constant
// (a schedule over --epochs would differ between a 2- and a 4-epoch run), and with the onecycle
// (default) and cosine schedules interrupted by --stop-after 2 (what a killed run resumes).
// On 1 GPU (--gpus 0) and on 2 (--gpus 0,1, where --print-checksum also checks that the replicas
// are bit-identical: momentum buffers on every replica, Dropout seeds derived from replica 0's).
//
// Also on the device path: the divergence guard (the step's loss and gradient norm read from the
// device at the read points) stops an absurd learning rate with the named error and leaves the
// checkpoint untouched; and a run folder with AdamW, warm-up, clipping and label smoothing on two
// GPUs keeps the replicas bit-identical and its metrics agree with the console. Under bf16 and
// tf32 (tensor cores) the exact resume holds too, and a tiny tf32 run trains.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "common/gpu.h"
#include "examples/run_binary.h"
#include "layers/checkpoint.h"

namespace {

using namespace cudp::testing;

// Runs A and B (see the header) on `gpus` with `schedule` and expects the same checksum.
void expect_exact_resume(const std::string& gpus, const std::string& schedule, size_t replicas,
                         const std::string& precision = "fp32") {
  SCOPED_TRACE("--gpus " + gpus + " --schedule " + schedule + " --precision " + precision);
  TempDir dir;
  const std::string common =
      "--data synthetic --limit-train 2048 --limit-test 512 --arch vgg11 "
      "--batch-size 128 --print-checksum --gpus " +
      gpus + " --schedule " + schedule + " --precision " + precision + " ";
  const std::string replica_line = "replicas: " + std::to_string(replicas) + ", bit-identical";

  const RunResult a =
      run_vgg(dir, common + "--epochs 4 --checkpoint '" + (dir / "a.safetensors") + "'");
  ASSERT_EQ(a.code, 0) << a.output;
  EXPECT_TRUE(contains(a.output, precision + " products")) << a.output;
  const std::string sum_a = checksum_of(a);
  ASSERT_NE(sum_a, "") << a.output;
  if (replicas > 1) {
    EXPECT_TRUE(contains(a.output, replica_line)) << a.output;
  }

  if (schedule == "constant") {
    // The same run again: if this differs, the trainer is not deterministic run to run (a kernel's
    // atomics, an all-reduce's order) and the resume comparison below cannot pass either.
    const RunResult again = run_vgg(dir, common + "--epochs 4");
    ASSERT_EQ(again.code, 0) << again.output;
    ASSERT_EQ(checksum_of(again), sum_a) << "two identical runs differ:\n" << again.output;
  }

  const std::string first = schedule == "constant" ? "--epochs 2 " : "--epochs 4 --stop-after 2 ";
  const RunResult b1 =
      run_vgg(dir, common + first + "--checkpoint '" + (dir / "b.safetensors") + "'");
  ASSERT_EQ(b1.code, 0) << b1.output;
  EXPECT_TRUE(contains(b1.output, schedule == "constant" ? "epoch 2/2:" : "epoch 2/4:"))
      << b1.output;
  EXPECT_NE(checksum_of(b1), sum_a) << "2 epochs left the weights as 4 did";

  const RunResult b2 = run_vgg(dir, common + "--epochs 4 --resume '" + (dir / "b.safetensors") +
                                        "' --checkpoint '" + (dir / "b.safetensors") + "'");
  ASSERT_EQ(b2.code, 0) << b2.output;
  EXPECT_TRUE(contains(b2.output, "resumed from")) << b2.output;
  EXPECT_FALSE(contains(b2.output, "epoch 2/4:")) << b2.output;
  EXPECT_TRUE(contains(b2.output, "epoch 4/4:")) << b2.output;
  if (replicas > 1) {
    EXPECT_TRUE(contains(b2.output, replica_line)) << b2.output;
  }
  EXPECT_EQ(checksum_of(b2), sum_a) << "4 epochs straight:\n"
                                    << a.output << "\n2 + 2 epochs (second half):\n"
                                    << b2.output;

  // The checkpoint after epoch 4 holds the model bit for bit: evaluating it prints the checksum
  // (with the precision the checkpoint saved: the evaluation below does not repeat it).
  const RunResult eval = run_vgg(dir, "--eval-only --print-checksum --limit-test 512 --gpus " +
                                          gpus + " --resume '" + (dir / "b.safetensors") + "'");
  ASSERT_EQ(eval.code, 0) << eval.output;
  EXPECT_EQ(checksum_of(eval), sum_a) << eval.output;
}

// --graphs on (the default: full batches replay a captured step, layers/train.h NOTE [Graphed
// training steps]) against --graphs off: the same weights and BatchNorm buffers bit for bit after
// two epochs of onecycle (a new rate at every step) with Dropout, a partial last batch run without
// the graph, and the evaluation between the epochs (graphed too: the same test losses).
void expect_graphs_match_eager(const std::string& gpus) {
  SCOPED_TRACE("--gpus " + gpus);
  TempDir dir;
  // 320 test images: two full evaluation batches of 128 and a partial one of 64 (eager).
  const std::string common =
      "--data synthetic --limit-train 1000 --limit-test 320 --arch vgg11 --batch-size 128 "
      "--epochs 2 --print-checksum --gpus " +
      gpus + " ";
  const RunResult on = run_vgg(dir, common + "--graphs on --json '" + (dir / "on.json") + "'");
  ASSERT_EQ(on.code, 0) << on.output;
  EXPECT_TRUE(contains(on.output, "CUDA graphs: on")) << on.output;
  const RunResult off = run_vgg(dir, common + "--graphs off --json '" + (dir / "off.json") + "'");
  ASSERT_EQ(off.code, 0) << off.output;
  EXPECT_TRUE(contains(off.output, "CUDA graphs: off")) << off.output;
  ASSERT_NE(checksum_of(off), "") << off.output;
  EXPECT_EQ(checksum_of(on), checksum_of(off)) << "graphs on:\n" << on.output << "\ngraphs off:\n"
                                               << off.output;
  // 16 training steps: two eager, the capture's launch and 4 replays, an eager partial batch, 7
  // replays and an eager partial batch. The evaluations: the first's second batch is captured
  // (one launch), the second's two full batches replay.
  EXPECT_TRUE(contains(on.output, "CUDA graphs: 12 training and 3 evaluation replays"))
      << on.output;
  EXPECT_FALSE(contains(off.output, "evaluation replays")) << off.output;
  // The evaluations (captured, then replayed) give the eager ones' losses.
  const std::vector<std::string> on_losses = json_log_numbers(dir / "on.json", "test_loss");
  EXPECT_EQ(on_losses.size(), 2u);
  EXPECT_EQ(on_losses, json_log_numbers(dir / "off.json", "test_loss"));
}

TEST(VggTrainerGpu, GraphsMatchEagerStepsOnOneGpu) {
  CUDP_REQUIRE_GPU();
  CUDP_REQUIRE_VGG();
  expect_graphs_match_eager("0");
}

TEST(VggTrainerGpu, GraphsMatchEagerStepsOnTwoGpus) {
  CUDP_REQUIRE_GPUS(2);
  CUDP_REQUIRE_VGG();
  expect_graphs_match_eager("0,1");
}

// --fused-grad-norm on (the default: the update sums the gradient norm as it reads the gradients)
// against off (a pass of its own before the update): the same weights and the same logged norms,
// bit for bit, through captured and replayed steps and an eager partial batch.
void expect_fused_grad_norm_on_gpus(const std::string& gpus) {
  SCOPED_TRACE("--gpus " + gpus);
  TempDir dir;
  // On GPUs the replicas' parameters are flat: the update sums the norm.
  const std::vector<std::string> norms = expect_fused_grad_norm_matches_its_own_pass(
      dir,
      "--data synthetic --limit-train 1000 --limit-test 128 --arch vgg11 --batch-size 128 "
      "--epochs 2 --print-freq 1 --print-checksum --gpus " +
          gpus + " ",
      "", "gradient norm: summed by the optimizer's update");
  EXPECT_GE(norms.size(), 10u);
}

// On a machine with a driver, a CUDA_VISIBLE_DEVICES that names no GPU (a mistyped UUID) ends the
// run with the reason instead of training on the CPU, which nobody asked for; --gpus none still
// trains there.
TEST(VggTrainerGpu, AMaskThatHidesEveryGpuIsAnErrorNotACpuRun) {
  CUDP_REQUIRE_GPU();
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string mask = "CUDA_VISIBLE_DEVICES=GPU-00000000-0000-0000-0000-000000000000 ";
  const std::string args =
      "--data synthetic --arch vgg11 --epochs 1 --limit-train 16 "
      "--limit-test 16 --batch-size 8 ";
  const RunResult r = run_vgg(dir, args, mask);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "no GPU can be used: CUDA_VISIBLE_DEVICES=")) << r.output;
  EXPECT_TRUE(contains(r.output, "leaves no GPU visible")) << r.output;
  EXPECT_FALSE(contains(r.output, "train loss")) << r.output;
  const RunResult cpu = run_vgg(dir, args + "--gpus none", mask);
  EXPECT_EQ(cpu.code, 0) << cpu.output;
}

// With --sync-bn every GPU takes part in each training step, so an epoch whose last batch is
// smaller than the GPUs is refused before training, not at the end of the first epoch.
TEST(VggTrainerGpu, SyncBatchNormRefusesALastBatchSmallerThanTheGpus) {
  CUDP_REQUIRE_GPUS(2);
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const RunResult r = run_vgg(dir,
                              "--data synthetic --arch vgg11 --gpus 0,1 --sync-bn --epochs 1 "
                              "--limit-train 17 --limit-test 8 --batch-size 8");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "each epoch's last batch, of 1 of the 17 training images, "
                       "reaches only 1 of them"))
      << r.output;
  EXPECT_FALSE(contains(r.output, "train loss")) << r.output;
  // The micro-batches of --accumulate too: 8 of one image each reach one of the two GPUs.
  const RunResult micro = run_vgg(dir,
                                  "--data synthetic --arch vgg11 --gpus 0,1 --sync-bn "
                                  "--epochs 1 --limit-train 16 --limit-test 8 --batch-size 8 "
                                  "--accumulate 8");
  EXPECT_EQ(micro.code, 2) << micro.output;
  EXPECT_TRUE(
      contains(micro.output, "split into --accumulate 8 micro-batches, has one of 1 images"))
      << micro.output;
  EXPECT_FALSE(contains(micro.output, "train loss")) << micro.output;
}

TEST(VggTrainerGpu, FusedGradNormMatchesItsOwnPassOnOneGpu) {
  CUDP_REQUIRE_GPU();
  CUDP_REQUIRE_VGG();
  expect_fused_grad_norm_on_gpus("0");
}

TEST(VggTrainerGpu, FusedGradNormMatchesItsOwnPassOnTwoGpus) {
  CUDP_REQUIRE_GPUS(2);
  CUDP_REQUIRE_VGG();
  expect_fused_grad_norm_on_gpus("0,1");
}

// --overlap-update on (each gradient bucket's update beside the rest of the backward) against off:
// the same weights and buffers bit for bit after two epochs, captured steps and the eager partial
// batch included; with --clip-grad it is a usage error.
void expect_overlapped_update_matches(const std::string& gpus) {
  SCOPED_TRACE("--gpus " + gpus);
  TempDir dir;
  const std::string common =
      "--data synthetic --limit-train 1000 --limit-test 256 --arch vgg11 --batch-size 128 "
      "--epochs 2 --precision bf16 --print-checksum --gpus " +
      gpus + " ";
  const RunResult on = run_vgg(dir, common + "--overlap-update on");
  ASSERT_EQ(on.code, 0) << on.output;
  EXPECT_TRUE(contains(on.output, "update beside the backward: on")) << on.output;
  // It did run: 1000 images in batches of 128 are 8 steps an epoch; every step but the first (which
  // makes the optimizer's state) overlaps, the eager partial batch included.
  EXPECT_TRUE(contains(on.output, "update beside the backward: 15 of 16 steps")) << on.output;
  const RunResult off = run_vgg(dir, common + "--overlap-update off");
  ASSERT_EQ(off.code, 0) << off.output;
  ASSERT_NE(checksum_of(off), "") << off.output;
  EXPECT_EQ(checksum_of(on), checksum_of(off)) << "overlap on:\n"
                                               << on.output << "\noverlap off:\n"
                                               << off.output;
  const RunResult clip = run_vgg(dir, common + "--overlap-update on --clip-grad 1");
  EXPECT_EQ(clip.code, 2) << clip.output;
  EXPECT_TRUE(contains(clip.output, "cannot be used with --clip-grad")) << clip.output;
}

TEST(VggTrainerGpu, OverlappedUpdateMatchesOneUpdateOnOneGpu) {
  CUDP_REQUIRE_TENSOR_CORES();
  CUDP_REQUIRE_VGG();
  expect_overlapped_update_matches("0");
}

TEST(VggTrainerGpu, OverlappedUpdateMatchesOneUpdateOnTwoGpus) {
  CUDP_REQUIRE_GPUS(2);
  CUDP_REQUIRE_TENSOR_CORES();
  CUDP_REQUIRE_VGG();
  expect_overlapped_update_matches("0,1");
}

TEST(VggTrainerGpu, ResumeIsBitIdenticalOnOneGpu) {
  CUDP_REQUIRE_GPU();
  CUDP_REQUIRE_VGG();
  expect_exact_resume("0", "constant", 1);
}

TEST(VggTrainerGpu, InterruptedOneCycleRunResumesBitIdenticallyOnOneGpu) {
  CUDP_REQUIRE_GPU();
  CUDP_REQUIRE_VGG();
  expect_exact_resume("0", "onecycle", 1);
}

// Cosine takes its base rate from the optimizer: a resume must not start it from the checkpoint's
// last rate.
TEST(VggTrainerGpu, InterruptedCosineRunResumesBitIdenticallyOnOneGpu) {
  CUDP_REQUIRE_GPU();
  CUDP_REQUIRE_VGG();
  expect_exact_resume("0", "cosine", 1);
}

// bf16 products on tensor cores: deterministic, resumed bit for bit, replicas bit-identical.
TEST(VggTrainerGpu, Bf16ResumeIsBitIdenticalOnOneGpu) {
  CUDP_REQUIRE_TENSOR_CORES();
  CUDP_REQUIRE_VGG();
  expect_exact_resume("0", "constant", 1, "bf16");
}

// tf32 products on tensor cores (every convolution's and linear layer's forward, backward-data and
// backward-weight): trains, is deterministic, resumes bit for bit, and the checkpoint keeps the
// policy (the evaluation in expect_exact_resume takes it from there).
TEST(VggTrainerGpu, Tf32ResumeIsBitIdenticalOnOneGpu) {
  CUDP_REQUIRE_TENSOR_CORES();
  CUDP_REQUIRE_VGG();
  expect_exact_resume("0", "constant", 1, "tf32");
}

// A tiny tf32 run trains: its loss falls like fp32's, its weights are not fp32's (the products ran
// on the tensor cores), and its checkpoint records tf32.
TEST(VggTrainerGpu, Tf32TrainsATinyRun) {
  CUDP_REQUIRE_TENSOR_CORES();
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string common =
      "--data synthetic --arch vgg11 --limit-train 1024 --limit-test 256 --batch-size 128 "
      "--epochs 3 --schedule constant --lr 0.02 --print-checksum --gpus 0 ";
  const RunResult fp32 = run_vgg(dir, common + "--precision fp32");
  ASSERT_EQ(fp32.code, 0) << fp32.output;
  const std::string ckpt = dir / "tf32.safetensors";
  const RunResult tf32 = run_vgg(dir, common + "--precision tf32 --checkpoint '" + ckpt + "'");
  ASSERT_EQ(tf32.code, 0) << tf32.output;
  EXPECT_TRUE(contains(tf32.output, "tf32 products, on GPUs 0")) << tf32.output;
  ASSERT_NE(checksum_of(tf32), "") << tf32.output;
  EXPECT_NE(checksum_of(tf32), checksum_of(fp32)) << "tf32 trained the same weights as fp32";
  EXPECT_EQ(cudp::load_checkpoint_metadata(ckpt).at("precision"), "tf32");
  auto epoch_loss = [](const RunResult& r, int epoch) {
    std::smatch m;
    EXPECT_TRUE(std::regex_search(
        r.output, m, std::regex("epoch " + std::to_string(epoch) + "/3: train loss ([0-9.]+)")))
        << r.output;
    return m.empty() ? -1.0 : std::stod(m[1]);
  };
  EXPECT_LT(epoch_loss(tf32, 3), epoch_loss(tf32, 1)) << tf32.output;
  EXPECT_LT(epoch_loss(fp32, 3), epoch_loss(fp32, 1)) << fp32.output;
}

TEST(VggTrainerGpu, Bf16ResumeIsBitIdenticalOnTwoGpus) {
  CUDP_REQUIRE_GPUS(2);
  CUDP_REQUIRE_TENSOR_CORES();
  CUDP_REQUIRE_VGG();
  expect_exact_resume("0,1", "onecycle", 2, "bf16");
}

TEST(VggTrainerGpu, ResumeIsBitIdenticalOnTwoGpus) {
  CUDP_REQUIRE_GPUS(2);
  CUDP_REQUIRE_VGG();
  expect_exact_resume("0,1", "constant", 2);
}

TEST(VggTrainerGpu, InterruptedOneCycleRunResumesBitIdenticallyOnTwoGpus) {
  CUDP_REQUIRE_GPUS(2);
  CUDP_REQUIRE_VGG();
  expect_exact_resume("0,1", "onecycle", 2);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(VggTrainerGpu, DivergenceStopsAndKeepsTheCheckpoint) {
  CUDP_REQUIRE_GPU();
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string common =
      "--data synthetic --arch vgg11 --limit-train 512 --limit-test 128 --batch-size 64 "
      "--schedule constant --gpus 0 ";
  const std::string ckpt = dir / "c.safetensors";
  RunResult r = run_vgg(dir, common + "--epochs 1 --lr 0.01 --checkpoint '" + ckpt + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string model = read_bytes(ckpt), state = read_bytes(dir / "c.train.safetensors");
  r = run_vgg(dir, "--resume '" + ckpt + "' --epochs 3 --lr 1e30 --gpus 0");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(training diverged at step \d+ \(epoch 2, )"
                                                     R"(batch \d+ of 8\): the (loss|gradient norm))")))
      << r.output;
  EXPECT_TRUE(contains(r.output, "the last good checkpoint is " + ckpt)) << r.output;
  EXPECT_TRUE(read_bytes(ckpt) == model) << "the model file changed";
  EXPECT_TRUE(read_bytes(dir / "c.train.safetensors") == state) << "the training state changed";
}

TEST(VggTrainerGpu, RunFolderWithAdamWOnTwoGpus) {
  CUDP_REQUIRE_GPUS(2);
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string out = dir / "run";
  const RunResult r = run_vgg(
      dir, "--data synthetic --arch vgg11 --limit-train 1024 --limit-test 256 --batch-size 128 "
           "--gpus 0,1 --epochs 3 --opt adamw --lr 0.001 --warmup-epochs 1 --schedule cosine "
           "--clip-grad 1 --label-smoothing 0.1 --print-checksum --output '" + out + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "replicas: 2, bit-identical")) << r.output;
  std::ifstream csv(out + "/metrics.csv");
  std::string line;
  std::getline(csv, line);
  int rows = 0;
  while (std::getline(csv, line)) {
    ++rows;
    double epoch = 0, loss = 0, top1 = 0, top5 = 0;
    ASSERT_EQ(std::sscanf(line.c_str(), "%lf,%lf,%lf,%lf", &epoch, &loss, &top1, &top5), 4);
    EXPECT_EQ(epoch, rows);
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        r.output, m, std::regex("epoch " + std::to_string(rows) + "/3: train loss ([0-9.]+)")))
        << r.output;
    EXPECT_NEAR(std::stod(m[1]), loss, 6e-5) << line;
    EXPECT_GE(top5, top1);
  }
  EXPECT_EQ(rows, 3);
  EXPECT_TRUE(std::filesystem::exists(out + "/best.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(out + "/curves.png"));
}

}  // namespace
