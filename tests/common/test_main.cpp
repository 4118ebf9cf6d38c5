// The tests' main: GoogleTest, plus a report of a crash. A test that dies of a signal (a segfault
// inside a library, an abort) would otherwise leave ctest's "SegFault" and no clue; this prints the
// test that was running and the stack (function names: the tests link with -rdynamic), then dies of
// the same signal, so ctest still sees the crash.
//
// One option of its own, after GoogleTest's: --cudp_conv_swapped=off runs the 64-channel bf16
// convolutions on the unswapped tiles, whose outputs are written by ordinary stores.
// compute-sanitizer's initcheck does not count the swapped tiles' TMA stores as writes, so it
// reports every later read of their outputs as uninitialised; scripts/sanitize.sh passes the
// option to initcheck. (The tests that compare the two kinds of tiles set the switch for their own
// runs and put back what they found.)
//
// After the tests, the arrival counters' sets are freed (kernels/counters.h), so that
// compute-sanitizer's leak check sees every allocation of the tests returned.
//
// With CUDP_ALL_SKIPPED_EXIT=N in the environment (ctest sets it for the GPU tests, with
// SKIP_RETURN_CODE N), a run in which every test skipped (no GPU, no golden file) exits with N, so
// that ctest reports it skipped; a run with any failure still fails, and one in which some tests
// passed passes. (Matching the skip message in the output instead would report a failing host
// test beside skipped GPU tests as skipped.)
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "kernels/conv2d.h"
#include "kernels/counters.h"
#include "kernels/matmul.h"

namespace {

void write_text(const char* text) {
  const ssize_t ignored = write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

[[maybe_unused]] void on_crash(int signal) {
  write_text("\n*** the test process received ");
  write_text(strsignal(signal));
  // Not async-signal-safe, and a best effort: the process is dying anyway.
  if (const testing::TestInfo* test = testing::UnitTest::GetInstance()->current_test_info()) {
    write_text(" in ");
    write_text(test->test_suite_name());
    write_text(".");
    write_text(test->name());
  }
  write_text("; stack:\n");
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  std::raise(signal);  // SA_RESETHAND: the default action now
}

}  // namespace

int main(int argc, char** argv) {
  // GoogleTest takes its own options out of argv; it leaves --help and the --gtest_ options it
  // does not know, having printed its help for them.
  testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--cudp_conv_swapped=off" || arg == "--cudp_conv_swapped=on") {
      cudp::kernels::detail::set_conv_swapped(arg.ends_with("=on"));
    } else if (!(arg == "--help" || arg == "-h" || arg == "-?" || arg == "/?" ||
                 arg.starts_with("--gtest_") || arg.starts_with("-gtest_") ||
                 arg.starts_with("/gtest_"))) {
      std::fprintf(stderr,
                   "unknown argument '%s': the tests take GoogleTest's options (--help) and "
                   "--cudp_conv_swapped=on|off\n",
                   argv[i]);
      return 2;
    }
  }
  // AddressSanitizer reports a crash better itself: it keeps its own handlers.
#if !defined(__SANITIZE_ADDRESS__)
  // backtrace() loads libgcc (and allocates) on its first call: done here, not in a handler that a
  // corrupted heap may have raised.
  void* frames[1];
  backtrace(frames, 1);
  struct sigaction action {};
  action.sa_handler = on_crash;
  action.sa_flags = SA_RESETHAND;  // a crash inside the handler ends the process
  sigemptyset(&action.sa_mask);
  for (const int signal : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) {
    sigaction(signal, &action, nullptr);
  }
#endif
  const int status = RUN_ALL_TESTS();
  cudp::kernels::release_arrival_counters();
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  if (const char* code = std::getenv("CUDP_ALL_SKIPPED_EXIT");
      code != nullptr && status == 0 && unit.test_to_run_count() > 0 &&
      unit.skipped_test_count() == unit.test_to_run_count()) {
    return std::atoi(code);
  }
  return status;
}
