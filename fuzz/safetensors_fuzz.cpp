// Fuzz target: the safetensors reader. Any input must load or throw IoError naming the file; a
// crash, a sanitizer report, another exception type or an allocation beyond the input's size is a
// bug. A file that loads must also pass the header-only reader, and the reverse.
#include <cstdint>

#include "fuzz/fuzz_util.h"
#include "layers/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = cudp::fuzz::scratch_file("input.safetensors");
  cudp::fuzz::write_input(path, cudp::fuzz::as_text(data, size));
  bool loaded = false, header_loaded = false;
  cudp::Metadata metadata;
  try {
    const cudp::SafetensorsFile file = cudp::load_safetensors(path);
    metadata = file.metadata;
    loaded = true;
  } catch (const cudp::IoError&) {
  }
  try {
    const cudp::Metadata header_metadata = cudp::load_safetensors_metadata(path);
    header_loaded = true;
    if (loaded && header_metadata != metadata) __builtin_trap();
  } catch (const cudp::IoError&) {
  }
  // The two readers share every check but the reading of the data: they agree on every file.
  if (loaded != header_loaded) __builtin_trap();
  return 0;
}
