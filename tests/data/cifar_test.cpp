// CIFAR-10 binary batches: planar records become NHWC images; bad sizes, labels and missing files
// are errors that name the file.
#include "data/cifar.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "data/data_test_util.h"
#include "data/file_io.h"

namespace cudp::data {
namespace {

using testing::ScratchDir;
using testing::throws_with;

// Record r's byte for channel c at (y, x): a value that tells all four apart (mod 256).
uint8_t pixel(int64_t r, int64_t c, int64_t y, int64_t x) {
  return static_cast<uint8_t>(r * 31 + c * 89 + y * 5 + x * 3);
}

// `labels.size()` records laid out as the format says: label, then the R, G and B planes.
std::vector<uint8_t> batch_file(const std::vector<uint8_t>& labels, int64_t first_record = 0) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i < labels.size(); ++i) {
    out.push_back(labels[i]);
    for (int64_t c = 0; c < 3; ++c) {
      for (int64_t y = 0; y < 32; ++y) {
        for (int64_t x = 0; x < 32; ++x) out.push_back(pixel(first_record + i, c, y, x));
      }
    }
  }
  return out;
}

TEST(Cifar, RecordsBecomeNhwcImages) {
  ScratchDir dir;
  write_file(dir / "test_batch.bin", batch_file({3, 9, 0}));
  Dataset d;
  read_cifar_batch(dir / "test_batch.bin", d);
  ASSERT_EQ(d.size(), 3);
  EXPECT_EQ(d.height, 32);
  EXPECT_EQ(d.width, 32);
  EXPECT_EQ(d.channels, 3);
  EXPECT_EQ(d.num_classes, 10);
  EXPECT_EQ(d.labels, (std::vector<int32_t>{3, 9, 0}));
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t y = 0; y < 32; ++y) {
      for (int64_t x = 0; x < 32; ++x) {
        for (int64_t c = 0; c < 3; ++c) {
          ASSERT_EQ(d.image(r)[(y * 32 + x) * 3 + c], pixel(r, c, y, x))
              << "record " << r << " y " << y << " x " << x << " c " << c;
        }
      }
    }
  }
}

TEST(Cifar, LoadsTheSplitsFromTheExtractedFolder) {
  ScratchDir dir;
  const std::string batches = dir / "cifar-10-batches-bin";
  std::filesystem::create_directory(batches);
  for (int i = 1; i <= 5; ++i) {
    write_file(batches + "/data_batch_" + std::to_string(i) + ".bin",
               batch_file({static_cast<uint8_t>(i), static_cast<uint8_t>(i + 1)}, 2 * (i - 1)));
  }
  write_file(batches + "/test_batch.bin", batch_file({7}), /*gzip=*/true);  // gzip works too
  for (const std::string& where : {dir.path(), batches}) {
    const Dataset train = load_cifar10(where, true);
    EXPECT_EQ(train.name, "cifar10/train");
    EXPECT_EQ(train.size(), 10);
    EXPECT_EQ(train.labels, (std::vector<int32_t>{1, 2, 2, 3, 3, 4, 4, 5, 5, 6}));
    EXPECT_EQ(train.image(9)[(4 * 32 + 5) * 3 + 2], pixel(9, 2, 4, 5));  // files in order
    const Dataset test = load_cifar10(where, false);
    EXPECT_EQ(test.size(), 1);
    EXPECT_EQ(test.labels[0], 7);
  }
}

TEST(Cifar, SizeMustBeWholeRecords) {
  ScratchDir dir;
  std::vector<uint8_t> bytes = batch_file({1, 2});
  bytes.erase(bytes.end() - 10, bytes.end());
  write_file(dir / "test_batch.bin", bytes);
  Dataset d;
  EXPECT_TRUE(throws_with<IoError>([&] { read_cifar_batch(dir / "test_batch.bin", d); },
                                   {dir / "test_batch.bin", "6136 bytes", "3073-byte records",
                                    "1 records and 3063 bytes over"}));
  write_file(dir / "test_batch.bin", std::vector<uint8_t>{});
  EXPECT_TRUE(throws_with<IoError>([&] { load_cifar10(dir.path(), false); },
                                   {dir / "test_batch.bin", "0 bytes"}));
}

TEST(Cifar, LabelOutOfRangeNamesTheRecord) {
  ScratchDir dir;
  write_file(dir / "test_batch.bin", batch_file({1, 10, 2}));
  EXPECT_TRUE(throws_with<IoError>([&] { load_cifar10(dir.path(), false); },
                                   {dir / "test_batch.bin", "label 10 of record 1",
                                    "out of range [0, 10)"}));
}

TEST(Cifar, MissingFileSaysHowToGetIt) {
  ScratchDir dir;
  EXPECT_TRUE(throws_with<IoError>([&] { load_cifar10(dir.path(), true); },
                                   {dir / "data_batch_1.bin", "not found", "cifar-10-binary.tar.gz",
                                    "--data-dir"}));
}

}  // namespace
}  // namespace cudp::data
