// The loader on the host: every sample once per epoch, orders that depend on (seed, epoch) only,
// exact resumption, epochs started early, normalisation, padding, augmentation, wait time and
// argument checks.
//
// Most tests use a data set whose label is the sample's index (num_classes = n), so a batch's
// labels say which samples it holds, and whose pixels are a function of (sample, y, x, c), so an
// image can be checked against a reference made here the plain way: pad the uint8 image, crop,
// flip, then normalise.
#include "data/loader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "common/compare.h"
#include "data/data_test_util.h"
#include "engine/core/device.h"

namespace cudp::data {
namespace {

using testing::HostBatch;
using testing::run_epoch;

uint8_t pixel_of(int64_t sample, int64_t y, int64_t x, int64_t c) {
  return static_cast<uint8_t>(1 + (sample * 37 + y * 11 + x * 3 + c * 101) % 250);
}

Dataset indexed_dataset(int64_t n, int64_t h = 6, int64_t w = 5, int64_t c = 1) {
  Dataset d;
  d.name = "indexed";
  d.height = h;
  d.width = w;
  d.channels = c;
  d.num_classes = static_cast<int>(n);
  for (int64_t i = 0; i < n; ++i) {
    d.labels.push_back(static_cast<int32_t>(i));
    for (int64_t y = 0; y < h; ++y) {
      for (int64_t x = 0; x < w; ++x) {
        for (int64_t ch = 0; ch < c; ++ch) d.images.push_back(pixel_of(i, y, x, ch));
      }
    }
  }
  return d;
}

LoaderOptions options(int64_t batch_size, uint64_t seed = 1) {
  LoaderOptions o;
  o.batch_size = batch_size;
  o.seed = seed;
  return o;
}

std::vector<int32_t> labels_of(const std::vector<HostBatch>& batches) {
  std::vector<int32_t> all;
  for (const HostBatch& b : batches) all.insert(all.end(), b.labels.begin(), b.labels.end());
  return all;
}

// The reference: torchvision's order of operations on the uint8 image. Pad by `pad` + `crop` with
// the fill pixel, cut the out_h x out_w window at (crop + dy, crop + dx), mirror it when `flip`,
// normalise. A fill of -1 stands for "0 after normalisation".
std::vector<float> reference_image(const Dataset& d, int64_t sample, int pad, int crop, int dy,
                                   int dx, bool flip, const Normalization& norm, int fill = -1) {
  const int64_t big_h = d.height + 2 * (pad + crop), big_w = d.width + 2 * (pad + crop);
  const int64_t out_h = d.height + 2 * pad, out_w = d.width + 2 * pad, c = d.channels;
  std::vector<int> padded(static_cast<size_t>(big_h * big_w * c), fill);
  for (int64_t y = 0; y < d.height; ++y) {
    for (int64_t x = 0; x < d.width; ++x) {
      for (int64_t ch = 0; ch < c; ++ch) {
        padded[((y + pad + crop) * big_w + x + pad + crop) * c + ch] = d.image(sample)[(y * d.width + x) * c + ch];
      }
    }
  }
  std::vector<float> out;
  for (int64_t y = 0; y < out_h; ++y) {
    for (int64_t x = 0; x < out_w; ++x) {
      const int64_t cx = flip ? out_w - 1 - x : x;
      for (int64_t ch = 0; ch < c; ++ch) {
        const int v = padded[((y + crop + dy) * big_w + cx + crop + dx) * c + ch];
        const size_t k = norm.mean.size() == 1 ? 0 : static_cast<size_t>(ch);
        const float mean = norm.mean.empty() ? 0.f : norm.mean[k];
        const float std = norm.std.empty() ? 1.f : norm.std[k];
        out.push_back(v < 0 ? 0.0f : (static_cast<float>(v) / 255.0f - mean) / std);
      }
    }
  }
  return out;
}

std::vector<float> row_of(const HostBatch& b, size_t row, size_t floats) {
  return {b.images.begin() + static_cast<long>(row * floats),
          b.images.begin() + static_cast<long>((row + 1) * floats)};
}

TEST(Loader, EverySampleExactlyOncePerEpochWithItsPixels) {
  const Dataset d = indexed_dataset(103);
  LoaderOptions o = options(10);
  o.normalization = {{0.5f}, {0.25f}};
  Loader loader(d, o);
  EXPECT_EQ(loader.batches_per_epoch(), 11);
  EXPECT_EQ(loader.image_shape(), (Shape{6, 5, 1}));
  for (int epoch : {0, 1}) {
    loader.start_epoch(epoch);
    std::vector<int32_t> seen;
    Batch b;
    int64_t expected_index = 0;
    while (loader.next(b)) {
      const int64_t rows = expected_index == 10 ? 3 : 10;
      EXPECT_EQ(b.index, expected_index++);
      EXPECT_EQ(b.epoch, epoch);
      EXPECT_EQ(b.images.shape(), (Shape{rows, 6, 5, 1}));
      EXPECT_EQ(b.images.dtype(), DType::f32);
      EXPECT_EQ(b.labels.shape(), (Shape{rows}));
      EXPECT_EQ(b.labels.dtype(), DType::i32);
      const HostBatch host{b.images.to_vector<float>(), b.labels.to_vector<int32_t>(), b.index};
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t sample = host.labels[r];
        seen.push_back(sample);
        EXPECT_ALL_CLOSE(row_of(host, r, 30),
                         reference_image(d, sample, 0, 0, 0, 0, false, o.normalization), 1e-6, 1e-6);
      }
    }
    EXPECT_EQ(expected_index, 11);
    std::sort(seen.begin(), seen.end());
    std::vector<int32_t> all(103);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(seen, all) << "epoch " << epoch;
    EXPECT_FALSE(loader.next(b)) << "the end of an epoch stays the end";
  }
}

TEST(Loader, DropLastDropsTheShortBatch) {
  const Dataset d = indexed_dataset(103);
  LoaderOptions o = options(10);
  o.drop_last = true;
  Loader loader(d, o);
  EXPECT_EQ(loader.batches_per_epoch(), 10);
  const std::vector<int32_t> seen = labels_of(run_epoch(loader, 0));
  EXPECT_EQ(seen.size(), 100u);
  EXPECT_EQ(std::set<int32_t>(seen.begin(), seen.end()).size(), 100u);
}

TEST(Loader, OrderIsAFunctionOfSeedAndEpochOnly) {
  const Dataset d = indexed_dataset(200);
  Loader a(d, options(16, 5)), b(d, options(16, 5)), other_seed(d, options(16, 6));
  const std::vector<int32_t> e0 = labels_of(run_epoch(a, 0)), e1 = labels_of(run_epoch(a, 1));
  EXPECT_NE(e0, e1) << "each epoch has its own order";
  EXPECT_EQ(labels_of(run_epoch(b, 1)), e1) << "same (seed, epoch), same order";
  EXPECT_EQ(labels_of(run_epoch(b, 0)), e0);
  EXPECT_NE(labels_of(run_epoch(other_seed, 0)), e0);
  const std::vector<int64_t> order = a.epoch_order(1);
  EXPECT_EQ(std::vector<int32_t>(order.begin(), order.end()), e1);

  LoaderOptions sequential = options(16, 5);
  sequential.shuffle = false;
  Loader s(d, sequential);
  std::vector<int32_t> identity(200);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(labels_of(run_epoch(s, 3)), identity);
}

TEST(Loader, WorkerCountDoesNotChangeTheBatches) {
  const Dataset d = indexed_dataset(150, 8, 8, 3);
  LoaderOptions o = options(7, 9);
  o.random_crop = 2;
  o.horizontal_flip = true;
  o.workers = 1;
  o.prefetch = 1;
  Loader one(d, o);
  o.workers = 4;
  o.prefetch = 6;
  Loader four(d, o);
  EXPECT_EQ(run_epoch(one, 2), run_epoch(four, 2));
}

TEST(Loader, ResumeAtABatchGivesTheSameRemainingBatches) {
  const Dataset d = indexed_dataset(130, 8, 8, 1);
  LoaderOptions o = options(12, 3);
  o.random_crop = 3;
  o.horizontal_flip = true;
  o.pad = 1;
  Loader full(d, o);
  const std::vector<HostBatch> all = run_epoch(full, 4);
  ASSERT_EQ(all.size(), 11u);

  // A fresh loader, as after a restart from a checkpoint taken after 6 batches.
  Loader resumed(d, o);
  const std::vector<HostBatch> rest = run_epoch(resumed, 4, 6);
  EXPECT_EQ(rest, std::vector<HostBatch>(all.begin() + 6, all.end()));

  // position() is what a checkpoint stores: the epoch and the next batch.
  resumed.start_epoch(4, 0);
  Batch b;
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(resumed.next(b));
  EXPECT_EQ(resumed.position().epoch, 4);
  EXPECT_EQ(resumed.position().batch, 6);
  // Starting the epoch where the loader is keeps the batches being prepared; starting it anywhere
  // else drops them cleanly.
  const LoaderPosition at = resumed.position();
  EXPECT_EQ(run_epoch(resumed, at.epoch, at.batch), rest);
  resumed.start_epoch(4, 0);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(resumed.next(b));
  EXPECT_EQ(run_epoch(resumed, 4, 6), rest);
  EXPECT_TRUE(run_epoch(resumed, 4, 11).empty()) << "resuming at the end gives nothing";
}

// A Dataset served through read() (as an image folder is), counting the samples it produced, and
// failing on sample `fail_at` while `failing` is set.
class CountingSource final : public testing::DatasetSource {
 public:
  using DatasetSource::DatasetSource;

  mutable std::atomic<int64_t> reads{0};
  std::atomic<bool> failing{false};
  int64_t fail_at = -1;

 private:
  void before_read(int64_t index) const override {
    if (failing && index == fail_at) CUDP_THROW(IoError, "sample ", index, " is bad");
    ++reads;
  }
};

TEST(Loader, AnEpochStartedEarlyKeepsWhatItPrepared) {
  const Dataset d = indexed_dataset(103, 6, 5, 1);
  LoaderOptions o = options(10, 7);
  o.normalization = {{0.5f}, {0.25f}};
  o.pad = 2;
  o.random_crop = 2;
  o.horizontal_flip = true;
  o.workers = 2;
  o.prefetch = 4;
  Loader reference(d, o);
  const std::vector<HostBatch> expected = run_epoch(reference, 3);

  CountingSource source(d);
  Loader loader(source, o);
  // Waits until the workers have filled the prefetch window (4 batches of 10): `reads` in all.
  const auto wait_for_reads = [&](int64_t reads) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (source.reads < reads && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(source.reads, reads);
  };
  loader.start_epoch(3);  // early
  wait_for_reads(40);
  EXPECT_EQ(run_epoch(loader, 3), expected);  // starts epoch 3 again, at batch 0
  EXPECT_EQ(source.reads, d.size()) << "the batches prepared early were prepared again";

  // Where the loader is, mid-epoch, too.
  loader.start_epoch(3);
  Batch b;
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(loader.next(b));
  wait_for_reads(d.size() + 80);
  EXPECT_EQ(run_epoch(loader, 3, 4), std::vector<HostBatch>(expected.begin() + 4, expected.end()));
  EXPECT_EQ(source.reads, 2 * d.size());
  // Anywhere else is a new start.
  EXPECT_EQ(run_epoch(loader, 4), run_epoch(reference, 4));
  EXPECT_EQ(run_epoch(loader, 3, 2), std::vector<HostBatch>(expected.begin() + 2, expected.end()));
}

TEST(Loader, AnEpochThatFailedStartsAgain) {
  const Dataset d = indexed_dataset(30);
  LoaderOptions o = options(10);
  o.shuffle = false;
  Loader reference(d, o);
  CountingSource source(d);
  source.fail_at = 3;
  source.failing = true;
  Loader loader(source, o);
  loader.start_epoch(0);
  Batch b;
  EXPECT_TRUE(testing::throws_with<IoError>([&] { loader.next(b); }, {"sample 3 is bad"}));
  source.failing = false;  // a passing fault: the same epoch again reads the sample anew
  EXPECT_EQ(run_epoch(loader, 0), run_epoch(reference, 0));
}

TEST(Loader, NormalisesPerChannel) {
  const Dataset d = indexed_dataset(5, 2, 3, 3);
  for (const Normalization& norm : {Normalization{{0.1f, 0.2f, 0.3f}, {0.5f, 0.25f, 2.0f}},
                                    Normalization{{0.4f}, {0.3f}}, Normalization{}}) {
    LoaderOptions o = options(5);
    o.shuffle = false;
    o.normalization = norm;
    Loader loader(d, o);
    const HostBatch b = run_epoch(loader, 0).at(0);
    for (int64_t s = 0; s < 5; ++s) {
      for (int64_t p = 0; p < 6; ++p) {
        for (int64_t c = 0; c < 3; ++c) {
          const size_t k = norm.mean.size() == 1 ? 0 : static_cast<size_t>(c);
          const float mean = norm.mean.empty() ? 0.f : norm.mean[k];
          const float std = norm.std.empty() ? 1.f : norm.std[k];
          const float expected = (d.image(s)[p * 3 + c] / 255.0f - mean) / std;
          EXPECT_NEAR(b.images[(s * 6 + p) * 3 + c], expected, 1e-6) << s << " " << p << " " << c;
        }
      }
    }
  }
}

TEST(Loader, ComputesNormalisationFromTheTrainSet) {
  Dataset d;
  d.name = "two channels";
  d.height = 1;
  d.width = 4;
  d.channels = 2;
  d.num_classes = 1;
  d.labels = {0, 0};
  // Channel 0 always 51 (0.2), channel 1 alternates 0 and 255 (mean 0.5, std 0.5).
  for (int i = 0; i < 8; ++i) d.images.insert(d.images.end(), {51, static_cast<uint8_t>(i % 2 ? 255 : 0)});
  const Normalization n = compute_normalization(d);
  EXPECT_NEAR(n.mean[0], 0.2, 1e-7);
  EXPECT_NEAR(n.std[0], 0.0, 1e-7);
  EXPECT_NEAR(n.mean[1], 0.5, 1e-7);
  EXPECT_NEAR(n.std[1], 0.5, 1e-7);
}

// compute_normalization as it was first written, one pixel at a time in 64 bits: the reference for
// its blocked 32-bit sums, which must give the same values to the bit.
Normalization normalization_pixel_by_pixel(const Dataset& d) {
  const size_t channels = static_cast<size_t>(d.channels);
  std::vector<uint64_t> sum(channels, 0), sum_sq(channels, 0);
  for (size_t i = 0; i < d.images.size(); ++i) {
    const uint64_t v = d.images[i];
    sum[i % channels] += v;
    sum_sq[i % channels] += v * v;
  }
  const double count = static_cast<double>(d.images.size() / channels);
  Normalization n;
  for (size_t c = 0; c < channels; ++c) {
    const double mean = static_cast<double>(sum[c]) / count / 255.0;
    const double mean_sq = static_cast<double>(sum_sq[c]) / count / (255.0 * 255.0);
    n.mean.push_back(static_cast<float>(mean));
    n.std.push_back(static_cast<float>(std::sqrt(std::max(mean_sq - mean * mean, 0.0))));
  }
  return n;
}

TEST(Loader, NormalisationSumsAreExactOverManyBlocks) {
  // 2^16-pixel blocks: a set of several per channel, the first all 255 (the largest block sums).
  for (const int64_t channels : {1, 3}) {
    SCOPED_TRACE(channels);
    Dataset d = indexed_dataset(5, 180, 170, channels);  // 153,000 pixels per channel
    std::fill_n(d.images.begin(), 70000 * channels, uint8_t{255});
    const Normalization n = compute_normalization(d), want = normalization_pixel_by_pixel(d);
    EXPECT_EQ(n.mean, want.mean);
    EXPECT_EQ(n.std, want.std);
  }
}

TEST(Loader, PadsAroundTheImage) {
  // One 2x3 image padded by 2 to 6x7: the image sits at rows 2-3, columns 2-4.
  const Dataset d = indexed_dataset(1, 2, 3, 1);
  LoaderOptions o = options(1);
  o.pad = 2;
  o.normalization = {{0.5f}, {0.5f}};
  for (const PadFill fill : {PadFill::Zero, PadFill::Pixel}) {
    o.pad_fill = fill;
    o.pad_pixel = 0;
    Loader loader(d, o);
    EXPECT_EQ(loader.image_shape(), (Shape{6, 7, 1}));
    const HostBatch b = run_epoch(loader, 0).at(0);
    const float border = fill == PadFill::Zero ? 0.0f : -1.0f;  // black: (0 - 0.5) / 0.5
    for (int64_t y = 0; y < 6; ++y) {
      for (int64_t x = 0; x < 7; ++x) {
        const bool inside = y >= 2 && y < 4 && x >= 2 && x < 5;
        const float expected = inside ? (pixel_of(0, y - 2, x - 2, 0) / 255.0f - 0.5f) / 0.5f : border;
        EXPECT_NEAR(b.images[y * 7 + x], expected, 1e-6) << "y " << y << " x " << x;
      }
    }
  }
}

// Which (dy, dx, flip) of the reference reproduces `image`, or nothing.
std::optional<std::tuple<int, int, bool>> find_transform(const Dataset& d, int64_t sample,
                                                         const std::vector<float>& image, int pad,
                                                         int crop, const Normalization& norm) {
  for (int dy = -crop; dy <= crop; ++dy) {
    for (int dx = -crop; dx <= crop; ++dx) {
      for (bool flip : {false, true}) {
        if (image == reference_image(d, sample, pad, crop, dy, dx, flip, norm)) {
          return std::tuple{dy, dx, flip};
        }
      }
    }
  }
  return std::nullopt;
}

TEST(Loader, AugmentationIsACropAndFlipFixedBySeedEpochAndSample) {
  const Dataset d = indexed_dataset(120, 7, 9, 2);
  LoaderOptions o = options(16, 11);
  o.pad = 1;
  o.random_crop = 4;
  o.horizontal_flip = true;
  o.normalization = {{0.3f, 0.6f}, {0.2f, 0.4f}};
  Loader loader(d, o), twin(d, o);
  const std::vector<HostBatch> e0 = run_epoch(loader, 0);
  EXPECT_EQ(run_epoch(twin, 0), e0) << "same seed, same augmentation";

  const size_t floats = 9 * 11 * 2;
  std::set<std::pair<int, int>> shifts;
  int flips = 0;
  std::map<int32_t, std::vector<float>> by_sample;
  for (const HostBatch& b : e0) {
    for (size_t r = 0; r < b.labels.size(); ++r) {
      const std::vector<float> image = row_of(b, r, floats);
      const auto t = find_transform(d, b.labels[r], image, 1, 4, o.normalization);
      ASSERT_TRUE(t.has_value()) << "sample " << b.labels[r] << " is not a crop/flip of its image";
      shifts.insert({std::get<0>(*t), std::get<1>(*t)});
      flips += std::get<2>(*t);
      by_sample[b.labels[r]] = image;
    }
  }
  EXPECT_GT(shifts.size(), 40u) << "crops cover the 81 offsets";
  EXPECT_GT(flips, 35);
  EXPECT_LT(flips, 85);

  // A sample's augmentation depends on (seed, epoch, sample), not on where the shuffle put it.
  LoaderOptions in_order = o;
  in_order.shuffle = false;
  Loader sequential(d, in_order);
  for (const HostBatch& b : run_epoch(sequential, 0)) {
    for (size_t r = 0; r < b.labels.size(); ++r) {
      EXPECT_EQ(row_of(b, r, floats), by_sample[b.labels[r]]) << "sample " << b.labels[r];
    }
  }
  // Another epoch draws again.
  int same = 0;
  for (const HostBatch& b : run_epoch(sequential, 1)) {
    for (size_t r = 0; r < b.labels.size(); ++r) same += row_of(b, r, floats) == by_sample[b.labels[r]];
  }
  EXPECT_LT(same, 20);
}

using testing::Gate;
using testing::GatedSource;
using testing::Later;
using testing::OpenAtExit;

TEST(Loader, ReportsTheTimeItWaited) {
  // No batch can be ready before the test lets its reads through, and it does so `delay` after
  // next() began to wait for it (the wait hook): next() waits at least that long by construction,
  // however loaded the machine is.
  constexpr auto delay = std::chrono::milliseconds(20);
  const double delay_s = std::chrono::duration<double>(delay).count();
  const Dataset d = indexed_dataset(64);
  GatedSource source(d);
  Later later;  // declared before the loader, as everything its hook uses: it outlives the loader
  int hooked = 0;
  LoaderOptions o = options(32);
  o.workers = 1;
  o.prefetch = 1;
  Loader loader(source, o);
  const OpenAtExit open_at_exit{source.gate};
  loader.set_wait_hook_for_testing([&](Loader::WaitPoint point, int64_t batch) {
    EXPECT_EQ(point, Loader::WaitPoint::Batch) << "no device reads these buffers";
    EXPECT_EQ(batch, hooked++);
    later.run(delay, [&] { source.gate.open(32); });  // the batch's 32 reads
  });
  loader.start_epoch(0);
  EXPECT_EQ(loader.wait_seconds(), 0.0);
  Batch b;
  double wall = 0;   // what next() took, an upper bound of what it can have waited
  double least = 0;  // summed as the loader sums its waits, so that rounding keeps it below them
  for (int i = 0; i < 2; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(loader.next(b));
    wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    least += delay_s;
    EXPECT_EQ(hooked, i + 1) << "next() waited for batch " << i;
    EXPECT_GE(loader.wait_seconds(), least);
    EXPECT_LE(loader.wait_seconds(), wall);
    // No device reads these buffers (no Batch::record_reader): none of the wait is the device's.
    EXPECT_EQ(loader.device_wait_seconds(), 0.0);
  }
  const double waited = loader.wait_seconds();
  EXPECT_FALSE(loader.next(b));
  EXPECT_EQ(loader.wait_seconds(), waited) << "the end of the epoch is not waited for";
  loader.start_epoch(1);
  EXPECT_EQ(loader.wait_seconds(), 0.0) << "counted per epoch";
  EXPECT_EQ(loader.device_wait_seconds(), 0.0) << "counted per epoch";
}

TEST(Loader, HostMemoryIsPinnedOnlyWhereCudaIs) {
  const Dataset d = indexed_dataset(4);
  Loader loader(d, options(4));
  loader.start_epoch(0);
  Batch b;
  ASSERT_TRUE(loader.next(b));
  EXPECT_EQ(b.images.is_pinned(), cuda::is_available());
  EXPECT_EQ(b.labels.is_pinned(), cuda::is_available());
  EXPECT_TRUE(b.images.is_cpu());
}

TEST(Loader, RejectsBadArguments) {
  const Dataset d = indexed_dataset(10, 4, 4, 3);
  Batch b;
  {
    Loader loader(d, options(4));
    EXPECT_TRUE(testing::throws_with<ValueError>([&] { loader.next(b); }, {"start_epoch"}));
    EXPECT_TRUE(testing::throws_with<ValueError>([&] { loader.start_epoch(0, 4); },
                                                 {"first_batch 4", "[0, 3]"}));
    EXPECT_THROW(loader.start_epoch(-1), ValueError);
  }
  auto bad = [&](auto change, std::initializer_list<std::string> parts) {
    LoaderOptions o = options(4);
    change(o);
    return testing::throws_with<ValueError>([&] { Loader loader(d, o); }, parts);
  };
  EXPECT_TRUE(bad([](LoaderOptions& o) { o.batch_size = 0; }, {"batch_size"}));
  EXPECT_TRUE(bad([](LoaderOptions& o) { o.workers = 0; }, {"workers"}));
  EXPECT_TRUE(bad([](LoaderOptions& o) { o.pad = -1; }, {"pad"}));
  EXPECT_TRUE(bad([](LoaderOptions& o) { o.normalization = {{0.1f, 0.2f}, {1.f, 1.f}}; },
                  {"2 channels", "indexed has 3"}));
  EXPECT_TRUE(bad([](LoaderOptions& o) { o.normalization = {{0.1f}, {0.f}}; }, {"std", "positive"}));
}

}  // namespace
}  // namespace cudp::data
