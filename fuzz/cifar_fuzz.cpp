// Fuzz target: the CIFAR-10 batch reader, raw and gzipped. Any input must read or throw IoError
// naming the file; what reads must be a valid data set.
#include <cstdint>

#include "data/cifar.h"
#include "engine/core/error.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cudp;
  static const std::string path = fuzz::scratch_file("data_batch_1.bin");
  fuzz::write_input(path, fuzz::as_text(data, size));
  try {
    data::Dataset d;
    d.name = "fuzz";
    data::read_cifar_batch(path, d);
    d.validate();  // throws ValueError, a bug here, if the reader made an inconsistent set
  } catch (const IoError&) {
  }
  return 0;
}
