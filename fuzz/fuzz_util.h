// What the fuzz targets share: a scratch directory for the files they hand to the readers, and
// writing an input there.
//
// The readers under test take paths, not buffers (they must refuse FIFOs, check sizes against
// fstat, read incrementally), so each input is written to a real file and read back through the same
// code a user's file goes through. The directory lives under $TMPDIR (fuzz/run.sh points it at
// /dev/shm where there is one) and is removed at exit.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

namespace cudp::fuzz {

inline const std::string& scratch_dir() {
  // Leaked on purpose: the exit handler below runs after static destructors would have freed it.
  static const std::string* const dir = [] {
    std::string pattern = (std::filesystem::temp_directory_path() / "cudp-fuzz-XXXXXX").string();
    if (!::mkdtemp(pattern.data())) {
      std::perror("mkdtemp");
      std::abort();
    }
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(scratch_dir(), ignored);
    });
    return new std::string(pattern);
  }();
  return *dir;
}

inline std::string scratch_file(std::string_view name) {
  return scratch_dir() + "/" + std::string(name);
}

// Writes `bytes` to `path`, replacing it.
inline void write_input(const std::string& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fclose(f) != 0) {
    std::perror(path.c_str());
    std::abort();
  }
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace cudp::fuzz
