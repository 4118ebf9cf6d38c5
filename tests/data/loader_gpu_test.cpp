// DevicePrefetcher on GPUs: what arrives on each device equals the host batch (whole, or its
// torch.chunk share), on one device and on two.
//
// The reference is a second loader with the same options (a loader's output is a pure function of
// its options and the epoch). The compute stream is slowed with a sleeping host function at every
// step while the host keeps every device batch and never synchronises: the copies then run late
// while the loader's workers want to refill pinned buffers, so a missing event fence would show up
// as a batch holding another batch's data.
#include "data/prefetcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "common/gpu.h"
#include "data/data_test_util.h"
#include "data/synthetic.h"
#include "engine/core/stream.h"

namespace cudp::data {
namespace {

using testing::HostBatch;

Dataset synthetic_set(int64_t n) {
  SyntheticOptions s;
  s.n_train = n;
  s.seed = 4;
  return make_synthetic(s, true);
}

LoaderOptions pipeline_options(const Dataset& d, int64_t batch_size) {
  LoaderOptions o;
  o.batch_size = batch_size;
  o.seed = 21;
  o.normalization = compute_normalization(d);
  o.pad = 2;
  o.random_crop = 2;
  o.horizontal_flip = true;
  o.workers = 2;
  o.prefetch = 1;  // the fewest buffers: each is refilled as soon as the fences allow
  return o;
}

void CUDART_CB sleep_a_little(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(3)); }

// Holds up `device`'s current stream for a while, as a long compute step would.
void slow_compute(int device) {
  CUDP_CUDA_CHECK(cudaLaunchHostFunc(cuda::current_stream(device), sleep_a_little, nullptr));
}

// Runs an epoch through a prefetcher, keeping every device batch, then compares each device's part
// with the reference's rows [begin, end) (torch.chunk's when `split`, all rows otherwise).
void expect_epoch_matches(const std::vector<int>& devices, bool split, const Dataset& d,
                          const LoaderOptions& o, int epoch) {
  Loader reference_loader(d, o);
  const std::vector<HostBatch> expected = testing::run_epoch(reference_loader, epoch);

  Loader loader(d, o);
  DevicePrefetcher prefetcher(loader, devices, split);
  prefetcher.start_epoch(epoch);
  std::vector<DeviceBatch> arrived;
  DeviceBatch b;
  while (prefetcher.next(b)) {
    for (int device : devices) slow_compute(device);
    arrived.push_back(std::move(b));
  }
  ASSERT_EQ(arrived.size(), expected.size());

  const int64_t pixels = 32 * 32 * d.channels;
  const int64_t n = static_cast<int64_t>(devices.size());
  for (size_t k = 0; k < expected.size(); ++k) {
    EXPECT_EQ(arrived[k].index, static_cast<int64_t>(k));
    EXPECT_EQ(arrived[k].epoch, epoch);
    const int64_t rows = static_cast<int64_t>(expected[k].labels.size());
    const int64_t chunk = split ? (rows + n - 1) / n : rows;
    for (int64_t j = 0; j < n; ++j) {
      SCOPED_TRACE(::testing::Message() << "batch " << k << " on cuda:" << devices[j]);
      const int64_t begin = split ? std::min(j * chunk, rows) : 0;
      const int64_t end = split ? std::min(begin + chunk, rows) : rows;
      const Tensor& images = arrived[k].images[j];
      const Tensor& labels = arrived[k].labels[j];
      EXPECT_EQ(images.device(), Device::cuda(devices[j]));
      EXPECT_EQ(images.shape(), (Shape{end - begin, 32, 32, d.channels}));
      EXPECT_EQ(labels.shape(), (Shape{end - begin}));
      const std::vector<float> want_images(expected[k].images.begin() + begin * pixels,
                                           expected[k].images.begin() + end * pixels);
      const std::vector<int32_t> want_labels(expected[k].labels.begin() + begin,
                                             expected[k].labels.begin() + end);
      EXPECT_EQ(images.to_vector<float>(), want_images);
      EXPECT_EQ(labels.to_vector<int32_t>(), want_labels);
    }
  }
}

TEST(DevicePrefetcher, CopiesEqualTheHostBatchOnOneDevice) {
  CUDP_REQUIRE_GPU();
  const Dataset d = synthetic_set(1000);
  expect_epoch_matches({0}, false, d, pipeline_options(d, 64), 3);
}

TEST(DevicePrefetcher, CopiesEqualTheHostBatchOnTwoDevices) {
  CUDP_REQUIRE_GPUS(2);
  const Dataset d = synthetic_set(1000);
  expect_epoch_matches({0, 1}, false, d, pipeline_options(d, 64), 0);
  expect_epoch_matches({1, 0}, false, d, pipeline_options(d, 64), 1);
}

TEST(DevicePrefetcher, SplitGivesEachDeviceItsChunk) {
  CUDP_REQUIRE_GPUS(2);
  // Batches of 37 split 19 + 18; the last batch has a single row: 1 + 0.
  const Dataset d = synthetic_set(37 * 6 + 1);
  expect_epoch_matches({0, 1}, true, d, pipeline_options(d, 37), 2);
}

TEST(DevicePrefetcher, RestartsAnEpochWithACopyInFlight) {
  CUDP_REQUIRE_GPU();
  const Dataset d = synthetic_set(500);
  const LoaderOptions o = pipeline_options(d, 50);
  Loader reference_loader(d, o);
  const std::vector<HostBatch> expected = testing::run_epoch(reference_loader, 5, 4);

  Loader loader(d, o);
  DevicePrefetcher prefetcher(loader, {0});
  prefetcher.start_epoch(0);
  DeviceBatch b;
  ASSERT_TRUE(prefetcher.next(b));  // batch 1 is now being copied
  prefetcher.start_epoch(5, 4);     // as a resumed run would
  for (const HostBatch& want : expected) {
    ASSERT_TRUE(prefetcher.next(b));
    EXPECT_EQ(b.index, want.index);
    EXPECT_EQ(b.images[0].to_vector<float>(), want.images);
    EXPECT_EQ(b.labels[0].to_vector<int32_t>(), want.labels);
  }
  EXPECT_FALSE(prefetcher.next(b));
}

void CUDART_CB sleep_20_ms(void*) {
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

// A device-bound epoch: each step holds the compute stream for 20 ms while the loader prepares a
// small batch in well under a millisecond. The host runs ahead until the loader's buffers wait for
// the copies queued behind those steps, so next() spends most of the epoch waiting, and that wait
// is the device's (device_wait_seconds()), not the input pipeline's (wait_seconds()): a trainer
// that printed it as input wait would send its user adding workers to a GPU-bound run.
TEST(DevicePrefetcher, AWaitForTheDeviceIsNotInputWait) {
  CUDP_REQUIRE_GPU();
  const Dataset d = synthetic_set(320);
  Loader loader(d, pipeline_options(d, 32));  // 10 batches, 2 buffers
  DevicePrefetcher prefetcher(loader, {0});
  prefetcher.start_epoch(0);
  DeviceBatch b;
  const auto start = std::chrono::steady_clock::now();
  int batches = 0;
  while (prefetcher.next(b)) {
    CUDP_CUDA_CHECK(cudaLaunchHostFunc(cuda::current_stream(0), sleep_20_ms, nullptr));
    ++batches;
  }
  CUDP_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream(0)));
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(batches, 10);
  // 10 steps of 20 ms, of which the last 2 or 3 run after the last next() returned: the consumer
  // waited for the device during at least 5 of them.
  EXPECT_GT(loader.device_wait_seconds(), 0.1) << "wall " << wall << " s";
  EXPECT_LT(loader.device_wait_seconds(), wall);
  EXPECT_LT(loader.wait_seconds(), 0.25 * loader.device_wait_seconds())
      << "the device's wait counted as input wait";
}

// A Dataset served through read(), at `delay` per sample: a source that takes a while to decode.
class SlowSource final : public testing::DatasetSource {
 public:
  SlowSource(const Dataset& d, std::chrono::microseconds delay) : DatasetSource(d), delay_(delay) {}

 private:
  void before_read(int64_t) const override { std::this_thread::sleep_for(delay_); }
  std::chrono::microseconds delay_;
};

// The same device-bound epoch with batches that take 8 ms to fill (32 samples of 0.5 ms on 2
// workers) against steps of 20 ms. Once the host is ahead, a buffer comes free only when the device
// has run the copy that read it, and the batch then filled in it is waited for too: that filling is
// the device's wait as well (NOTE [What the consumer waited for]); counted as input wait, it was
// ~40% of the wait, and a trainer printed a device-bound run as waiting for its input. The first
// batches, in buffers no copy has read yet, are the input pipeline's.
TEST(DevicePrefetcher, FillingABufferTheDeviceLetGoIsTheDevicesWait) {
  CUDP_REQUIRE_GPU();
  const Dataset d = synthetic_set(960);
  const SlowSource source(d, std::chrono::microseconds(500));
  Loader loader(source, pipeline_options(d, 32));  // 30 batches, 2 buffers
  DevicePrefetcher prefetcher(loader, {0});
  prefetcher.start_epoch(0);
  DeviceBatch b;
  int batches = 0;
  while (prefetcher.next(b)) {
    CUDP_CUDA_CHECK(cudaLaunchHostFunc(cuda::current_stream(0), sleep_20_ms, nullptr));
    ++batches;
  }
  CUDP_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream(0)));
  ASSERT_EQ(batches, 30);
  EXPECT_GT(loader.device_wait_seconds(), 0.2);
  EXPECT_LT(loader.wait_seconds(), 0.25 * loader.device_wait_seconds())
      << "the filling after the device let a buffer go counted as input wait";
}

TEST(DevicePrefetcher, HostBuffersArePinned) {
  CUDP_REQUIRE_GPU();
  const Dataset d = synthetic_set(100);
  Loader loader(d, pipeline_options(d, 10));
  loader.start_epoch(0);
  Batch b;
  ASSERT_TRUE(loader.next(b));
  EXPECT_TRUE(b.images.is_pinned());
  EXPECT_TRUE(b.labels.is_pinned());
}

TEST(DevicePrefetcher, RejectsBadDevices) {
  CUDP_REQUIRE_GPU();
  const Dataset d = synthetic_set(100);
  Loader loader(d, pipeline_options(d, 10));
  EXPECT_THROW(DevicePrefetcher(loader, {}), ValueError);
  EXPECT_THROW(DevicePrefetcher(loader, {cuda::device_count()}), ValueError);
  EXPECT_TRUE(testing::throws_with<ValueError>([&] { DevicePrefetcher(loader, {0, 0}); },
                                               {"device 0 is listed twice"}));
}

}  // namespace
}  // namespace cudp::data
