// The data readers and the loader against what an attacker or a typo hands them: special files where
// a data file is expected (a FIFO must give an error, not a hang), gzip bombs (decompression stops
// at what the header promises or a file of the kind can hold), headers whose sizes overflow, and
// batch sizes and options whose products overflow. Each case is an error naming the file or the
// option, or, for a huge batch size, a loader that works without allocating beyond the data set.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "data/cifar.h"
#include "data/data_test_util.h"
#include "data/file_io.h"
#include "data/idx.h"
#include "data/loader.h"

namespace cudp::data {
namespace {

using testing::ScratchDir;
using testing::throws_with;

// A reader that blocks on a FIFO would hang the test until ctest's timeout; an alarm ends the
// process with a clear signal instead (SIGALRM's default action), long before that.
class HangGuard {
 public:
  HangGuard() { ::alarm(30); }
  ~HangGuard() { ::alarm(0); }
};

void append_be32(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

std::vector<uint8_t> labels_header(uint32_t count) {
  std::vector<uint8_t> out = {0x00, 0x00, 0x08, 0x01};
  append_be32(out, count);
  return out;
}

std::vector<uint8_t> images_header(uint32_t count, uint32_t rows, uint32_t cols) {
  std::vector<uint8_t> out = {0x00, 0x00, 0x08, 0x03};
  append_be32(out, count);
  append_be32(out, rows);
  append_be32(out, cols);
  return out;
}

TEST(HostileInput, AFifoIsRefusedNotWaitedOn) {
  ScratchDir dir;
  const std::string fifo = dir / "train-images-idx3-ubyte";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  HangGuard guard;
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_images(fifo); }, {fifo, "FIFO", "not a"}));
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_labels(fifo); }, {fifo, "FIFO"}));
  EXPECT_TRUE(throws_with<IoError>([&] { read_file(fifo); }, {fifo, "FIFO"}));
  // The directory search skips it (not a regular file) and says the data set is missing.
  EXPECT_TRUE(throws_with<IoError>([&] { load_mnist_like(dir.path(), true); }, {"not found"}));
  Dataset d;
  EXPECT_TRUE(throws_with<IoError>([&] { read_cifar_batch(fifo, d); }, {fifo}));
}

TEST(HostileInput, DirectoriesAndDevicesAreNotDataFiles) {
  ScratchDir dir;
  HangGuard guard;
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_labels(dir.path()); }, {dir.path(), "a directory"}));
  if (std::filesystem::exists("/dev/zero")) {  // a file that never ends
    EXPECT_TRUE(throws_with<IoError>([&] { read_idx_labels("/dev/zero"); },
                                     {"/dev/zero", "a character device"}));
  }
}

TEST(HostileInput, AGzipBombStopsAtWhatTheIdxHeaderPromises) {
  ScratchDir dir;
  // A header promising 10 labels, followed by 256 MiB of zeros: about 250 KB of gzip.
  std::vector<uint8_t> bomb = labels_header(10);
  bomb.resize(bomb.size() + (size_t{256} << 20), 0);
  const std::string path = dir / "t10k-labels-idx1-ubyte.gz";
  write_file(path, bomb, /*gzip=*/true);
  bomb = {};
  // The reader asks the inflater for the 8-byte header, then for 10 + 1 bytes: it stops there.
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_labels(path); },
                                   {path, "is too long", "promises 10 labels",
                                    "more than 18 bytes after decompression"}));
}

TEST(HostileInput, AHeaderPromisingMoreThanTheGzipCanHoldIsRefusedUnread) {
  ScratchDir dir;
  const std::string path = dir / "labels.gz";
  write_file(path, labels_header(0xFFFFFFFFu), /*gzip=*/true);
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_labels(path); },
                                   {path, "4294967295 labels", "more than", "bytes of gzip can hold"}));
  // The same promise uncompressed is a truncated file.
  write_file(dir / "labels", labels_header(0xFFFFFFFFu));
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_labels(dir / "labels"); },
                                   {dir / "labels", "is truncated", "4294967295 labels"}));
}

TEST(HostileInput, IdxSizesThatOverflowOrMakeNoImageAreErrors) {
  ScratchDir dir;
  const std::string path = dir / "images";
  // 2^32-1 cubed overflows 64 bits: the saturated expectation still says "truncated".
  write_file(path, images_header(0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu));
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_images(path); }, {path, "is truncated"}));
  // Found by the IDX fuzzer: a product that overflows only in its last factor, and then the
  // header's 16 bytes on top, used to be signed-overflow UB (a saturated size times 2).
  for (const bool gzip : {false, true}) {
    write_file(path, images_header(0xFFFFFF1Fu, 0x8B080000u, 2), gzip);
    EXPECT_TRUE(throws_with<IoError>([&] { read_idx_images(path); },
                                     {path, "is truncated", "more than 2^63 bytes"}));
  }
  // No images of 2^32-1 x 2^32-1: the file is consistent, the image size is not.
  write_file(path, images_header(0, 0xFFFFFFFFu, 0xFFFFFFFFu));
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_images(path); },
                                   {path, "4294967295x4294967295", "between 1 and 16384"}));
  write_file(path, images_header(0, 0, 28));
  EXPECT_TRUE(throws_with<IoError>([&] { read_idx_images(path); }, {path, "0x28"}));
}

TEST(HostileInput, ACifarBatchBeyondTheWholeDataSetIsRefused) {
  ScratchDir dir;
  const size_t limit = static_cast<size_t>(kCifarMaxRecords * kCifarRecordBytes);
  // Compressed: one record more than the data set, in zeros (label 0 is valid).
  std::vector<uint8_t> bomb(limit + static_cast<size_t>(kCifarRecordBytes), 0);
  const std::string gz = dir / "data_batch_1.bin";
  write_file(gz, bomb, /*gzip=*/true);
  bomb = {};
  Dataset d;
  EXPECT_TRUE(throws_with<IoError>([&] { read_cifar_batch(gz, d); },
                                   {gz, "decompresses to more than", std::to_string(limit)}));
  // Uncompressed and sparse: refused by its size before a byte is read.
  const std::string raw = dir / "data_batch_2.bin";
  const int fd = ::open(raw.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(limit) * 2), 0);
  ::close(fd);
  EXPECT_TRUE(throws_with<IoError>([&] { read_cifar_batch(raw, d); },
                                   {raw, std::to_string(limit * 2) + " bytes, more than"}));
  EXPECT_TRUE(d.labels.empty());
}

Dataset tiny_dataset(int64_t n) {
  Dataset d;
  d.name = "tiny";
  d.height = 2;
  d.width = 3;
  d.channels = 1;
  d.num_classes = 10;
  for (int64_t i = 0; i < n; ++i) {
    d.labels.push_back(static_cast<int32_t>(i % 10));
    for (int p = 0; p < 6; ++p) d.images.push_back(static_cast<uint8_t>(i * 6 + p));
  }
  return d;
}

TEST(HostileInput, AHugeBatchSizeIsOneBatchOfTheWholeDataSet) {
  const Dataset d = tiny_dataset(7);
  for (const int64_t batch_size : {int64_t{8}, int64_t{4'000'000}, INT64_MAX / 2 + 1, INT64_MAX}) {
    SCOPED_TRACE(batch_size);
    for (const bool drop_last : {false, true}) {
      LoaderOptions o;
      o.batch_size = batch_size;
      o.drop_last = drop_last;
      o.shuffle = false;
      Loader loader(d, o);
      EXPECT_EQ(loader.batches_per_epoch(), drop_last ? 0 : 1);
      const auto batches = testing::run_epoch(loader, 0);
      ASSERT_EQ(batches.size(), drop_last ? 0u : 1u);
      if (drop_last) continue;
      EXPECT_EQ(batches[0].labels, d.labels);
      for (size_t i = 0; i < d.images.size(); ++i) {
        ASSERT_EQ(batches[0].images[i], static_cast<float>(d.images[i]) / 255.0f) << i;
      }
    }
  }
}

TEST(HostileInput, LoaderOptionsWhoseSizesOverflowAreErrors) {
  const Dataset d = tiny_dataset(3);
  auto bad = [&](auto change, std::initializer_list<std::string> parts) {
    LoaderOptions o;
    o.batch_size = 2;
    change(o);
    return throws_with<ValueError>([&] { Loader loader(d, o); }, parts);
  };
  // A padded image of (2 + 2^31)^2 pixels, times the batch, overflows 64-bit byte counts.
  EXPECT_TRUE(bad([](LoaderOptions& o) { o.pad = INT32_MAX / 2 + 1; }, {"64-bit"}));
  EXPECT_TRUE(bad([](LoaderOptions& o) { o.workers = 1 << 20; }, {"workers", "[1, 1024]"}));
  EXPECT_TRUE(bad([](LoaderOptions& o) { o.prefetch = INT32_MAX; }, {"prefetch", "[1, 1024]"}));
  EXPECT_TRUE(bad([](LoaderOptions& o) { o.batch_size = -5; }, {"batch_size", "-5"}));
}

TEST(HostileInput, AnInconsistentDatasetIsAnErrorNotAWrap) {
  Dataset d = tiny_dataset(1);
  d.height = int64_t{1} << 32;
  d.width = int64_t{1} << 32;  // height * width wraps to 0 in 64 bits
  d.images.clear();
  d.labels.clear();
  EXPECT_TRUE(throws_with<ValueError>([&] { d.validate(); }, {"tiny", "overflows"}));
}

}  // namespace
}  // namespace cudp::data
