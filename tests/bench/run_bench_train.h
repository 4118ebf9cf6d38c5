// bench_train run as a user runs it, for tests/bench: the binary's path comes from
// CUDP_BENCH_TRAIN_BINARY (tests/CMakeLists.txt, when the benchmarks are built), and the figures
// of a run's JSON lines are checked against what they must satisfy whatever the machine's speed.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "examples/run_binary.h"

#ifdef CUDP_BENCH_TRAIN_BINARY
#define CUDP_REQUIRE_BENCH_TRAIN() (void)0
#else
#define CUDP_REQUIRE_BENCH_TRAIN() GTEST_SKIP() << "bench_train is not built (CUDP_BUILD_BENCH=OFF)"
#endif

namespace cudp::testing {

#ifdef CUDP_BENCH_TRAIN_BINARY
inline constexpr const char* kBenchTrain = CUDP_BENCH_TRAIN_BINARY;
#else
inline constexpr const char* kBenchTrain = "";
#endif

// A real VGG on the CPU, small enough to take seconds: VGG-11 at 32x32, 4 images per process, one
// timed step and no warm-up.
inline const std::string kTinyCpuOneStep =
    "--gpus none --arch vgg11 --size 32 --batch-per-gpu 4 --steps 1 --warmup 0 --precision fp32 ";
// ... timed once (one window: a CPU step takes seconds, and these runs check figures, not speed).
inline const std::string kTinyCpu = kTinyCpuOneStep + "--repeats 1 ";

// The JSON objects of a file of JSON lines; a line that does not parse fails the test.
inline std::vector<nlohmann::json> json_lines(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path << " was not written";
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << "not JSON: " << line;
    if (!j.is_discarded()) rows.push_back(j);
  }
  return rows;
}

// img/s and step ms are two readings of the same seconds: img/s = B * steps / s and
// step ms = 1000 s / steps, so img/s * step ms / 1000 is B, the global batch (every process's
// images), up to the rounding of the printed figures (img/s to 0.1, step ms to 0.001).
inline void expect_global_batch(const nlohmann::json& row, double global_batch) {
  const double ips = row.at("images_per_s").get<double>(), ms = row.at("step_ms").get<double>();
  EXPECT_GT(ips, 0);
  EXPECT_GT(ms, 0);
  const double rounding = (0.05 * ms + 0.0005 * ips) / 1000;
  EXPECT_NEAR(ips * ms / 1000, global_batch, rounding + 1e-9) << row.dump();
}

inline size_t count_of(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace cudp::testing
