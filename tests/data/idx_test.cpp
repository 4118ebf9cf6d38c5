// IDX reader (MNIST, Fashion-MNIST): good files, raw and gzipped, generated here; every kind of bad
// file the reader must reject with a message naming the file; and the real Fashion-MNIST where the
// Debian package has installed it.
#include "data/idx.h"

#include <gtest/gtest.h>

#include "data/data_test_util.h"
#include "data/file_io.h"
#include "data/loader.h"

namespace cudp::data {
namespace {

using testing::ScratchDir;
using testing::throws_with;

constexpr int64_t kRows = 28, kCols = 28;

void append_be32(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

// IDX bytes written out by hand (not with the library's encoder) from the format's description.
std::vector<uint8_t> images_file(uint32_t count, const std::vector<uint8_t>& pixels,
                                 uint32_t rows = kRows, uint32_t cols = kCols) {
  std::vector<uint8_t> out = {0x00, 0x00, 0x08, 0x03};
  append_be32(out, count);
  append_be32(out, rows);
  append_be32(out, cols);
  out.insert(out.end(), pixels.begin(), pixels.end());
  return out;
}

std::vector<uint8_t> labels_file(const std::vector<uint8_t>& labels) {
  std::vector<uint8_t> out = {0x00, 0x00, 0x08, 0x01};
  append_be32(out, static_cast<uint32_t>(labels.size()));
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

std::vector<uint8_t> some_pixels(int64_t count) {
  std::vector<uint8_t> pixels(static_cast<size_t>(count * kRows * kCols));
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>((i * 7 + i / 13) % 256);
  return pixels;
}

// Writes a train split of `count` images with labels i % 10 into `dir`.
void write_split(const ScratchDir& dir, int64_t count, bool gzip, const std::string& prefix = "train") {
  std::vector<uint8_t> labels(static_cast<size_t>(count));
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<uint8_t>(i % 10);
  const std::string suffix = gzip ? ".gz" : "";
  write_file(dir / (prefix + "-images-idx3-ubyte" + suffix),
             images_file(static_cast<uint32_t>(count), some_pixels(count)), gzip);
  write_file(dir / (prefix + "-labels-idx1-ubyte" + suffix), labels_file(labels), gzip);
}

TEST(Idx, EncoderWritesTheDocumentedFormat) {
  const std::vector<uint8_t> pixels = some_pixels(3);
  EXPECT_EQ(encode_idx_images(pixels, 3, kRows, kCols), images_file(3, pixels));
  EXPECT_EQ(encode_idx_labels(std::vector<uint8_t>{1, 2, 9}), labels_file({1, 2, 9}));
}

TEST(Idx, ReadsRawAndGzipAlike) {
  for (const bool gzip : {false, true}) {
    SCOPED_TRACE(gzip ? "gzip" : "raw");
    ScratchDir dir;
    write_split(dir, 25, gzip);
    write_split(dir, 5, gzip, "t10k");
    if (gzip) {
      EXPECT_TRUE(is_gzip(testing::read_raw(dir / "train-images-idx3-ubyte.gz")));
    }
    const Dataset train = load_mnist_like(dir.path(), true, "mnist");
    EXPECT_EQ(train.name, "mnist/train");
    EXPECT_EQ(train.size(), 25);
    EXPECT_EQ(train.height, 28);
    EXPECT_EQ(train.width, 28);
    EXPECT_EQ(train.channels, 1);
    EXPECT_EQ(train.num_classes, 10);
    EXPECT_EQ(train.images, some_pixels(25));
    for (int64_t i = 0; i < train.size(); ++i) EXPECT_EQ(train.labels[i], i % 10);
    const Dataset test = load_mnist_like(dir.path(), false, "mnist");
    EXPECT_EQ(test.name, "mnist/test");
    EXPECT_EQ(test.size(), 5);
  }
}

TEST(Idx, AcceptsTheDottedMirrorNames) {
  ScratchDir dir;
  write_file(dir / "train-images.idx3-ubyte", images_file(2, some_pixels(2)));
  write_file(dir / "train-labels.idx1-ubyte", labels_file({3, 4}));
  const Dataset d = load_mnist_like(dir.path(), true);
  EXPECT_EQ(d.size(), 2);
  EXPECT_EQ(d.labels[1], 4);
}

TEST(Idx, MissingFileSaysHowToGetIt) {
  ScratchDir dir;
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), true, "fashion-mnist"); },
                                   {dir / "train-images-idx3-ubyte", "not found",
                                    "dataset-fashion-mnist", "/usr/share/datasets/fashion-mnist",
                                    "--data-dir"}));
}

TEST(Idx, TruncatedImagesNameExpectedAndActualBytes) {
  ScratchDir dir;
  write_split(dir, 3, false);
  std::vector<uint8_t> bytes = images_file(3, some_pixels(3));
  bytes.erase(bytes.end() - 100, bytes.end());
  write_file(dir / "train-images-idx3-ubyte", bytes);
  const std::string path = dir / "train-images-idx3-ubyte";
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), true); },
                                   {path, "truncated", "3 images of 28x28", std::to_string(16 + 3 * 784),
                                    std::to_string(bytes.size())}));
  // Shorter than the header itself.
  write_file(path, std::vector<uint8_t>{0, 0, 8, 3, 0});
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_images(path); }, {path, "truncated", "5 bytes"}));
}

TEST(Idx, TrailingBytesAreAnError) {
  ScratchDir dir;
  std::vector<uint8_t> bytes = labels_file({1, 2});
  bytes.push_back(7);
  write_file(dir / "labels", bytes);
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_labels(dir / "labels"); },
                                   {dir / "labels", "too long", "11 bytes"}));
}

TEST(Idx, WrongMagicIsNamed) {
  ScratchDir dir;
  write_split(dir, 3, false);
  // The labels file where the images file should be.
  write_file(dir / "train-images-idx3-ubyte", labels_file({1, 2, 3}));
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), true); },
                                   {dir / "train-images-idx3-ubyte", "magic number 0x00000801",
                                    "expected 0x00000803", "swapped"}));
  write_file(dir / "junk", std::vector<uint8_t>(64, 0xab));
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_labels(dir / "junk"); },
                                   {dir / "junk", "0xabababab", "expected 0x00000801"}));
}

TEST(Idx, ImageAndLabelCountsMustAgree) {
  ScratchDir dir;
  write_split(dir, 3, true);
  write_file(dir / "train-labels-idx1-ubyte.gz", labels_file({1, 2}), true);
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), true); },
                                   {"3 images", "2 labels", dir / "train-labels-idx1-ubyte.gz"}));
}

TEST(Idx, LabelOutOfRangeNamesIndexAndValue) {
  ScratchDir dir;
  write_split(dir, 3, false);
  write_file(dir / "train-labels-idx1-ubyte", labels_file({1, 10, 2}));
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), true); },
                                   {dir / "train-labels-idx1-ubyte", "label 10 at index 1",
                                    "out of range [0, 10)"}));
}

// A well-formed IDX pair of 14x56 images (as many pixels as 28x28 ones, the byte count consistent)
// in place of Fashion-MNIST's test split: IDX allows it, but it is not Fashion-MNIST, and it must
// be refused when the data set is opened, not after an epoch of training when the model finds its
// input the wrong size. The same for MNIST, and for images with one side right.
TEST(Idx, ImagesOtherThan28x28AreRefusedNamingTheFile) {
  ScratchDir dir;
  write_split(dir, 4, true);
  write_split(dir, 3, true, "t10k");
  const std::string path = dir / "t10k-images-idx3-ubyte.gz";
  write_file(path, images_file(3, some_pixels(3), 14, 56), /*gzip=*/true);
  ASSERT_EQ(read_idx_images(path).rows, 14);  // the file itself is a valid IDX file
  EXPECT_EQ(load_mnist_like(dir.path(), true, "fashion-mnist").size(), 4);
  EXPECT_TRUE(throws_with<IoError>(
      [&] { load_mnist_like(dir.path(), false, "fashion-mnist"); },
      {path, "14x56 images", "Fashion-MNIST's images are 28x28", "is this the right file?"}));
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), false, "mnist"); },
                                   {path, "14x56 images", "MNIST's images are 28x28"}));
  std::vector<uint8_t> pixels(3 * 28 * 27, 1);
  write_file(path, images_file(3, pixels, 28, 27), /*gzip=*/true);
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), false); },
                                   {path, "28x27 images", "28x28"}));
}

TEST(Idx, CorruptGzipIsAnErrorNotGarbage) {
  ScratchDir dir;
  write_split(dir, 20, true);
  const std::string path = dir / "train-images-idx3-ubyte.gz";
  const std::vector<uint8_t> good = testing::read_raw(path);

  std::vector<uint8_t> flipped = good;
  for (size_t i = 20; i < flipped.size() - 8; i += 17) flipped[i] ^= 0x5a;
  write_file(path, flipped);
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), true); },
                                   {path, "corrupt gzip"}));

  std::vector<uint8_t> cut(good.begin(), good.begin() + static_cast<long>(good.size() / 2));
  write_file(path, cut);
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), true); },
                                   {path, "corrupt gzip", "ends early"}));

  // A checksum error: the last member's CRC-32 (trailer bytes -8..-5) altered.
  std::vector<uint8_t> bad_crc = good;
  bad_crc[bad_crc.size() - 8] ^= 0xff;
  write_file(path, bad_crc);
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), true); },
                                   {path, "corrupt gzip"}));
}

TEST(Idx, ConcatenatedGzipMembersAreOneStream) {
  ScratchDir dir;
  const std::vector<uint8_t> bytes = labels_file({0, 1, 2, 3, 4, 5});
  const std::vector<uint8_t> head(bytes.begin(), bytes.begin() + 5), tail(bytes.begin() + 5, bytes.end());
  write_file(dir / "a", head, true);
  write_file(dir / "b", tail, true);
  std::vector<uint8_t> joined = testing::read_raw(dir / "a");
  const std::vector<uint8_t> second = testing::read_raw(dir / "b");
  joined.insert(joined.end(), second.begin(), second.end());
  write_file(dir / "labels.gz", joined);
  EXPECT_EQ(read_idx_labels(dir / "labels.gz"), (std::vector<uint8_t>{0, 1, 2, 3, 4, 5}));
}

// Zeros deflate about 1000:1, far past the room the reader makes for a gzip file's data at once (8
// times the file's size): the rest is made as the data arrives, and every byte is read.
TEST(Idx, HighlyCompressibleImagesAreReadWhole) {
  ScratchDir dir;
  constexpr uint32_t kCount = 2000;
  std::vector<uint8_t> pixels(size_t{kCount} * kRows * kCols, 0);
  pixels.back() = 7;
  write_file(dir / "images.gz", images_file(kCount, pixels), /*gzip=*/true);
  ASSERT_LT(testing::read_raw(dir / "images.gz").size() * 8, pixels.size());
  const IdxImages images = read_idx_images(dir / "images.gz");
  EXPECT_EQ(images.count, kCount);
  EXPECT_EQ(images.pixels, pixels);
}

// The real data set, where `apt-get install dataset-fashion-mnist` has put it.
TEST(Idx, RealFashionMnist) {
  if (!file_exists(std::string(kFashionMnistSystemDir) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST is not installed at " << kFashionMnistSystemDir
                 << " (apt-get install dataset-fashion-mnist)";
  }
  const Dataset train = load_mnist_like(kFashionMnistSystemDir, true, "fashion-mnist");
  const Dataset test = load_mnist_like(kFashionMnistSystemDir, false, "fashion-mnist");
  EXPECT_EQ(train.size(), 60000);
  EXPECT_EQ(test.size(), 10000);
  EXPECT_EQ(train.str(), "fashion-mnist/train: 60000 images of 28x28x1, 10 classes");
  EXPECT_EQ(class_histogram(train), std::vector<int64_t>(10, 6000));
  EXPECT_EQ(class_histogram(test), std::vector<int64_t>(10, 1000));
  const Normalization norm = compute_normalization(train);
  EXPECT_NEAR(norm.mean[0], 0.2860, 1e-4);
  EXPECT_NEAR(norm.std[0], 0.3530, 1e-4);
}

}  // namespace
}  // namespace cudp::data
