// Fuzz target: the gzip path. Any input must decompress or throw IoError; the whole-stream gunzip(),
// its size limit and the incremental Gunzip read in small pieces must agree byte for byte (a
// differential check: two ways through zlib's state machine, one answer).
#include <cstdint>
#include <span>
#include <vector>

#include "data/file_io.h"
#include "engine/core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cudp;
  if (size < 1) return 0;
  // The first byte picks the piece size of the incremental read: 1 to 16 bytes (every boundary of
  // zlib's state machine) or up to 15 KiB (fast on large outputs).
  const size_t piece = data[0] < 16 ? size_t{1} + data[0] : size_t{64} * data[0];
  const std::span<const uint8_t> input(data + 1, size - 1);
  constexpr size_t kLimit = size_t{1} << 18;

  std::vector<uint8_t> whole;
  bool whole_ok = true;
  try {
    whole = data::gunzip(input, "fuzz.gz", kLimit);
  } catch (const IoError&) {
    whole_ok = false;
  }

  std::vector<uint8_t> pieces;
  bool pieces_ok = true;
  try {
    data::Gunzip z(input, "fuzz.gz");
    while (pieces.size() <= kLimit && z.read(pieces, piece) == piece) {
    }
    if (pieces.size() > kLimit) pieces_ok = false;
  } catch (const IoError&) {
    pieces_ok = false;
  }
  if (whole_ok != pieces_ok) __builtin_trap();
  if (whole_ok && whole != pieces) __builtin_trap();

  // A smaller limit refuses exactly the streams longer than it.
  if (whole_ok && !whole.empty()) {
    const size_t limit = whole.size() - 1;
    try {
      data::gunzip(input, "fuzz.gz", limit);
      __builtin_trap();
    } catch (const IoError&) {
    }
  }
  return 0;
}
