// The command line of the bench programs (CLI11), reported alike in all of them: a mistake names
// the program and exits with kExitUsage (CLI11's own statuses, 105, 109..., differ by the kind of
// mistake), whole-number options say what they take, --json is opened before anything is
// measured, and an error that ends a program reads without the library's source location.
#pragma once

#include <CLI/CLI.hpp>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>

#include "common/status.h"
#include "engine/core/error.h"

namespace cudp::bench {

// What was asked cannot be done (the command line, the launch): main prints the message and exits
// with kExitUsage.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Parses the command line: nullopt to go on, else the status main returns. --help prints the
// options (0); a mistake prints what is wrong and where to look (kExitUsage).
inline std::optional<int> parse_command_line(CLI::App& app, const char* program, int argc,
                                             char** argv) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "%s: %s\nRun %s --help for the options.\n", program, e.what(), program);
    return kExitUsage;
  }
}

// A whole number from `min` to `max`, for CLI::Option::check: "--steps: takes a whole number >= 1,
// not 0" where CLI::PositiveNumber prints a range of doubles to 300 digits.
inline CLI::Validator whole_number(long long min, long long max = INT_MAX) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long value = std::strtoll(text.c_str(), &end, 10);
        const bool whole = !text.empty() && *end == '\0' && errno == 0;
        if (whole && value >= min && value <= max) return "";
        const bool bounded = max != INT_MAX || (whole && value > max);
        const std::string range = bounded
                                      ? "from " + std::to_string(min) + " to " + std::to_string(max)
                                      : ">= " + std::to_string(min);
        return "takes a whole number " + range + ", not " + text;
      },
      max != INT_MAX ? std::to_string(min) + ".." + std::to_string(max)
                     : ">=" + std::to_string(min));
}

// Opens --json PATH for writing before anything is measured, so that a path that cannot be written
// stops the program at once, not after minutes of measurement.
inline std::FILE* open_json(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    throw UsageError("--json " + path + " cannot be written (" + std::strerror(errno) +
                     "); give a file in a folder you can write to");
  }
  return file;
}

// Prints the exception that ends `program`: a cudp::Error's message without the source location
// its what() ends with, any other exception's what().
inline void print_error(const char* program, const std::exception& e) {
  const auto* error = dynamic_cast<const Error*>(&e);
  std::fprintf(stderr, "%s: %s\n", program, error ? error->message().c_str() : e.what());
}

}  // namespace cudp::bench
