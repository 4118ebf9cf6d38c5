// Fuzz target: the JPEG and PNG decoding of --data folder (data::decode_image: the file read, the
// choice of codec by the first bytes, the size checks, the calls into libjpeg-turbo and libpng).
// Any input must decode or throw IoError naming the file; what decodes must be a whole image.
//
// The codecs are the system's libturbojpeg.so.0 and libpng16.so.16, opened at run time: they are
// not instrumented, so the coverage that guides this target is cudp's side of the calls (a memory
// error inside a codec is found only when it crashes). Without them it reaches only the "install
// the package" errors. A header alone may ask for the largest image accepted (768 MiB of RGB):
// fuzz/run.sh gives this target a larger allocation limit than the other readers.
#include <cstdint>

#include "data/image_folder.h"
#include "engine/core/error.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cudp;
  static const std::string path = fuzz::scratch_file("image");
  fuzz::write_input(path, fuzz::as_text(data, size));
  try {
    const data::Image image = data::decode_image(path);
    // A decoded image is a bug here unless its size and its pixels agree.
    if (image.width <= 0 || image.height <= 0 ||
        image.rgb.size() != static_cast<size_t>(image.width * image.height * 3)) {
      __builtin_trap();
    }
  } catch (const IoError&) {
  }
  return 0;
}
