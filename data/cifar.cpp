#include "data/cifar.h"

#include "data/file_io.h"
#include "engine/core/error.h"

namespace cudp::data {
namespace {

constexpr int kClasses = 10;
constexpr int64_t kPlane = kCifarSide * kCifarSide;

// The directory holding the batches: `dir` itself or the folder the archive extracts to.
std::string batches_dir(const std::string& dir) {
  const std::string nested = dir + "/cifar-10-batches-bin";
  return file_exists(nested + "/test_batch.bin") ? nested : dir;
}

}  // namespace

void read_cifar_batch(const std::string& path, Dataset& out) {
  if (!file_exists(path)) {
    CUDP_THROW(IoError, "CIFAR-10 file not found: ", path,
               ". Download the binary version (cifar-10-binary.tar.gz) from "
               "https://www.cs.toronto.edu/~kriz/cifar.html, extract it and pass --data-dir "
               "<the cifar-10-batches-bin directory>");
  }
  const std::vector<uint8_t> bytes =
      read_file(path, static_cast<size_t>(kCifarMaxRecords * kCifarRecordBytes));
  if (bytes.empty() || bytes.size() % kCifarRecordBytes != 0) {
    CUDP_THROW(IoError, path, " is not a CIFAR-10 batch: its ", bytes.size(),
               " bytes are not a whole number of ", kCifarRecordBytes, "-byte records (",
               bytes.size() / kCifarRecordBytes, " records and ", bytes.size() % kCifarRecordBytes,
               " bytes over; truncated?)");
  }
  const int64_t records = static_cast<int64_t>(bytes.size()) / kCifarRecordBytes;
  out.height = out.width = kCifarSide;
  out.channels = 3;
  out.num_classes = kClasses;
  const size_t first = out.images.size();
  out.images.resize(first + static_cast<size_t>(records * 3 * kPlane));
  out.labels.reserve(out.labels.size() + static_cast<size_t>(records));
  for (int64_t r = 0; r < records; ++r) {
    const uint8_t* record = bytes.data() + r * kCifarRecordBytes;
    if (record[0] >= kClasses) {
      CUDP_THROW(IoError, path, ": label ", int{record[0]}, " of record ", r,
                 " is out of range [0, ", kClasses, ")");
    }
    out.labels.push_back(record[0]);
    uint8_t* image = out.images.data() + first + r * 3 * kPlane;
    for (int64_t p = 0; p < kPlane; ++p) {
      for (int64_t c = 0; c < 3; ++c) image[p * 3 + c] = record[1 + c * kPlane + p];
    }
  }
}

Dataset load_cifar10(const std::string& dir, bool train) {
  const std::string base = batches_dir(dir) + "/";
  Dataset d;
  d.name = train ? "cifar10/train" : "cifar10/test";
  if (train) {
    for (int i = 1; i <= 5; ++i) read_cifar_batch(base + "data_batch_" + std::to_string(i) + ".bin", d);
  } else {
    read_cifar_batch(base + "test_batch.bin", d);
  }
  d.validate();
  return d;
}

}  // namespace cudp::data
