// The tests' main: GoogleTest, plus a report of a crash. A test that dies of a signal (a segfault
// inside a library, an abort) would otherwise leave ctest's "SegFault" and no clue; this prints the
// test that was running and the stack (function names: the tests link with -rdynamic), then dies of
// the same signal, so ctest still sees the crash.
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

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
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
#if !defined( \
    __SANITIZE_ADDRESS__)  // AddressSanitizer reports a crash better itself: leave it its own
  for (const int signal : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(signal, on_crash);
#endif
  return RUN_ALL_TESTS();
}
