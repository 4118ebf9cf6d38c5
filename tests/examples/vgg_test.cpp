// cudp-vgg, the trainer, run as a user runs it (host tests: CI has no GPU).
//
// Each test runs the built program (CUDP_VGG_BINARY, set by tests/CMakeLists.txt) with
// CUDA_VISIBLE_DEVICES="" so that it takes the CPU path on every machine, GPU machines included,
// and checks its exit code and output:
//   - a short synthetic VGG-11 run on the CPU trains one epoch and reports a finite loss and a test
//     accuracy;
//   - a checkpoint round trip: --eval-only --resume (or -e, --evaluate) prints the checksum the
//     training run printed, having read each file of the checkpoint once;
//   - an exact resume on the CPU: 2 epochs straight and 1 + 1 give the same checksum (the GPU test
//     does the same at a larger scale on 1 and 2 GPUs);
//   - the torchvision head at --image-size 64 trains a step, with torchvision's parameter count;
//   - precision policies: bf16 and tf32, emulated on the CPU, train weights of their own,
//     reproducibly, and are remembered by the checkpoint;
//   - refusals: CLI11 usage errors (exit 2), an invalid --gpus
//     id (the message names the valid range, or says no GPU is visible), --eval-only without
//     --resume, a resume with another --seed or --batch-size;
//   - no silent surprises (issue 17): an absent data set asked for is an error, every output path
//     is checked before training, a resume keeps the checkpoint path and --limit-test, messages in
//     words and without source paths, one exit-code convention, the epoch's mean loss, the JSON
//     log's epochs from 1;
//   - the divergence guard and hostile settings (issue 16): an absurd learning rate ends with the
//     named error and the checkpoint untouched; damaged checkpoint metadata, --seed and
//     --stop-after out of range end in clean messages;
//   - the run folder (--output): metrics.csv, curves.png, last and best checkpoints, and a resume
//     that continues in it.
#include <gtest/gtest.h>
#include <sys/inotify.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/image_folder.h"
#include "engine/core/device.h"
#include "examples/image_files.h"
#include "examples/run_binary.h"
#include "layers/checkpoint.h"
#include "layers/safetensors.h"

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

// The "test loss L, test accuracy A%" of a run's output, or "" if it printed none.
std::string test_result(const RunResult& r) {
  std::smatch m;
  if (std::regex_search(r.output, m, std::regex(R"(test loss \S+, test accuracy \S+%)")))
    return m[0];
  return "";
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
  // -e and --evaluate (the spellings of PyTorch's ImageNet example) are --eval-only: the same
  // evaluation of the same weights, and no training.
  for (const std::string alias : {"-e", "--evaluate"}) {
    const RunResult e =
        run_on_cpu(dir, base + alias + " --resume '" + (dir / "a.safetensors") + "'");
    ASSERT_EQ(e.code, 0) << alias << ": " << e.output;
    EXPECT_EQ(checksum_of(e), sum_a) << alias << ": " << e.output;
    EXPECT_EQ(test_result(e), test_result(eval)) << alias << ": " << e.output;
    EXPECT_FALSE(contains(e.output, "step 1/")) << alias << ": " << e.output;
  }

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
  // b2 gave no --checkpoint: it kept the checkpoint's own path and saved epoch 2 there.
  EXPECT_EQ(cudp::load_checkpoint_metadata(dir / "b.safetensors").at("epoch"), "2") << b2.output;

  // A resume that would be another run is refused; settings left out come from the checkpoint.
  const std::string ckpt = "--resume '" + (dir / "b.safetensors") + "' ";
  RunResult r = run_on_cpu(dir, base + ckpt + "--seed 7");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "written with --seed 0, this run has --seed 7")) << r.output;
  r = run_on_cpu(dir, kSmall + "--limit-test 16 --batch-size 32 " + ckpt);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--batch-size 16, this run has --batch-size 32")) << r.output;
  // data, arch, --limit-train, --limit-test, --batch-size, --seed: taken from the checkpoint
  r = run_on_cpu(dir, "--eval-only --print-checksum " + ckpt);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "vgg11-bn")) << r.output;
  EXPECT_TRUE(contains(r.output, "first 32 of 10000 train images")) << r.output;
  EXPECT_TRUE(contains(r.output, "first 16 of 2000 test images")) << r.output;
}

// --precision bf16 and tf32 on the CPU emulate the GPU's operand rounding (layers/precision.h:
// bf16's rounding to nearest even, TF32's truncation): each trains, says so, gives other weights
// than fp32 and than each other, and the checkpoint remembers it; a second tf32 run gives its
// weights bit for bit.
TEST(VggTrainer, PrecisionPolicies) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string run = kSmall + "--limit-train 32 --limit-test 16 --batch-size 16 --epochs 1 "
                                   "--print-checksum ";
  const RunResult fp32 = run_on_cpu(dir, run);
  ASSERT_EQ(fp32.code, 0) << fp32.output;
  EXPECT_TRUE(contains(fp32.output, "fp32 products")) << fp32.output;
  const RunResult bf16 = run_on_cpu(
      dir, run + "--precision bf16 --checkpoint '" + (dir / "bf16.safetensors") + "'");
  ASSERT_EQ(bf16.code, 0) << bf16.output;
  EXPECT_TRUE(contains(bf16.output, "bf16 products (emulated on the CPU)")) << bf16.output;
  EXPECT_NE(checksum_of(bf16), "");
  EXPECT_NE(checksum_of(bf16), checksum_of(fp32)) << "bf16 trained the same weights as fp32";
  EXPECT_EQ(cudp::load_checkpoint_metadata(dir / "bf16.safetensors").at("precision"), "bf16");
  const RunResult eval = run_on_cpu(
      dir, "--eval-only --print-checksum --resume '" + (dir / "bf16.safetensors") + "'");
  ASSERT_EQ(eval.code, 0) << eval.output;
  EXPECT_TRUE(contains(eval.output, "bf16 products")) << eval.output;

  const RunResult tf32 =
      run_on_cpu(dir, run + "--precision tf32 --checkpoint '" + (dir / "tf32.safetensors") + "'");
  ASSERT_EQ(tf32.code, 0) << tf32.output;
  EXPECT_TRUE(contains(tf32.output,
                       "tf32 products (emulated on the CPU: operands truncated to TF32, fp32 "
                       "arithmetic)"))
      << tf32.output;
  EXPECT_NE(checksum_of(tf32), "");
  EXPECT_NE(checksum_of(tf32), checksum_of(fp32)) << "tf32 trained the same weights as fp32";
  EXPECT_NE(checksum_of(tf32), checksum_of(bf16)) << "tf32 trained the same weights as bf16";
  const RunResult tf32_again = run_on_cpu(dir, run + "--precision tf32");
  ASSERT_EQ(tf32_again.code, 0) << tf32_again.output;
  EXPECT_EQ(checksum_of(tf32_again), checksum_of(tf32)) << tf32_again.output;
  EXPECT_EQ(cudp::load_checkpoint_metadata(dir / "tf32.safetensors").at("precision"), "tf32");
  const RunResult tf32_eval =
      run_on_cpu(dir, "--eval-only --print-checksum --resume '" + (dir / "tf32.safetensors") + "'");
  ASSERT_EQ(tf32_eval.code, 0) << tf32_eval.output;
  EXPECT_TRUE(contains(tf32_eval.output, "tf32 products")) << tf32_eval.output;
  EXPECT_EQ(checksum_of(tf32_eval), checksum_of(tf32)) << tf32_eval.output;
}

TEST(VggTrainer, UsageErrors) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  // A usage error: exit 2, one code for all of them (CLI11's own were 105, 109, ...), with a
  // message that says `says`.
  const auto refused = [&](const std::string& args, const std::string& says) {
    const RunResult r = run_on_cpu(dir, args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, says)) << args << "\n" << r.output;
  };
  refused("--no-such-option", "no-such-option");
  refused("--arch vgg99", "--arch: must be one of vgg11, vgg13, vgg16, vgg19");
  refused("--graphs maybe", "--graphs: must be one of on, off");
  refused("--fused-grad-norm maybe", "--fused-grad-norm: must be one of on, off");
  refused("--overlap-update maybe", "--overlap-update: must be one of on, off");
  // Asked for where it cannot run: refused, not left off.
  refused("--data synthetic --limit-train 64 --limit-test 32 --overlap-update on",
          "--overlap-update on needs GPUs");
  refused("--batch-size 0", "--batch-size");
  refused("--epochs many", "--epochs");
  refused("--gpus x", "\"x\" is not a device id");
  RunResult r = run_on_cpu(dir, "--help");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--limit-train")) << r.output;
  EXPECT_TRUE(contains(r.output, "--print-checksum")) << r.output;
  // The exit codes are documented, and --bn's default reads sanely (not "--bn,--no-bn{false}").
  EXPECT_TRUE(contains(r.output, "Exit status: 0 success; 1 ")) << r.output;
  EXPECT_TRUE(contains(r.output, "2 the command line is wrong")) << r.output;
  EXPECT_FALSE(contains(r.output, "{false}")) << r.output;
  EXPECT_TRUE(contains(r.output, "BatchNorm after every convolution (the default)")) << r.output;
  refused("--bn --no-bn --data synthetic", "--bn and --no-bn contradict each other");
  // Given twice, the last value counts (argparse's rule): batch 4, which 8 micro-batches exceed.
  refused("--data synthetic --batch-size 0 --batch-size 4 --accumulate 8",
          "--accumulate 8 splits each batch of --batch-size 4");
  refused("--gpus ''", "--gpus is empty");
  // An empty path is an unset shell variable, not "no output": refused, not taken as left out.
  for (const char* option : {"--output", "--checkpoint", "--data-dir", "--json", "--resume"}) {
    refused(std::string("--data synthetic ") + option + " ''",
            std::string(option) + ": is empty; give a path, or leave " + option + " out");
  }
  // Options that would be ignored are refused, as --overlap-update on above.
  refused("--data synthetic --limit-train 64 --limit-test 32 --graphs on",
          "--graphs on needs GPUs");
  refused("--data synthetic --data-dir '" + (dir / "data") + "'",
          "--data synthetic generates its images and reads no files");
}

// --sync-bn converts the model's BatchNorm layers; without a group of several devices they are
// BatchNorm2d bit for bit (here: the CPU), and a checkpoint's keys do not change.
TEST(VggTrainer, SyncBatchNormOnOneDeviceIsBatchNorm) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string run = kSmall +
                          "--limit-train 16 --limit-test 8 --batch-size 8 --epochs 1 "
                          "--print-checksum ";
  const RunResult plain = run_on_cpu(dir, run);
  ASSERT_EQ(plain.code, 0) << plain.output;
  const RunResult sync = run_on_cpu(dir, run + "--sync-bn");
  ASSERT_EQ(sync.code, 0) << sync.output;
  EXPECT_TRUE(contains(sync.output,
                       "SyncBatchNorm: training normalises with the statistics of "
                       "the whole batch (one device: the same as BatchNorm)"))
      << sync.output;
  EXPECT_NE(checksum_of(sync), "");
  EXPECT_EQ(checksum_of(sync), checksum_of(plain));
  const RunResult both = run_on_cpu(dir, kSmall + "--sync-bn --no-bn");
  EXPECT_EQ(both.code, 2) << both.output;
  EXPECT_TRUE(contains(both.output,
                       "--sync-bn synchronises the BatchNorm layers and --no-bn "
                       "leaves none"))
      << both.output;
}

// --fused-grad-norm on (the default) against off on the CPU: the same weights and logged norms bit
// for bit. One process on the CPU keeps its parameters unflattened, so the fused sum does not run
// there: "on" takes the norm in a pass of its own after the update (what this compares with "off",
// a pass before it), and the run says so. The fused sum itself is compared on GPUs
// (vgg_gpu_test's FusedGradNormMatchesItsOwnPass*).
TEST(VggTrainer, GradNormAfterTheUpdateMatchesTheOneBeforeOnTheCpu) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string run = kSmall +
                          "--limit-train 16 --limit-test 8 --batch-size 8 --epochs 1 "
                          "--print-freq 1 --print-checksum ";
  const std::vector<std::string> norms = expect_fused_grad_norm_matches_its_own_pass(
      dir, run, "CUDA_VISIBLE_DEVICES= ", "gradient norm: a pass of its own after the update");
  EXPECT_EQ(norms.size(), 2u);
}

// Validators say what is wrong in words: "--lr 0" once printed the smallest double in 300 digits.
TEST(VggTrainer, ValidatorMessagesAreWords) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  RunResult r = run_on_cpu(dir, "--lr 0");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--lr: must be a number greater than 0 (got \"0\")")) << r.output;
  EXPECT_FALSE(std::regex_search(r.output, std::regex("[0-9]{20}"))) << r.output;
  r = run_on_cpu(dir, "--momentum 2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--momentum: must be a number from 0 to 0.999")) << r.output;
  EXPECT_FALSE(std::regex_search(r.output, std::regex("[0-9]{20}"))) << r.output;
  r = run_on_cpu(dir, "--weight-decay -1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--weight-decay: must be a number at least 0")) << r.output;
}

// Issue 16: --seed -1 and --seed 2^64 both became 2^64-1; --stop-after past --epochs was accepted.
TEST(VggTrainer, CommandLineRangesAreChecked) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  for (const std::string seed : {"-1", "18446744073709551616", "1e3", "x"}) {
    const RunResult r = run_on_cpu(dir, "--data synthetic --seed " + seed);
    EXPECT_EQ(r.code, 2) << seed << ": " << r.output;
    EXPECT_TRUE(contains(r.output, "--seed: must be a whole number from 0 to 18446744073709551615"))
        << r.output;
  }
  RunResult r = run_on_cpu(dir, "--data synthetic --epochs 2 --stop-after 3");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--stop-after 3 is more than --epochs 2")) << r.output;
  r = run_on_cpu(dir, "--data synthetic --image-size 48");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "not a multiple of 32")) << r.output;
  r = run_on_cpu(dir, "--data synthetic --schedule onecycle --warmup-epochs 1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "onecycle warms up by itself")) << r.output;
}

// A test split of no images gave "test accuracy 0.00%" every epoch and chose the best checkpoint
// by it: refused, naming the data set.
TEST(VggTrainer, EmptyTestSplitIsAnError) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  // Raw IDX files (big-endian header words): 2 train images of 28x28, and a test split of none.
  const auto write = [&](const std::string& name, std::vector<uint32_t> header, size_t bytes) {
    std::ofstream out(dir / name, std::ios::binary);
    for (uint32_t w : header) {
      const char be[4] = {static_cast<char>(w >> 24), static_cast<char>(w >> 16),
                          static_cast<char>(w >> 8), static_cast<char>(w)};
      out.write(be, 4);
    }
    out << std::string(bytes, '\x01');
  };
  write("train-images-idx3-ubyte", {2051, 2, 28, 28}, 2 * 28 * 28);
  write("train-labels-idx1-ubyte", {2049, 2}, 2);
  write("t10k-images-idx3-ubyte", {2051, 0, 28, 28}, 0);
  write("t10k-labels-idx1-ubyte", {2049, 0}, 0);
  const RunResult r = run_on_cpu(dir, "--data fashion-mnist --data-dir '" + (dir / "") + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "the test split holds no images")) << r.output;
  EXPECT_FALSE(contains(r.output, "test accuracy")) << r.output;
}

// Issue 17: "--data mnist" with the files absent trained on synthetic data and exited 0.
TEST(VggTrainer, AbsentDataSetIsAnError) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  RunResult r = run_on_cpu(dir, "--data mnist --data-dir '" + (dir / "nothing-here") + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "nothing-here does not exist")) << r.output;
  EXPECT_TRUE(contains(r.output, "--data synthetic")) << r.output;
  EXPECT_FALSE(contains(r.output, "synthetic (")) << "trained on generated data:\n" << r.output;
  { std::ofstream(dir / "a-file") << "x"; }
  r = run_on_cpu(dir, "--data mnist --data-dir '" + (dir / "a-file") + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "a-file is a file")) << r.output;
  if (!std::filesystem::exists("/usr/share/datasets/mnist")) {
    r = run_on_cpu(dir, "--data mnist");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_TRUE(contains(r.output, "/usr/share/datasets/mnist does not exist")) << r.output;
    EXPECT_FALSE(contains(r.output, "epoch 1/")) << r.output;
  }
}

// Issue 17: --json to an unwritable path wrote nothing and exited 0; a bad --checkpoint path failed
// only after the first epoch. Every output is checked before training: no epoch runs.
TEST(VggTrainer, OutputPathsAreCheckedBeforeTraining) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string run = kSmall + "--epochs 1 --limit-train 16 --limit-test 8 --batch-size 8 ";
  const std::string missing = dir / "no-such-folder";
  RunResult r = run_on_cpu(dir, run + "--json '" + missing + "/log.json'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "--json " + missing + "/log.json: the folder " + missing +
                                     " does not exist"))
      << r.output;
  EXPECT_FALSE(contains(r.output, "epoch 1/")) << r.output;
  r = run_on_cpu(dir, run + "--checkpoint '" + missing + "/c.safetensors'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "--checkpoint " + missing + "/c.safetensors")) << r.output;
  EXPECT_FALSE(contains(r.output, "epoch 1/")) << r.output;
  r = run_on_cpu(dir, run + "--checkpoint '" + (dir / "") + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "is a folder")) << r.output;
  // A FIFO where a file is expected: refused at once, not a hang.
  const std::string fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  r = run_on_cpu(dir, run + "--json '" + fifo + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "is not a regular file")) << r.output;
  // A file where the run folder should be.
  { std::ofstream(dir / "plain") << "x"; }
  r = run_on_cpu(dir, run + "--output '" + (dir / "plain") + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "is not a folder")) << r.output;
  EXPECT_FALSE(contains(r.output, "epoch 1/")) << r.output;
}

// Errors print what went wrong without our source paths ("... (at layers/safetensors.cpp:76)");
// --verbose adds them.
TEST(VggTrainer, MessagesCarryNoSourcePaths) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  for (const char* name : {"junk.safetensors", "junk.train.safetensors"}) {
    std::ofstream(dir / name) << "this is not a safetensors file";
  }
  const std::string args = "--data synthetic --resume '" + (dir / "junk.safetensors") + "'";
  RunResult r = run_on_cpu(dir, args);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "junk")) << r.output;
  EXPECT_FALSE(std::regex_search(r.output, std::regex(R"(\.(cpp|cu|h):[0-9]+)"))) << r.output;
  r = run_on_cpu(dir, args + " --verbose");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(\.(cpp|cu|h):[0-9]+)"))) << r.output;
}

// cudp-devices --help printed the devices instead of its usage.
TEST(VggTrainer, DevicesHelp) {
  CUDP_REQUIRE_VGG();
  const std::string devices =
      (std::filesystem::path(cudp::testing::kVgg).parent_path() / "cudp-devices").string();
  if (!std::filesystem::exists(devices)) GTEST_SKIP() << devices << " is not built";
  TempDir dir;
  const std::string log = dir / "out.txt";
  int status = std::system(("'" + devices + "' --help > '" + log + "' 2>&1").c_str());
  std::stringstream out;
  out << std::ifstream(log).rdbuf();
  EXPECT_EQ(WEXITSTATUS(status), 0) << out.str();
  EXPECT_TRUE(contains(out.str(), "Usage: cudp-devices")) << out.str();
  EXPECT_FALSE(contains(out.str(), "CUDA device(s)")) << out.str();
  status = std::system(("'" + devices + "' --bogus > '" + log + "' 2>&1").c_str());
  EXPECT_EQ(WEXITSTATUS(status), 2);
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

// --image-size 64 --head torchvision: torchvision's VGG at 64x64 (AdaptiveAvgPool2d(7, 7), then
// 25088-4096-4096-N) trains a step on the CPU. Its size is torchvision's: vgg11_bn() has
// 132,868,840 parameters for 1000 classes; for 10, 990 * (4096 + 1) fewer. The compact head is
// refused there.
TEST(VggTrainer, TorchvisionHeadAt64Pixels) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string run = kSmall +
                          "--image-size 64 --epochs 1 --limit-train 2 --limit-test 2 "
                          "--batch-size 2 ";
  const RunResult r = run_on_cpu(dir, run + "--head torchvision");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "data: synthetic (64x64x3, 10 classes)")) << r.output;
  EXPECT_TRUE(contains(r.output, "model: vgg11-bn (torchvision head, 64x64 input), " +
                                     std::to_string(132868840 - 990 * 4097) + " parameters"))
      << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(epoch 1/1: train loss (\S+),)")))
      << r.output;
  EXPECT_TRUE(std::isfinite(std::stod(m[1]))) << r.output;
  EXPECT_NE(test_result(r), "") << r.output;

  const RunResult compact = run_on_cpu(dir, run + "--head compact");
  EXPECT_EQ(compact.code, 2) << compact.output;
  EXPECT_TRUE(contains(compact.output, "--head compact needs 32x32 inputs, not --image-size 64"))
      << compact.output;
}

TEST(VggTrainer, EvalOnlyNeedsResume) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const RunResult r = run_on_cpu(dir, "--data synthetic --eval-only");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--eval-only needs --resume")) << r.output;
}

// -e of a file of weights alone (a state dict as PyTorch saves it, no training state beside it)
// evaluates it with the command line's settings: the training run's own weights and test result.
// Training from it is refused as before (a resume needs the training state), and settings that do
// not fit the weights are refused naming the tensors and what to give.
TEST(VggTrainer, EvaluatesAFileOfWeightsAlone) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string base = kSmall + "--limit-train 16 --limit-test 8 --batch-size 8 ";
  const std::string ckpt = dir / "c.safetensors", weights = dir / "weights.safetensors";
  const RunResult trained =
      run_on_cpu(dir, base + "--epochs 1 --print-checksum --checkpoint '" + ckpt + "'");
  ASSERT_EQ(trained.code, 0) << trained.output;
  cudp::save_safetensors(weights, cudp::load_safetensors(ckpt).tensors, {{"format", "pt"}});

  RunResult r = run_on_cpu(dir, base + "--print-checksum -e --resume '" + weights + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "evaluating the weights in " + weights)) << r.output;
  EXPECT_NE(checksum_of(r), "") << r.output;
  EXPECT_EQ(checksum_of(r), checksum_of(trained)) << r.output;
  EXPECT_NE(test_result(r), "") << r.output;
  EXPECT_EQ(test_result(r), test_result(trained)) << r.output;

  r = run_on_cpu(dir, base + "--epochs 2 --resume '" + weights + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "weights.train.safetensors' does not exist")) << r.output;
  EXPECT_FALSE(contains(r.output, "epoch 1/2")) << r.output;

  r = run_on_cpu(dir, base + "--arch vgg13 -e --resume '" + weights + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "'features.")) << r.output;
  EXPECT_TRUE(contains(r.output, "records no settings: give the --arch")) << r.output;
  EXPECT_FALSE(contains(r.output, "test accuracy")) << r.output;
}

// Weights holding a NaN or an infinity (a diverged run's) are refused when they are read, for an
// evaluation and for a resume, naming the file, the tensor and the element; nothing is evaluated
// or trained.
TEST(VggTrainer, NonFiniteWeightsAreRefusedWhenLoaded) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string base = kSmall + "--limit-train 16 --limit-test 8 --batch-size 8 ";
  const std::string ckpt = dir / "c.safetensors";
  const RunResult trained = run_on_cpu(dir, base + "--epochs 1 --checkpoint '" + ckpt + "'");
  ASSERT_EQ(trained.code, 0) << trained.output;
  const cudp::SafetensorsFile model = cudp::load_safetensors(ckpt);
  const auto save_with = [&](const std::string& path, const std::string& name, int64_t element,
                             float value, const cudp::Metadata& metadata) {
    cudp::TensorMap tensors;
    for (const auto& [key, t] : model.tensors) tensors.emplace(key, t.clone());
    tensors.at(name).data<float>()[element] = value;
    cudp::save_safetensors(path, tensors, metadata);
  };

  // The checkpoint (the same id: still a pair) with an infinite BatchNorm variance.
  save_with(ckpt, "features.1.running_var", 3, INFINITY, model.metadata);
  const std::string says = "checkpoint file '" + ckpt +
                           "': tensor 'features.1.running_var' holds NaN/Inf values (element 3 "
                           "is inf); the run that saved it had diverged";
  for (const std::string args : {"--epochs 2 --resume", "-e --resume"}) {
    const RunResult r = run_on_cpu(dir, args + " '" + ckpt + "'");
    EXPECT_EQ(r.code, 1) << args << ": " << r.output;
    EXPECT_TRUE(contains(r.output, says)) << args << ": " << r.output;
    EXPECT_TRUE(contains(r.output, "earlier checkpoint")) << args << ": " << r.output;
    EXPECT_FALSE(contains(r.output, "epoch 2/2")) << args << ": " << r.output;
    EXPECT_FALSE(contains(r.output, "test accuracy")) << args << ": " << r.output;
  }

  // A file of weights alone with a NaN weight.
  const std::string weights = dir / "weights.safetensors";
  save_with(weights, "features.0.weight", 5, NAN, {{"format", "pt"}});
  const RunResult r = run_on_cpu(dir, base + "-e --resume '" + weights + "'");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "checkpoint file '" + weights +
                                     "': tensor 'features.0.weight' holds NaN/Inf values "
                                     "(element 5 is NaN)"))
      << r.output;
  EXPECT_FALSE(contains(r.output, "test accuracy")) << r.output;
}

// How many times each file in `folder` was opened, by any process, while `run` ran (inotify, so
// the trainer's opens are seen), or nothing where inotify is unavailable or lost events. Closes
// are watched too, though not counted: inotify merges an event into an identical one still
// unread, so two opens in a row with nothing between them would count as one.
std::optional<std::map<std::string, int>> opens_during(const std::string& folder,
                                                       const std::function<void()>& run) {
  const int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (fd < 0) return std::nullopt;
  if (inotify_add_watch(fd, folder.c_str(), IN_OPEN | IN_CLOSE) < 0) {
    ::close(fd);
    return std::nullopt;
  }
  run();
  std::map<std::string, int> opens;
  bool overflow = false;
  alignas(inotify_event) char buffer[4096];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) {
    for (ssize_t at = 0; at < n;) {
      const auto* event = reinterpret_cast<const inotify_event*>(buffer + at);
      overflow |= (event->mask & IN_Q_OVERFLOW) != 0;
      if ((event->mask & IN_OPEN) != 0 && event->len > 0) ++opens[event->name];
      at += static_cast<ssize_t>(sizeof(inotify_event) + event->len);
    }
  }
  ::close(fd);
  if (overflow) return std::nullopt;
  return opens;
}

// A resume reads each file of the checkpoint once: the model, before it moves to the GPUs, and
// the model with the optimizer, after, come from the same read (the model file was read, and
// scanned for NaN, twice). Counted against a resume refused once the settings are read: both runs
// look at the headers alike (which save, what settings), so the evaluation opens each file exactly
// once more, to read its tensors.
TEST(VggTrainer, AResumeReadsTheCheckpointOnce) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string base = kSmall + "--limit-train 16 --limit-test 8 --batch-size 8 ";
  const std::string ckpt = dir / "c.safetensors";
  const RunResult trained = run_on_cpu(dir, base + "--epochs 1 --checkpoint '" + ckpt + "'");
  ASSERT_EQ(trained.code, 0) << trained.output;

  RunResult refused, evaluated;
  const auto headers = opens_during(
      dir / ".", [&] { refused = run_on_cpu(dir, "--epochs 2 --seed 7 --resume '" + ckpt + "'"); });
  const auto loaded =
      opens_during(dir / ".", [&] { evaluated = run_on_cpu(dir, "-e --resume '" + ckpt + "'"); });
  if (!headers || !loaded) GTEST_SKIP() << "inotify is not available here";
  ASSERT_EQ(refused.code, 2) << refused.output;
  ASSERT_EQ(evaluated.code, 0) << evaluated.output;
  ASSERT_TRUE(contains(evaluated.output, "resumed from")) << evaluated.output;
  for (const std::string file : {"c.safetensors", "c.train.safetensors"}) {
    const int before = headers->count(file) ? headers->at(file) : 0;
    const int after = loaded->count(file) ? loaded->at(file) : 0;
    EXPECT_EQ(after, before + 1) << file << " opened " << before << " times by the refused resume, "
                                 << after << " by the evaluation";
  }
}

TEST(VggTrainer, MissingCheckpointIsAnError) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const RunResult r =
      run_on_cpu(dir, "--data synthetic --resume '" + (dir / "absent.safetensors") + "'");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "absent")) << r.output;
}

std::string read_text(const std::string& path) {
  std::stringstream ss;
  ss << std::ifstream(path, std::ios::binary).rdbuf();
  return ss.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream ss(text);
  for (std::string line; std::getline(ss, line);) lines.push_back(line);
  return lines;
}

// The PNG's chunks checked against the format (signature, IHDR, CRC-32 of every chunk computed
// here, independently of the writer's zlib), returning width and height.
std::pair<uint32_t, uint32_t> check_png(const std::string& png) {
  const auto u32 = [&](size_t at) {
    return (uint32_t(uint8_t(png.at(at))) << 24) | (uint32_t(uint8_t(png.at(at + 1))) << 16) |
           (uint32_t(uint8_t(png.at(at + 2))) << 8) | uint32_t(uint8_t(png.at(at + 3)));
  };
  const auto crc32 = [](const std::string& bytes) {
    uint32_t c = 0xffffffffu;
    for (char ch : bytes) {
      c ^= uint8_t(ch);
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return c ^ 0xffffffffu;
  };
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  std::vector<std::string> types;
  uint32_t width = 0, height = 0;
  size_t idat = 0;
  for (size_t at = 8; at + 12 <= png.size();) {
    const uint32_t length = u32(at);
    const std::string type = png.substr(at + 4, 4);
    EXPECT_EQ(crc32(png.substr(at + 4, 4 + length)), u32(at + 8 + length)) << type;
    if (type == "IHDR") {
      width = u32(at + 8);
      height = u32(at + 12);
      EXPECT_EQ(png.substr(at + 16, 5), std::string("\x08\x02\x00\x00\x00", 5));  // 8-bit RGB
    }
    if (type == "IDAT") idat += length;
    types.push_back(type);
    at += 12 + length;
  }
  EXPECT_EQ(types.front(), "IHDR");
  EXPECT_EQ(types.back(), "IEND");
  EXPECT_GT(idat, 100u);
  return {width, height};
}

// --output: the run folder (command line, settings, metrics.csv with epochs from 1, curves.png,
// last and best checkpoints), the JSON log (epochs from 1, train accuracy, learning rate), the
// epoch's train loss as the mean of its steps, and a resume that continues in the same folder
// with --json and --output taken from the checkpoint.
TEST(VggTrainer, RunFolderMetricsAndResumeInPlace) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string out = dir / "run", json = dir / "log.json";
  const std::string small = kSmall + "--limit-train 16 --limit-test 8 --batch-size 8 ";
  RunResult r = run_on_cpu(dir, small + "--epochs 2 --stop-after 1 --print-freq 1 --output '" +
                                    out + "' --json '" + json + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* name : {"command.txt", "settings.txt", "metrics.csv", "curves.png",
                           "last.safetensors", "last.train.safetensors", "best.safetensors"}) {
    EXPECT_TRUE(std::filesystem::exists(out + "/" + name)) << name << "\n" << r.output;
  }
  EXPECT_TRUE(contains(read_text(out + "/command.txt"), "--stop-after 1")) << r.output;
  const std::string settings = read_text(out + "/settings.txt");
  EXPECT_TRUE(contains(settings, "--lr 0.05\n")) << settings;
  EXPECT_TRUE(contains(settings, "--head compact\n")) << settings;
  // As a command line has them: flags bare, unset ones left out.
  EXPECT_TRUE(contains(settings, "\n--bn\n")) << settings;
  EXPECT_FALSE(contains(settings, "--bn 1") || contains(settings, "--augment")) << settings;

  // The JSON log: steps and epochs counted from 1; the epoch's train loss is its steps' mean.
  std::vector<double> step_losses;
  nlohmann::json epoch1;
  for (const std::string& line : lines_of(read_text(json))) {
    const auto j = nlohmann::json::parse(line);
    if (j["event"] == "step") {
      EXPECT_EQ(j["epoch"], 1) << line;
      step_losses.push_back(j["loss"].get<double>());
    } else if (j["event"] == "epoch") {
      epoch1 = j;
    }
  }
  ASSERT_EQ(step_losses.size(), 2u) << read_text(json);
  ASSERT_TRUE(epoch1.is_object()) << read_text(json);
  EXPECT_EQ(epoch1["epoch"], 1);
  EXPECT_TRUE(epoch1.contains("train_accuracy") && epoch1.contains("lr")) << epoch1.dump();
  EXPECT_GT(epoch1["lr"].get<double>(), 0.0);
  const double mean = (step_losses[0] + step_losses[1]) / 2;  // two batches of 8
  EXPECT_NEAR(epoch1["train_loss"].get<double>(), mean, 1e-6) << epoch1.dump();
  EXPECT_NE(step_losses[0], step_losses[1]);  // else the last batch's loss would pass as the mean

  // metrics.csv: the header and a row for epoch 1 that agrees with the log.
  std::vector<std::string> csv = lines_of(read_text(out + "/metrics.csv"));
  ASSERT_EQ(csv.size(), 2u) << read_text(out + "/metrics.csv");
  EXPECT_EQ(csv[0],
            "epoch,train_loss,train_top1,train_top5,test_loss,test_top1,test_top5,lr,img_per_s,"
            "seconds");
  double e = 0, loss = 0, top1 = 0, top5 = 0;
  ASSERT_EQ(std::sscanf(csv[1].c_str(), "%lf,%lf,%lf,%lf", &e, &loss, &top1, &top5), 4) << csv[1];
  EXPECT_EQ(e, 1);
  EXPECT_NEAR(loss, mean, 1e-5);
  EXPECT_NEAR(top1, 100 * epoch1["train_accuracy"].get<double>(), 1e-3);
  EXPECT_GE(top5, top1);
  const auto [w, h] = check_png(read_text(out + "/curves.png"));
  EXPECT_EQ(w, 960u);
  EXPECT_EQ(h, 400u);

  // A refused resume says why in the options' own words, and prints no notes first.
  r = run_on_cpu(dir, "--resume '" + out + "' --no-bn --epochs 3");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "written with --bn, this run has --no-bn")) << r.output;
  EXPECT_FALSE(contains(r.output, "note:")) << r.output;

  // Resume from the folder: --output and --json come from the checkpoint; epoch 2 is added.
  r = run_on_cpu(dir, "--print-freq 1 --resume '" + out + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "epoch 2/2:")) << r.output;
  csv = lines_of(read_text(out + "/metrics.csv"));
  ASSERT_EQ(csv.size(), 3u) << read_text(out + "/metrics.csv");
  EXPECT_EQ(csv[2].substr(0, 2), "2,");
  EXPECT_EQ(cudp::load_checkpoint_metadata(out + "/last.safetensors").at("epoch"), "2");
  EXPECT_TRUE(contains(read_text(json), "\"epoch\":2")) << read_text(json);
  EXPECT_EQ(lines_of(read_text(out + "/command.txt")).size(), 2u);
}

// A run folder resumes where it is now: copied elsewhere, the copy goes on and the original is
// left as it was; the paths a run writes to are recorded absolute, so a resume started from
// another folder does not make a new run folder there.
TEST(VggTrainer, RunFolderResumesWhereItIsNow) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string small = kSmall + "--limit-train 16 --limit-test 8 --batch-size 8 ";
  const std::string in_dir = "cd '" + (dir / "") + "' && CUDA_VISIBLE_DEVICES= ";
  RunResult r = run_vgg(dir, small + "--epochs 2 --stop-after 1 --output run", in_dir);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string run = dir / "run", copy = dir / "copy", other = dir / "other";
  EXPECT_EQ(cudp::load_checkpoint_metadata(run + "/last.safetensors").at("output"),
            std::filesystem::path(run).lexically_normal().string());
  std::filesystem::copy(run, copy, std::filesystem::copy_options::recursive);
  std::filesystem::create_directories(other);
  r = run_vgg(dir, "--resume ../copy", "cd '" + other + "' && CUDA_VISIBLE_DEVICES= ");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "epoch 2/2:")) << r.output;
  EXPECT_EQ(lines_of(read_text(copy + "/metrics.csv")).size(), 3u) << r.output;
  EXPECT_EQ(lines_of(read_text(run + "/metrics.csv")).size(), 2u) << r.output;
  EXPECT_EQ(cudp::load_checkpoint_metadata(copy + "/last.safetensors").at("epoch"), "2");
  EXPECT_EQ(cudp::load_checkpoint_metadata(run + "/last.safetensors").at("epoch"), "1");
  EXPECT_TRUE(std::filesystem::is_empty(other)) << r.output;

  // A damaged last checkpoint: the save before it is used, said once, and named.
  std::filesystem::resize_file(copy + "/last.safetensors", 100);
  r = run_on_cpu(dir, "-e --resume '" + copy + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  size_t warnings = 0;
  for (size_t at = r.output.find("warning:"); at != std::string::npos;
       at = r.output.find("warning:", at + 1)) {
    ++warnings;
  }
  EXPECT_EQ(warnings, 1u) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + copy + "/last.prev.safetensors (the last " +
                                     "complete save at " + copy + "/last.safetensors)"))
      << r.output;
}

// --opt adamw, --warmup-epochs, --schedule cosine, --clip-grad and --label-smoothing wired through:
// the rate of every step against the formulas (linear warm-up over epoch 1's two steps, then cosine
// over the last two), AdamW's state and the settings in the checkpoint, and the gradient norm the
// guard reads in the log. (Label smoothing's values are not checked against PyTorch here.)
TEST(VggTrainer, OptimizerWarmupAndClippingFlags) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string json = dir / "log.json", ckpt = dir / "c.safetensors";
  const RunResult r = run_on_cpu(
      dir, kSmall + "--limit-train 16 --limit-test 8 --batch-size 8 --epochs 2 --opt adamw "
                    "--lr 0.001 --warmup-epochs 1 --schedule cosine --clip-grad 0.5 --label-smoothing 0.1 "
                    "--print-freq 1 --json '" + json + "' --checkpoint '" + ckpt + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<double> rates, norms;
  for (const std::string& line : lines_of(read_text(json))) {
    const auto j = nlohmann::json::parse(line);
    if (j["event"] != "step") continue;
    rates.push_back(j["lr"].get<double>());
    norms.push_back(j["grad_norm"].get<double>());
    EXPECT_TRUE(std::isfinite(j["loss"].get<double>())) << line;
  }
  ASSERT_EQ(rates.size(), 4u) << read_text(json);
  const double pi = std::acos(-1.0);
  const double expected[4] = {0.001 * 1 / 2, 0.001 * 2 / 2, 0.001 * (1 + std::cos(0.0)) / 2,
                              0.001 * (1 + std::cos(pi / 2)) / 2};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(rates[i], expected[i], 1e-12) << "step " << i + 1;
  for (double n : norms) EXPECT_TRUE(std::isfinite(n) && n > 0) << n;
  const cudp::Metadata state =
      cudp::load_safetensors(cudp::find_checkpoint(ckpt).train).metadata;
  EXPECT_EQ(state.at("optimizer.type"), "AdamW");
  EXPECT_EQ(state.at("opt"), "adamw");
  EXPECT_EQ(state.at("weight_decay"), "0.05");  // AdamW's default
  EXPECT_EQ(state.at("clip_grad"), "0.5");
  EXPECT_EQ(state.at("label_smoothing"), "0.1");
}

// --label-smoothing's loss, (1 - e) (lse - x_label) + e (lse - mean x) per sample, computed on the
// host, against the library's cross-entropy kernel: on the same first step (same weights, same
// batch) e = 0.5 must give the mean of e = 0 (the kernel's loss) and e = 1, and e = 1 is at least
// ln(10) (Jensen: lse - mean x >= ln K).
TEST(VggTrainer, LabelSmoothingLoss) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  std::vector<double> first;
  for (const std::string e : {"0", "1", "0.5"}) {
    const std::string json = dir / ("log" + e + ".json");
    const RunResult r = run_on_cpu(dir, kSmall + "--limit-train 8 --limit-test 8 --batch-size 8 "
                                                 "--epochs 1 --print-freq 1 --label-smoothing " +
                                            e + " --json '" + json + "'");
    ASSERT_EQ(r.code, 0) << r.output;
    first.push_back(nlohmann::json::parse(lines_of(read_text(json)).at(0))["loss"].get<double>());
  }
  EXPECT_NEAR(first[2], (first[0] + first[1]) / 2, 2e-6);
  EXPECT_GE(first[1], std::log(10.0) - 1e-6);
  EXPECT_NE(first[0], first[1]);
}

// Issue 16: a diverged run went on and saved NaN weights over the last good checkpoint. Now the
// first non-finite loss stops it with the step, the epoch and the last good checkpoint, and the
// checkpoint stays byte for byte as it was.
TEST(VggTrainer, DivergenceStopsAndKeepsTheCheckpoint) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string small = kSmall +
                            "--limit-train 16 --limit-test 8 --batch-size 8 --schedule constant ";
  const std::string ckpt = dir / "c.safetensors";
  RunResult r = run_on_cpu(dir, small + "--epochs 1 --lr 0.01 --checkpoint '" + ckpt + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string model = read_text(ckpt), state = read_text(dir / "c.train.safetensors");

  // lr 1e30: the first step of epoch 2 is finite, its update is absurd, the next loss is not.
  r = run_on_cpu(dir, "--resume '" + ckpt + "' --epochs 3 --lr 1e30");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex(R"(training diverged at step [34] \(epoch 2, batch [12] of 2\): the )"
                           R"((loss|gradient norm) is (NaN|[+-]inf))")))
      << r.output;
  EXPECT_TRUE(contains(r.output, "the last good checkpoint is " + ckpt + " (after epoch 1")) << r.output;
  EXPECT_FALSE(contains(r.output, "epoch 2/3:")) << r.output;
  EXPECT_TRUE(read_text(ckpt) == model) << "the model file changed";
  EXPECT_TRUE(read_text(dir / "c.train.safetensors") == state) << "the training state changed";

  // skip-step skips the non-finite steps; the BatchNorm statistics their forwards spoilt still keep
  // the checkpoint from being written.
  r = run_on_cpu(dir, "--resume '" + ckpt + "' --epochs 3 --lr 1e30 --on-nan skip-step");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "update skipped (--on-nan skip-step)")) << r.output;
  EXPECT_TRUE(contains(r.output, "no checkpoint was written")) << r.output;
  // The device decided; the host named each skipped step at a read point and took the epoch's
  // count from the optimizer: the two agree.
  std::smatch counted;
  ASSERT_TRUE(std::regex_search(r.output, counted, std::regex(R"(, (\d+) step\(s\) skipped)")))
      << r.output;
  size_t named = 0;
  for (size_t at = 0; (at = r.output.find("; update skipped (--on-nan", at)) != std::string::npos;
       ++at) {
    ++named;
  }
  EXPECT_GE(named, 1u) << r.output;
  EXPECT_EQ(std::to_string(named), counted[1].str()) << r.output;
  EXPECT_TRUE(read_text(ckpt) == model) << "the model file changed";
  EXPECT_TRUE(read_text(dir / "c.train.safetensors") == state) << "the training state changed";

  // Issue 16: damaged metadata in the training state ended in std::terminate (stoi, map::at), and
  // unknown values for the data set or the schedule changed the run silently. Each now ends with a
  // message naming the key and the file, exit 1, before anything trains.
  const cudp::CheckpointFiles files = cudp::find_checkpoint(ckpt);
  const cudp::SafetensorsFile original = cudp::load_safetensors(files.train);
  const auto damaged = [&](const std::string& key, const std::optional<std::string>& value) {
    cudp::Metadata meta = original.metadata;
    if (value) {
      meta[key] = *value;
    } else {
      meta.erase(key);
    }
    cudp::save_safetensors(files.train, original.tensors, meta);
    const RunResult d = run_on_cpu(dir, "--resume '" + ckpt + "' --epochs 3");
    EXPECT_EQ(d.code, 1) << key << ": " << d.output;
    EXPECT_TRUE(contains(d.output, "\"" + key + "\"")) << d.output;
    EXPECT_TRUE(contains(d.output, "c.train.safetensors")) << d.output;
    EXPECT_FALSE(contains(d.output, "epoch 2/3")) << d.output;
  };
  damaged("epoch", "one");
  damaged("epoch", "99999999999999999999");
  damaged("step", "-4");
  damaged("epoch", std::nullopt);
  damaged("schedule", "banana");
  damaged("data", "imagenet");
  damaged("seed", "-1");
  damaged("lr", "nan");
  damaged("dropout_seed.classifier.2", "x");
  damaged("best_test_top1", "ninety");  // was read with strtod, which took it as 0
  damaged("best_test_top1", "inf");
}

// --data folder: an ImageFolder of generated PNGs (and JPEGs where libjpeg-turbo is installed) with
// train/ and val/, trained for an epoch on the CPU with --augment (RandomResizedCrop and flip on
// the loader's workers); --save-test-set writes the test images as the model sees them: the
// evaluation transform of each file, which the test computes itself.
TEST(VggTrainer, TrainsOnAnImageFolder) {
  CUDP_REQUIRE_VGG();
  std::string why;
  if (!cudp::data::png_available(&why)) GTEST_SKIP() << why;
  TempDir dir;
  const std::string root = dir / "images";
  for (const std::string split : {"train", "val"}) {
    for (int c = 0; c < 3; ++c) {
      const std::string folder = root + "/" + split + "/class" + std::to_string(c);
      std::filesystem::create_directories(folder);
      for (int i = 0; i < (split == "train" ? 4 : 2); ++i) {
        std::vector<uint8_t> rgb;
        for (int p = 0; p < 40 * 36; ++p) {
          rgb.insert(rgb.end(), {uint8_t(80 * c + 3 * i), uint8_t(p % 40 * 6), uint8_t(p / 40 * 7)});
        }
        const std::string name = folder + "/" + std::to_string(i);
        if (i % 2 == 1 && write_jpeg(name + ".jpg", 40, 36, rgb)) continue;
        write_png(name + ".png", 40, 36, rgb);
      }
    }
  }
  const RunResult r = run_on_cpu(
      dir, "--data folder --data-dir '" + root + "' --arch vgg11 -j 2 --epochs 1 --batch-size 6 " +
               "--augment --save-test-set '" + (dir / "test.safetensors") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "images from " + root + " (3 classes")) << r.output;
  EXPECT_TRUE(contains(r.output, "train: RandomResizedCrop(32) + RandomHorizontalFlip, test: "
                                 "Resize(37) + CenterCrop(32)")) << r.output;
  EXPECT_TRUE(contains(r.output, ": 12 train, 6 test images")) << r.output;
  EXPECT_TRUE(contains(r.output, "epoch 1/1:")) << r.output;
  const cudp::SafetensorsFile test = cudp::load_safetensors(dir / "test.safetensors");
  EXPECT_EQ(test.tensors.at("images").shape(), (cudp::Shape{6, 32, 32, 3}));
  EXPECT_EQ(test.tensors.at("labels").to_vector<int32_t>(),
            (std::vector<int32_t>{0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(std::count(test.metadata.at("mean").begin(), test.metadata.at("mean").end(), ','), 2);
  cudp::data::ImageFolderOptions eval;
  eval.size = 32;
  const cudp::data::Dataset want =
      cudp::data::materialize(cudp::data::ImageFolder(root + "/val", eval));
  EXPECT_EQ(test.tensors.at("images").to_vector<uint8_t>(), want.images);

  const RunResult missing = run_on_cpu(dir, "--data folder --data-dir '" + (dir / "nope") + "'");
  EXPECT_EQ(missing.code, 1) << missing.output;
  EXPECT_TRUE(contains(missing.output, "needs the sub-folders train/ and val/")) << missing.output;
}

// --accumulate 2: each batch of 8 as two micro-batches of 4 (no BatchNorm, whose statistics would
// differ per micro-batch). The first step's loss is computed from the same weights either way: the
// two weighted micro-batch means, each rounded once and added in fp32, differ from the one batch
// mean by a few units of 2^-24 relative, so 1e-6 relative holds; a micro-batch counted with the
// wrong weight (1 instead of 1/2) would double it.
TEST(VggTrainer, AccumulationOverMicroBatchesGivesTheBatchLoss) {
  CUDP_REQUIRE_VGG();
  TempDir dir;
  const std::string run = kSmall +
                          "--no-bn --epochs 1 --limit-train 16 --limit-test 8 "
                          "--batch-size 8 --print-freq 1 ";
  const auto first_loss = [&](const std::string& extra, const std::string& name) {
    const std::string json = dir / name;
    const RunResult r = run_on_cpu(dir, run + extra + "--json '" + json + "'");
    EXPECT_EQ(r.code, 0) << r.output;
    if (!extra.empty()) {
      EXPECT_TRUE(contains(r.output, "gradient accumulation: each batch as 2 micro-batches"))
          << r.output;
    }
    return nlohmann::json::parse(lines_of(read_text(json)).at(0))["loss"].get<double>();
  };
  const double whole = first_loss("", "whole.json");
  const double accumulated = first_loss("--accumulate 2 ", "accumulated.json");
  EXPECT_NEAR(accumulated, whole, 1e-6 * std::fabs(whole));
  const RunResult bad = run_on_cpu(dir, run + "--accumulate 0");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_TRUE(contains(bad.output, "--accumulate")) << bad.output;
}

}  // namespace
