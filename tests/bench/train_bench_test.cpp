// bench_train as one process on the CPU (--gpus none), with and without --bn and in tf32, and the
// usage errors a command line without a GPU or a launcher meets. The figures are checked against
// what they must be whatever the speed: the global batch they imply (run_bench_train.h), one row
// per configuration, "processes": 1, BatchNorm's parameter count.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "bench/run_bench_train.h"

namespace {

using namespace cudp::testing;

TEST(BenchTrain, OneProcessOnTheCpu) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain, kTinyCpu + "--json '" + (dir / "t.json") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto rows = json_lines(dir / "t.json");
  ASSERT_EQ(rows.size(), 1u) << r.output;  // graphs off only: the CPU has no CUDA graphs
  const auto& row = rows[0];
  EXPECT_EQ(row.at("processes"), 1);
  EXPECT_EQ(row.at("gpus"), 0);
  EXPECT_EQ(row.at("batch_per_gpu"), 4);
  EXPECT_EQ(row.at("cudp_graphs"), "off");
  EXPECT_EQ(row.at("cudp_zero_grad"), "deferred");  // the default
  EXPECT_EQ(row.at("cudp_overlap_update"), "off");  // the default
  EXPECT_EQ(row.at("cudp_splitk"), "kernel4");      // the default
  EXPECT_EQ(row.at("cudp_bias_final"), "batched");  // the default
  EXPECT_EQ(row.at("cudp_dense_2x2"), "on");        // the default
  EXPECT_EQ(row.at("cudp_dense_2x2_view"), "on");   // the default
  EXPECT_EQ(row.at("cudp_dense_2x2_splits"), 0);    // the planner's
  EXPECT_EQ(row.at("cudp_dense_2x2_tile"), 0);      // the planner's
  EXPECT_EQ(row.at("repeats"), 1);                  // kTinyCpu's: one timed window
  EXPECT_EQ(row.at("bn"), false);          // --bn is off by default
  EXPECT_FALSE(row.contains("peak_gib"));  // GPU memory only
  expect_global_batch(row, 4);
  EXPECT_EQ(count_of(r.output, "| vgg11 | fp32 | off | 32 | 4 | 1 | 0 (CPU) |"), 1u) << r.output;
}

// --zero-grad fill: the row says so; an unknown mode is a usage error.
TEST(BenchTrain, ZeroGradFillIsRecorded) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain,
                                  kTinyCpu + "--zero-grad fill --json '" + (dir / "t.json") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto rows = json_lines(dir / "t.json");
  ASSERT_EQ(rows.size(), 1u) << r.output;
  EXPECT_EQ(rows[0].at("cudp_zero_grad"), "fill");
  expect_global_batch(rows[0], 4);
  const RunResult bad = run_program(dir, kBenchTrain, kTinyCpu + "--zero-grad later");
  EXPECT_NE(bad.code, 0) << bad.output;
  EXPECT_NE(bad.output.find("--zero-grad"), std::string::npos) << bad.output;
}

// --overlap-update on needs GPUs: on the CPU it is an error that says so, not a row timed without
// it; an unknown value is a usage error.
TEST(BenchTrain, OverlapUpdateOnTheCpuIsRefused) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain, kTinyCpu + "--overlap-update on");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("--overlap-update on needs GPUs"), std::string::npos) << r.output;
  const RunResult bad = run_program(dir, kBenchTrain, kTinyCpu + "--overlap-update later");
  EXPECT_NE(bad.code, 0) << bad.output;
  EXPECT_NE(bad.output.find("--overlap-update"), std::string::npos) << bad.output;
}

// --bn: VGG with a BatchNorm2d after every convolution, in each precision the CPU runs (the bf16
// row takes BatchNorm's bf16 path). The model must have exactly BatchNorm's parameters more than
// the plain VGG-11: a weight and a bias per channel of its 8 convolutions' outputs.
TEST(BenchTrain, BatchNormOnTheCpu) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult plain =
      run_program(dir, kBenchTrain, kTinyCpu + "--json '" + (dir / "plain.json") + "'");
  ASSERT_EQ(plain.code, 0) << plain.output;
  const RunResult r = run_program(
      dir, kBenchTrain, kTinyCpu + "--precision bf16 --bn --json '" + (dir / "bn.json") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto base = json_lines(dir / "plain.json");
  const auto rows = json_lines(dir / "bn.json");
  ASSERT_EQ(base.size(), 1u) << plain.output;
  ASSERT_EQ(rows.size(), 2u) << r.output;  // fp32 (kTinyCpu's), then bf16
  const int64_t bn_parameters = 2 * (64 + 128 + 256 + 256 + 512 + 512 + 512 + 512);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    EXPECT_EQ(row.at("model"), "vgg11") << row.dump();
    EXPECT_EQ(row.at("bn"), true) << row.dump();
    EXPECT_EQ(row.at("cudp_precision"), i == 0 ? "fp32" : "bf16") << row.dump();
    EXPECT_EQ(row.at("parameters").get<int64_t>() - base[0].at("parameters").get<int64_t>(),
              bn_parameters)
        << row.dump();
    expect_global_batch(row, 4);
  }
  EXPECT_EQ(count_of(r.output, "| vgg11-bn | fp32 | off | 32 | 4 | 1 | 0 (CPU) |"), 1u) << r.output;
  EXPECT_EQ(count_of(r.output, "| vgg11-bn | bf16 | off | 32 | 4 | 1 | 0 (CPU) |"), 1u) << r.output;
  EXPECT_EQ(count_of(plain.output, "| vgg11-bn |"), 0u) << plain.output;
}

// tf32 on the CPU: the layers truncate its operands there (layers/precision.h), so it is measured
// like the other precisions, a row of its own after fp32's.
TEST(BenchTrain, Tf32OnTheCpu) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain,
                                  kTinyCpu + "--precision tf32 --json '" + (dir / "t.json") + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto rows = json_lines(dir / "t.json");
  ASSERT_EQ(rows.size(), 2u) << r.output;  // fp32 (kTinyCpu's), then tf32
  EXPECT_EQ(rows[0].at("cudp_precision"), "fp32") << rows[0].dump();
  EXPECT_EQ(rows[1].at("cudp_precision"), "tf32") << rows[1].dump();
  EXPECT_EQ(rows[1].at("gpus"), 0);
  expect_global_batch(rows[1], 4);
  EXPECT_EQ(count_of(r.output, "| vgg11 | tf32 | off | 32 | 4 | 1 | 0 (CPU) |"), 1u) << r.output;
}

// --repeats: that many timed windows, each window's img/s in the JSON in order, and the figures
// the median window's: for an odd count one of the windows itself; for an even count the mean of
// the two middle windows' seconds (img/s = batch * steps / seconds). A count below 1 is a usage
// error naming the option.
TEST(BenchTrain, TimedWindowsGiveTheMedianWindow) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  for (const int repeats : {3, 2}) {
    const std::string json = dir / (std::to_string(repeats) + "-windows.json");
    const RunResult r = run_program(
        dir, kBenchTrain,
        kTinyCpuOneStep + "--repeats " + std::to_string(repeats) + " --json '" + json + "'");
    ASSERT_EQ(r.code, 0) << r.output;
    const auto rows = json_lines(json);
    ASSERT_EQ(rows.size(), 1u) << r.output;
    const auto& row = rows[0];
    EXPECT_EQ(row.at("repeats"), repeats) << row.dump();
    std::vector<double> windows = row.at("window_images_per_s").get<std::vector<double>>();
    ASSERT_EQ(windows.size(), static_cast<size_t>(repeats)) << row.dump();
    std::sort(windows.begin(), windows.end());
    const double ips = row.at("images_per_s").get<double>();
    if (repeats % 2 == 1) {
      EXPECT_EQ(ips, windows[windows.size() / 2]) << row.dump();  // the same value, as printed
    } else {
      // Seconds of a window: 4 images / its img/s; the values are printed to 0.1 img/s.
      const double seconds = (4 / windows[0] + 4 / windows[1]) / 2;
      EXPECT_NEAR(ips, 4 / seconds, 0.1) << row.dump();
    }
    expect_global_batch(row, 4);
  }
  const RunResult bad = run_program(dir, kBenchTrain, kTinyCpuOneStep + "--repeats 0");
  EXPECT_NE(bad.code, 0) << bad.output;
  EXPECT_TRUE(contains(bad.output, "--repeats")) << bad.output;
}

TEST(BenchTrain, ProcessesWithoutALauncherSaysHowToLaunch) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain, kTinyCpu + "--processes 2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "mpirun -np 2 bench_train")) << r.output;
}

TEST(BenchTrain, GraphsOnTheCpuIsAUsageError) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain, kTinyCpu + "--graphs on");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "CUDA graphs need a GPU")) << r.output;
}

TEST(BenchTrain, NoGpuVisibleSaysGpusNone) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r =
      run_program(dir, kBenchTrain, "--size 32 --steps 1", "CUDA_VISIBLE_DEVICES= ");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "no CUDA device is visible; give --gpus none")) << r.output;
}

// An option out of its range is a usage error (exit 2) that names the option and what it takes,
// never a run of something else: --arch vgg7 used to time VGG-19, --warmup -1 no warm-up, and
// --size 33 failed only at the model's build.
TEST(BenchTrain, OptionsOutOfRangeAreUsageErrors) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--arch vgg7", "--arch: vgg7 not in {vgg11,vgg13,vgg16,vgg19}"},
      {"--size 33", "--size: 33 not in {224,32}"},
      {"--steps 0", "--steps: takes a whole number >= 1, not 0"},
      {"--batch-per-gpu 0", "--batch-per-gpu: takes a whole number >= 1, not 0"},
      {"--warmup -1", "--warmup: takes a whole number >= 0, not -1"},
      {"--repeats 1.5", "--repeats: takes a whole number >= 1, not 1.5"},
      {"--wgrad-stream 99999999999999999999", "--wgrad-stream: expected on, off or a number"},
      {"--no-such-option", "The following argument was not expected: --no-such-option"},
  };
  for (const auto& [args, message] : cases) {
    const RunResult r = run_program(dir, kBenchTrain, kTinyCpu + args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "bench_train: " + message)) << args << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "| vgg")) << args << "\n" << r.output;  // nothing measured
  }
}

// A --json file that cannot be written stops the run before it measures anything.
TEST(BenchTrain, UnwritableJsonIsRefusedFirst) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r =
      run_program(dir, kBenchTrain, kTinyCpu + "--json '" + (dir / "no-such-folder/t.json") + "'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "cannot be written")) << r.output;
  EXPECT_FALSE(contains(r.output, "| vgg")) << r.output;
}

TEST(BenchTrain, GpusMustBeACountOrNone) {
  CUDP_REQUIRE_BENCH_TRAIN();
  TempDir dir;
  const RunResult r = run_program(dir, kBenchTrain, "--gpus two --size 32");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--gpus two: give a GPU count")) << r.output;
}

}  // namespace
