// Fuzz target: the IDX reader (MNIST, Fashion-MNIST), raw and gzipped. Any input must read or throw
// IoError naming the file; what reads must be self-consistent (the pixel count is the header's
// product, the sides are within kMaxIdxSide).
#include <cstdint>

#include "data/idx.h"
#include "engine/core/error.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cudp;
  static const std::string path = fuzz::scratch_file("input-idx-ubyte");
  fuzz::write_input(path, fuzz::as_text(data, size));
  try {
    const data::IdxImages images = data::read_idx_images(path);
    if (images.rows < 1 || images.cols < 1 || images.rows > data::kMaxIdxSide ||
        images.cols > data::kMaxIdxSide ||
        images.pixels.size() != static_cast<size_t>(images.count * images.rows * images.cols)) {
      __builtin_trap();
    }
  } catch (const IoError&) {
  }
  try {
    data::read_idx_labels(path);
  } catch (const IoError&) {
  }
  return 0;
}
