// IDX files: the format of MNIST and Fashion-MNIST (http://yann.lecun.com/exdb/mnist/ describes it).
//
// An IDX file is a big-endian header followed by raw data: the magic number 0x00000803 and three
// sizes (count, rows, columns) for an image file, 0x00000801 and a count for a label file, then
// unsigned bytes. Files may be gzipped (the usual distribution) or raw; data/file_io.h tells them
// apart by content, not by name. Every check names the file and says what is wrong: wrong magic,
// a size that does not match the header (expected and actual bytes), images and labels that do not
// pair up, a label out of range (its index and value), an image side of 0 or more than
// kMaxIdxSide. A gzipped file is decompressed only as far as its header promises.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace cudp::data {

inline constexpr uint32_t kIdxImagesMagic = 0x00000803;  // unsigned bytes, 3 dimensions
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;  // unsigned bytes, 1 dimension
inline constexpr int64_t kMaxIdxSide = 16384;  // rows and columns of an image, at most

struct IdxImages {
  int64_t count = 0, rows = 0, cols = 0;
  std::vector<uint8_t> pixels;  // count * rows * cols, row-major
};

IdxImages read_idx_images(const std::string& path);
std::vector<uint8_t> read_idx_labels(const std::string& path);

// The file bytes of an IDX image or label file (tests and tools write data sets with these).
std::vector<uint8_t> encode_idx_images(std::span<const uint8_t> pixels, int64_t count, int64_t rows,
                                       int64_t cols);
std::vector<uint8_t> encode_idx_labels(std::span<const uint8_t> labels);

// MNIST's and Fashion-MNIST's images are 28x28, in both splits.
inline constexpr int64_t kMnistSide = 28;

// The train ("train-images-idx3-ubyte", "train-labels-idx1-ubyte") or test ("t10k-...") split of an
// MNIST-like data set in `dir`, each file gzipped (".gz") or raw, as 28x28x1 images of 10 classes.
// `name` ("fashion-mnist", "mnist") names the Dataset and the errors. A missing file is an IoError
// that says how to get it (Debian/Ubuntu: package dataset-fashion-mnist, or --data-dir); so is an
// images file of any other size than kMnistSide x kMnistSide, which keeps the splits alike too.
Dataset load_mnist_like(const std::string& dir, bool train, const std::string& name = "fashion-mnist");

// Where Debian/Ubuntu's dataset-fashion-mnist package installs the files.
inline constexpr const char* kFashionMnistSystemDir = "/usr/share/datasets/fashion-mnist";

}  // namespace cudp::data
