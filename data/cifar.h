// CIFAR-10 binary batches (https://www.cs.toronto.edu/~kriz/cifar.html, "binary version").
//
// Each file is a run of 3073-byte records: one label byte, then the 32x32 image as three planes
// (all red, all green, all blue, each row-major). cudp keeps images channels-last, so the reader
// interleaves the planes into NHWC 32x32x3. The training split is data_batch_1.bin .. _5.bin (50000
// images), the test split test_batch.bin (10000). A file whose size is not a whole number of
// records, or a label >= 10, is an IoError naming the file (and the record). A batch has no header
// to bound it, so one holding (or decompressing to) more than the whole data set, kCifarMaxRecords,
// is refused before it is read whole: that is what stops a gzip bomb here.
#pragma once

#include <string>

#include "data/dataset.h"

namespace cudp::data {

inline constexpr int64_t kCifarSide = 32;
inline constexpr int64_t kCifarRecordBytes = 1 + 3 * kCifarSide * kCifarSide;  // 3073
inline constexpr int64_t kCifarMaxRecords = 60000;  // train and test together

// One batch file, appended to `out` (whose size and classes it sets).
void read_cifar_batch(const std::string& path, Dataset& out);

// The train or test split from `dir`, or from `dir`/cifar-10-batches-bin (where the archive
// extracts to).
Dataset load_cifar10(const std::string& dir, bool train);

}  // namespace cudp::data
