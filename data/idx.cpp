#include "data/idx.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "data/file_io.h"
#include "engine/core/error.h"

namespace cudp::data {
namespace {

uint32_t read_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

void append_be32(std::vector<uint8_t>& out, int64_t value) {
  CUDP_CHECK(value >= 0 && value <= 0xFFFFFFFFll, "an IDX size must fit in 32 bits, got ", value);
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(value >> shift));
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

struct IdxFile {
  std::vector<uint8_t> data;   // what follows the header: the pixels or labels
  std::vector<int64_t> sizes;  // the header's dimensions
};

// deflate cannot compress better than about 1032:1: a promise beyond that cannot be kept.
constexpr int64_t kMaxDeflateRatio = 1032;
// What a gzip file's data is given room for at once, at most, as a multiple of its compressed size
// (MNIST's images inflate 4.7x, Fashion-MNIST's 1.8x). Grown as it arrived, the output was copied
// at every doubling, a third of Fashion-MNIST's 0.25 s load; a false promise is still given no more
// than this before its data arrives.
constexpr int64_t kReserveRatio = 8;

// Reads an IDX file of `dims` dimensions, checking its magic and that it holds exactly the header
// plus the bytes its dimensions promise. `what` ("images", "labels") names it in errors. A gzip
// file is decompressed header first and then only as far as the header promises (plus one byte, to
// tell a file that is too long), so a gzip bomb costs no more than its header admits to.
IdxFile read_idx(const std::string& path, uint32_t magic, int dims, const char* what) {
  std::vector<uint8_t> raw = read_compressed(path);
  const bool gz = is_gzip(raw);
  std::optional<Gunzip> z;
  IdxFile f;
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  std::vector<uint8_t> head;
  if (gz) {
    z.emplace(raw, path);
    z->read(head, header);
  } else {
    head.assign(raw.begin(),
                raw.begin() + static_cast<std::ptrdiff_t>(std::min(header, raw.size())));
  }
  const auto too_short = [&] {
    CUDP_THROW(IoError, path, " is truncated: it has ", head.size(), " bytes, less than the ",
               header, "-byte header of an IDX ", what, " file");
  };
  if (head.size() < 4) too_short();
  const uint32_t found = read_be32(head.data());
  if (found != magic) {
    const bool swapped = found == kIdxImagesMagic || found == kIdxLabelsMagic;
    CUDP_THROW(IoError, path, " is not an IDX ", what, " file: magic number ", hex32(found),
               ", expected ", hex32(magic),
               swapped ? " (this is the other kind of IDX file: images and labels swapped?)" : "");
  }
  if (head.size() < header) too_short();
  // Three 32-bit sizes can promise 2^96 bytes: checked, since no file holds more than 2^63.
  int64_t data_bytes = 1, expected = 0;
  bool overflow = false;
  for (int d = 0; d < dims; ++d) {
    f.sizes.push_back(read_be32(head.data() + 4 + 4 * d));
    overflow = overflow || __builtin_mul_overflow(data_bytes, f.sizes.back(), &data_bytes);
  }
  overflow = overflow || __builtin_add_overflow(static_cast<int64_t>(header), data_bytes, &expected);
  const std::string shape = dims == 3 ? detail::str(" of ", f.sizes[1], "x", f.sizes[2]) : "";
  if (overflow) {
    CUDP_THROW(IoError, path, " is truncated: its header promises ", f.sizes[0], " ", what, shape,
               ", more than 2^63 bytes, and the file has ", raw.size(),
               gz ? " bytes of gzip" : " bytes");
  }
  if (gz) {
    const int64_t possible = static_cast<int64_t>(raw.size()) * kMaxDeflateRatio;
    if (data_bytes > possible) {
      CUDP_THROW(IoError, path, " cannot be an IDX ", what, " file: its header promises ",
                 f.sizes[0], " ", what, shape, " (", expected, " bytes with the header), more than ",
                 raw.size(), " bytes of gzip can hold (truncated or corrupt?)");
    }
    f.data.reserve(static_cast<size_t>(
        std::min(data_bytes + 1, static_cast<int64_t>(raw.size()) * kReserveRatio)));
    z->read(f.data, static_cast<size_t>(data_bytes) + 1);
  } else {
    raw.erase(raw.begin(), raw.begin() + static_cast<std::ptrdiff_t>(header));
    f.data = std::move(raw);
  }
  const int64_t actual = static_cast<int64_t>(header + f.data.size());
  if (actual != expected) {
    CUDP_THROW(IoError, path, (actual < expected ? " is truncated" : " is too long"),
               ": its header promises ", f.sizes[0], " ", what, shape, " (", expected,
               " bytes with the header), the file has ",
               gz && actual > expected ? "more than " + std::to_string(expected)
                                       : std::to_string(actual),
               gz ? " bytes after decompression" : " bytes");
  }
  return f;
}

// The file `stem` in `dir` under the names it is distributed with: gzipped or not, and with the
// '.' that some MNIST mirrors use before "idx" ("train-images.idx3-ubyte").
std::string find_idx_file(const std::string& dir, const std::string& stem, const std::string& name) {
  std::string dotted = stem;
  dotted[dotted.rfind("-idx")] = '.';
  const std::string base = dir + "/";
  for (const std::string& candidate : {stem + ".gz", stem, dotted + ".gz", dotted}) {
    if (file_exists(base + candidate)) return base + candidate;
  }
  const bool fashion = name.find("fashion") != std::string::npos;
  CUDP_THROW(IoError, name, " file not found: ", base, stem, "(.gz). ",
             fashion ? "On Debian/Ubuntu, apt-get install dataset-fashion-mnist puts the files in "
                       "/usr/share/datasets/fashion-mnist/; or download them (train-images-"
                       "idx3-ubyte.gz, ...) and give their directory (the programs' --data-dir)"
                     : "Download the four IDX files (train-images-idx3-ubyte.gz, ...) and give "
                       "their directory (the programs' --data-dir)");
}

}  // namespace

IdxImages read_idx_images(const std::string& path) {
  IdxFile f = read_idx(path, kIdxImagesMagic, 3, "images");
  // The loader multiplies these by the batch size: keep them to what an image can sensibly be.
  if (f.sizes[1] < 1 || f.sizes[2] < 1 || f.sizes[1] > kMaxIdxSide || f.sizes[2] > kMaxIdxSide) {
    CUDP_THROW(IoError, path, ": images of ", f.sizes[1], "x", f.sizes[2],
               " pixels; an IDX image must have between 1 and ", kMaxIdxSide,
               " rows and columns");
  }
  IdxImages images{f.sizes[0], f.sizes[1], f.sizes[2], {}};
  images.pixels = std::move(f.data);
  return images;
}

std::vector<uint8_t> read_idx_labels(const std::string& path) {
  IdxFile f = read_idx(path, kIdxLabelsMagic, 1, "labels");
  return std::move(f.data);
}

std::vector<uint8_t> encode_idx_images(std::span<const uint8_t> pixels, int64_t count, int64_t rows,
                                       int64_t cols) {
  CUDP_CHECK(static_cast<int64_t>(pixels.size()) == count * rows * cols, "encode_idx_images: ",
             pixels.size(), " pixels for ", count, " images of ", rows, "x", cols);
  std::vector<uint8_t> out;
  out.reserve(16 + pixels.size());
  for (int64_t v : {int64_t{kIdxImagesMagic}, count, rows, cols}) append_be32(out, v);
  out.insert(out.end(), pixels.begin(), pixels.end());
  return out;
}

std::vector<uint8_t> encode_idx_labels(std::span<const uint8_t> labels) {
  std::vector<uint8_t> out;
  out.reserve(8 + labels.size());
  for (int64_t v : {int64_t{kIdxLabelsMagic}, static_cast<int64_t>(labels.size())}) append_be32(out, v);
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

Dataset load_mnist_like(const std::string& dir, bool train, const std::string& name) {
  constexpr int kClasses = 10;
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_path = find_idx_file(dir, prefix + "-images-idx3-ubyte", name);
  const std::string labels_path = find_idx_file(dir, prefix + "-labels-idx1-ubyte", name);
  IdxImages images = read_idx_images(images_path);
  // read_idx_images takes any size, as IDX allows. A data set of another size (or splits of two
  // sizes) would otherwise fail only in the model, after a whole epoch of training, in an error
  // naming neither the file nor the size expected: it is refused as it is opened.
  if (images.rows != kMnistSide || images.cols != kMnistSide) {
    const std::string known = name.find("fashion") != std::string::npos ? "Fashion-MNIST"
                              : name == "mnist"                         ? "MNIST"
                                                                        : name;
    CUDP_THROW(IoError, images_path, " holds ", images.rows, "x", images.cols, " images; ", known,
               "'s images are ", kMnistSide, "x", kMnistSide, ": is this the right file?");
  }
  const std::vector<uint8_t> labels = read_idx_labels(labels_path);
  if (images.count != static_cast<int64_t>(labels.size())) {
    CUDP_THROW(IoError, name, ": ", images_path, " holds ", images.count, " images but ",
               labels_path, " holds ", labels.size(), " labels");
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] >= kClasses) {
      CUDP_THROW(IoError, labels_path, ": label ", int{labels[i]}, " at index ", i,
                 " is out of range [0, ", kClasses, ")");
    }
  }
  Dataset d;
  d.name = name + (train ? "/train" : "/test");
  d.height = images.rows;
  d.width = images.cols;
  d.channels = 1;
  d.num_classes = kClasses;
  d.images = std::move(images.pixels);
  d.labels.assign(labels.begin(), labels.end());
  d.validate();
  return d;
}

}  // namespace cudp::data
