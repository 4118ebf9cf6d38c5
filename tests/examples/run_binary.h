// Runs a built program as a user runs it, for the host and GPU tests of examples/vgg and bench:
// cudp-vgg's path comes from CUDP_VGG_BINARY (set by tests/CMakeLists.txt), each test gets a
// fresh temporary folder, and a run's exit code and output (stdout and stderr together) are
// returned for the test to check.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#ifdef CUDP_VGG_BINARY
#define CUDP_REQUIRE_VGG() (void)0
#else
#define CUDP_REQUIRE_VGG() GTEST_SKIP() << "cudp-vgg is not built (CUDP_BUILD_EXAMPLES=OFF)"
#endif

namespace cudp::testing {

#ifdef CUDP_VGG_BINARY
inline constexpr const char* kVgg = CUDP_VGG_BINARY;
#else
inline constexpr const char* kVgg = "";
#endif

struct RunResult {
  int code = -1;
  std::string output;  // stdout and stderr together
};

// A fresh folder per test (named after the test and the process), removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            (std::string("cudp_") + info->test_suite_name() + "_" + info->name() + "_" +
             std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// Runs `env` `program` `args` through the shell (env: variable assignments such as
// "CUDA_VISIBLE_DEVICES= ", or a launcher such as "mpirun -np 2 ", or empty), its output captured
// in a file of `dir`.
inline RunResult run_program(const TempDir& dir, const std::string& program,
                             const std::string& args, const std::string& env = "") {
  const std::string log = dir / "output.txt";
  const std::string command = env + "'" + program + "' " + args + " > '" + log + "' 2>&1";
  const int status = std::system(command.c_str());
  RunResult r;
  r.code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  return r;
}

// The command prefix that starts a program as `ranks` processes under mpirun, after `env`
// (variable assignments): mpirun, its flags and its process-count flag come from CUDP_MPIEXEC,
// CUDP_MPIEXEC_FLAGS and CUDP_MPIEXEC_NUMPROC_FLAG (tests/CMakeLists.txt, for the tests that run
// mpirun themselves); pass it as run_program's `env`.
#ifndef CUDP_MPIEXEC  // a test built without MPI: its mpirun tests are not registered
#define CUDP_MPIEXEC ""
#define CUDP_MPIEXEC_FLAGS ""
#define CUDP_MPIEXEC_NUMPROC_FLAG "-np"
#endif
inline std::string mpirun_prefix(int ranks, const std::string& env = "") {
  return env + "'" + CUDP_MPIEXEC + "' " + CUDP_MPIEXEC_FLAGS + " " + CUDP_MPIEXEC_NUMPROC_FLAG +
         " " + std::to_string(ranks) + " ";
}

// cudp-vgg `args`, as run_program runs it.
inline RunResult run_vgg(const TempDir& dir, const std::string& args, const std::string& env = "") {
  return run_program(dir, kVgg, args, env);
}

// The state_dict checksum a run printed with --print-checksum, or "" if it printed none.
inline std::string checksum_of(const RunResult& r) {
  std::smatch m;
  if (std::regex_search(r.output, m, std::regex("checksum ([0-9a-f]{16})"))) return m[1];
  return "";
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Every number a JSON log (--json) holds under `key`, as written (full precision), in order.
inline std::vector<std::string> json_log_numbers(const std::filesystem::path& path,
                                                 const std::string& key) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string all = text.str();
  const std::regex number("\"" + key + "\":([-0-9.eE+naif]+)");
  std::vector<std::string> out;
  for (auto it = std::sregex_iterator(all.begin(), all.end(), number); it != std::sregex_iterator();
       ++it) {
    out.push_back((*it)[1].str());
  }
  return out;
}

// cudp-vgg's --fused-grad-norm on (the default) against off, `args` and `env` as run_vgg's: both
// runs succeed with the same weights (--print-checksum in `args`) and the same logged norms (each
// with its --json log, so --print-freq decides how many), the run with it on says `says` and the
// run with it off says nothing of it. Returns the norms the run with it on logged (none after a
// failed run).
inline std::vector<std::string> expect_fused_grad_norm_matches_its_own_pass(
    const TempDir& dir, const std::string& args, const std::string& env, const std::string& says) {
  const RunResult on = run_vgg(dir, args + "--json '" + (dir / "on.json") + "'", env);
  const RunResult off =
      run_vgg(dir, args + "--fused-grad-norm off --json '" + (dir / "off.json") + "'", env);
  EXPECT_EQ(on.code, 0) << on.output;
  EXPECT_EQ(off.code, 0) << off.output;
  if (on.code != 0 || off.code != 0) return {};
  EXPECT_NE(checksum_of(on), "") << on.output;
  EXPECT_EQ(checksum_of(on), checksum_of(off)) << on.output << "\n" << off.output;
  const std::vector<std::string> norms = json_log_numbers(dir / "on.json", "grad_norm");
  EXPECT_EQ(norms, json_log_numbers(dir / "off.json", "grad_norm"));
  EXPECT_TRUE(contains(on.output, says)) << on.output;
  EXPECT_FALSE(contains(off.output, "gradient norm:")) << off.output;
  return norms;
}

}  // namespace cudp::testing
