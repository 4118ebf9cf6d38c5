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
#include <condition_variable>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

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

using testing::Gate;
using testing::GatedSource;
using testing::Later;

// A compute step that lasts until the test lets it through `gate` (a Gate*): the steps of a stream
// pass it in the order they were queued.
void CUDART_CB pass_gate(void* gate) {
  static_cast<Gate*>(gate)->pass();
}

// The loader's counters after the call that prepared batch k, and how long that call took.
struct Counted {
  double input, device, wall;
};

// Runs epoch 0 of a loader of `source` (options `o`, prefetch 1: two buffers, used in turn) through
// a DevicePrefetcher on device 0, device-bound by construction, and counts after each batch. The
// step on each batch holds the compute stream at a gate (`steps`), and the copy of batch k waits
// for the steps queued before it (Tensor::copy_from), so the buffer of batch k, refilled for batch
// k + 2, stays the device's until the test lets step k through. The test asks for batch k + 2 only
// once the worker taking that buffer has found the copy still to run (the loader's
// WaitPoint::Device), and lets step k through `delay` after next() began to wait
// (WaitPoint::Batch). So from batch 2 on next() waits, for at least `delay` and then the batch's
// filling, all of it after the worker began to take the buffer: all of it the device's wait.
// Batches 0 and 1 are filled in buffers no copy has read: the input pipeline's (the source's reads
// are held until `delay` after next() began to wait for batch 0).
void run_device_bound_epoch(const GatedSource& source, const LoaderOptions& o,
                            std::chrono::milliseconds delay, std::vector<Counted>& counted) {
  ASSERT_EQ(o.prefetch, 1);
  // Declared before the loader: everything its hook uses outlives it.
  Gate steps;
  std::mutex mutex;
  std::condition_variable device_waits;
  std::set<int64_t> device_waited;  // batches whose buffer a worker waited for the device to free
  Later later;
  const cudaStream_t compute = cuda::current_stream(0);
  Loader loader(source, o);
  loader.set_wait_hook_for_testing([&](Loader::WaitPoint point, int64_t batch) {
    std::lock_guard lock(mutex);
    if (point == Loader::WaitPoint::Device) {
      device_waited.insert(batch);
      device_waits.notify_all();
    } else if (batch == 0) {
      later.run(delay, [&] { source.gate.open_for_good(); });
    } else if (device_waited.contains(batch)) {
      later.run(delay, [&] { steps.open(1); });
    }
  });
  DevicePrefetcher prefetcher(loader, {0});
  // Whatever happens (a failed ASSERT included): no step or read stays held, and no step runs after
  // `steps` is gone; the loader's workers then finish before its destructor waits for them.
  struct Release {
    Gate& steps;
    Gate& reads;
    cudaStream_t compute;
    ~Release() {
      steps.open_for_good();
      reads.open_for_good();
      cudaStreamSynchronize(compute);
    }
  } release{steps, source.gate, compute};
  const auto step = [&] { CUDP_CUDA_CHECK(cudaLaunchHostFunc(compute, pass_gate, &steps)); };
  // Runs `call` (which calls the loader's next() once) and counts.
  const auto count = [&](auto call) {
    const auto start = std::chrono::steady_clock::now();
    call();
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    counted.push_back({loader.wait_seconds(), loader.device_wait_seconds(), wall});
  };

  const int64_t batches = loader.batches_per_epoch();
  step();                                     // step 0: the copy of batch 0 waits for it
  count([&] { prefetcher.start_epoch(0); });  // prepares batch 0
  step();                                     // step 1: the copy of batch 1 waits for it
  DeviceBatch b;
  for (int64_t k = 0; k < batches; ++k) {
    if (k + 1 >= 2 && k + 1 < batches) {
      // The worker preparing batch k + 1 has found the copy of batch k - 1 (behind step k - 1,
      // still held) yet to read its buffer.
      std::unique_lock lock(mutex);
      ASSERT_TRUE(device_waits.wait_for(lock, std::chrono::seconds(60),
                                        [&] { return device_waited.contains(k + 1); }))
          << "the worker preparing batch " << k + 1 << " never waited for the device";
    }
    bool more = false;
    count([&] { more = prefetcher.next(b); });  // returns batch k, prepares batch k + 1
    ASSERT_TRUE(more);
    EXPECT_EQ(b.index, k);
    step();  // step k + 2, the step on batch k: the copy of batch k + 2 waits for it
  }
  EXPECT_FALSE(prefetcher.next(b));
  const size_t n = static_cast<size_t>(batches);
  ASSERT_EQ(counted.size(), n + 1);
  // The last count is of a next() that found the end of the epoch: nothing to wait for.
  EXPECT_EQ(counted[n].input, counted[n - 1].input);
  EXPECT_EQ(counted[n].device, counted[n - 1].device);
  counted.pop_back();
}

// Checks what run_device_bound_epoch counted: at least `input` of input wait for batch 0, none of
// the device's for batches 0 and 1, and from batch 2 on at least `device` of the device's wait per
// batch and no input wait at all.
void expect_device_bound(const std::vector<Counted>& counted, std::chrono::microseconds input,
                         std::chrono::microseconds device) {
  const auto seconds = [](auto d) { return std::chrono::duration<double>(d).count(); };
  double least = 0;  // summed as the loader sums, so that rounding keeps it below its sums
  double wall = 0;
  for (size_t k = 0; k < counted.size(); ++k) {
    SCOPED_TRACE(::testing::Message() << "batch " << k);
    const Counted& c = counted[k];
    wall += c.wall;
    if (k == 0) {
      EXPECT_GE(c.input, seconds(input)) << "next() waited for the reads held";
    }
    if (k < 2) {
      EXPECT_EQ(c.device, 0.0) << "a buffer no copy read is the input pipeline's";
      continue;
    }
    least += seconds(device);
    EXPECT_GE(c.device, least);
    EXPECT_EQ(c.input, counted[k - 1].input) << "the device's wait counted as input wait";
    EXPECT_LE(c.device, wall);
  }
  EXPECT_LE(counted.back().input, wall);
}

// A device-bound epoch: the host runs ahead until the loader's buffers wait for the copies queued
// behind the device's steps, so next() spends most of the epoch waiting, and that wait is the
// device's (device_wait_seconds()), not the input pipeline's (wait_seconds()): a trainer that
// printed it as input wait would send its user adding workers to a GPU-bound run. The loader fills
// these small batches in well under a millisecond.
TEST(DevicePrefetcher, AWaitForTheDeviceIsNotInputWait) {
  CUDP_REQUIRE_GPU();
  constexpr auto delay = std::chrono::milliseconds(20);
  const Dataset d = synthetic_set(320);
  const GatedSource source(d);
  std::vector<Counted> counted;
  ASSERT_NO_FATAL_FAILURE(run_device_bound_epoch(source, pipeline_options(d, 32), delay, counted));
  ASSERT_EQ(counted.size(), 10u);
  expect_device_bound(counted, delay, delay);
}

// The same device-bound epoch with batches that take a while to fill: 32 samples of at least 0.5
// ms on 2 workers, 16 each, after the buffer came free. Once the host is ahead, a buffer comes free
// only when the device has run the copy that read it, and the batch then filled in it is waited for
// too: that filling is the device's wait as well (NOTE [What the consumer waited for]); counted as
// input wait, it was ~40% of the wait, and a trainer printed a device-bound run as waiting for its
// input. The first batches, in buffers no copy has read yet, are the input pipeline's.
TEST(DevicePrefetcher, FillingABufferTheDeviceLetGoIsTheDevicesWait) {
  CUDP_REQUIRE_GPU();
  constexpr auto delay = std::chrono::milliseconds(20);
  constexpr auto read = std::chrono::microseconds(500);
  const Dataset d = synthetic_set(960);
  const GatedSource source(d, read);
  std::vector<Counted> counted;
  ASSERT_NO_FATAL_FAILURE(run_device_bound_epoch(source, pipeline_options(d, 32), delay, counted));
  ASSERT_EQ(counted.size(), 30u);
  // Each of the 2 workers reads its 16 rows one after the other once the buffer is free.
  expect_device_bound(counted, delay, delay + 16 * read);
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
