// GPU tests of scatter and gather: torch.chunk splits of host (pinned and pageable) and device
// batches, views for chunks already in place, uneven and tiny batches, device orders, round trips
// to every output device, the cross-device memory-lifetime rule, and the caller's streams.
#include <gtest/gtest.h>

#include <numeric>

#include "common/gpu.h"
#include "engine/core/stream.h"
#include "engine/parallel/scatter_gather.h"

namespace cudp::parallel {
namespace {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "(no exception)";
}

std::vector<float> iota(size_t n, float start = 0.f) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

std::vector<float> rows(const std::vector<float>& v, int64_t width, int64_t begin, int64_t end) {
  return {v.begin() + begin * width, v.begin() + end * width};
}

TEST(ScatterGpu, HostBatchOfSevenOnTwoGpusPinnedAndPageable) {
  CUDP_REQUIRE_GPUS(2);
  const auto values = iota(7 * 5);
  const Tensor host = Tensor::from_vector(values, {7, 5});
  for (const Tensor& x : {host, host.pin_memory()}) {
    const TensorList chunks = scatter(x, {0, 1});
    ASSERT_EQ(chunks.size(), 2u);
    EXPECT_EQ(chunks[0].shape(), (Shape{4, 5}));
    EXPECT_EQ(chunks[1].shape(), (Shape{3, 5}));
    EXPECT_EQ(chunks[0].device(), Device::cuda(0));
    EXPECT_EQ(chunks[1].device(), Device::cuda(1));
    EXPECT_EQ(chunks[0].to_vector<float>(), rows(values, 5, 0, 4)) << "pinned " << x.is_pinned();
    EXPECT_EQ(chunks[1].to_vector<float>(), rows(values, 5, 4, 7)) << "pinned " << x.is_pinned();
  }
}

TEST(ScatterGpu, AChunkAlreadyOnItsDeviceIsAView) {
  CUDP_REQUIRE_GPUS(2);
  const auto values = iota(8 * 3, 1.f);
  const Tensor x = Tensor::from_vector(values, {8, 3}, Device::cuda(0));
  const TensorList chunks = scatter(x, {0, 1});
  EXPECT_TRUE(chunks[0].shares_storage(x));
  EXPECT_FALSE(chunks[1].shares_storage(x));
  EXPECT_EQ(chunks[0].to_vector<float>(), rows(values, 3, 0, 4));
  EXPECT_EQ(chunks[1].to_vector<float>(), rows(values, 3, 4, 8));
  // From device 1 in the order (0, 1): the second chunk is the view.
  const Tensor z = Tensor::from_vector(values, {8, 3}, Device::cuda(1));
  const TensorList again = scatter(z, {0, 1});
  EXPECT_FALSE(again[0].shares_storage(z));
  EXPECT_TRUE(again[1].shares_storage(z));
  EXPECT_EQ(again[0].to_vector<float>(), rows(values, 3, 0, 4));
}

TEST(ScatterGpu, BatchOfOneOnTwoGpusUsesTheFirstOnly) {
  CUDP_REQUIRE_GPUS(2);
  const Tensor x = Tensor::from_vector(iota(4), {1, 4});
  const TensorList chunks = scatter(x, {1, 0});
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].device(), Device::cuda(1));
  EXPECT_EQ(chunks[0].to_vector<float>(), iota(4));
}

TEST(ScatterGpu, ExplicitSizesAndDeviceOrder) {
  CUDP_REQUIRE_GPUS(2);
  const auto values = iota(6 * 2);
  const TensorList chunks = scatter(Tensor::from_vector(values, {6, 2}), {1, 0}, {1, 5});
  EXPECT_EQ(chunks[0].device(), Device::cuda(1));
  EXPECT_EQ(chunks[1].device(), Device::cuda(0));
  EXPECT_EQ(chunks[0].to_vector<float>(), rows(values, 2, 0, 1));
  EXPECT_EQ(chunks[1].to_vector<float>(), rows(values, 2, 1, 6));
}

TEST(GatherGpu, RoundTripsToEveryOutputDevice) {
  CUDP_REQUIRE_GPUS(2);
  const auto values = iota(7 * 3 * 2, -10.f);
  const Tensor x = Tensor::from_vector(values, {7, 3, 2});
  for (const std::vector<int>& ids : {std::vector<int>{0, 1}, std::vector<int>{1, 0}}) {
    const TensorList chunks = scatter(x, ids);
    for (int out : {0, 1, -1}) {
      const Tensor y = gather(chunks, out);
      EXPECT_EQ(y.shape(), x.shape());
      EXPECT_EQ(y.device(), out < 0 ? Device::cpu() : Device::cuda(out));
      EXPECT_EQ(y.to_vector<float>(), values) << "ids " << ids[0] << ids[1] << " out " << out;
    }
  }
}

TEST(GatherGpu, OneTensorOnTheOutputDeviceIsReturnedAsItIs) {
  CUDP_REQUIRE_GPU();
  const Tensor x = Tensor::from_vector(iota(6), {2, 3}, Device::cuda(0));
  EXPECT_TRUE(gather({x}, 0).shares_storage(x));
  const Tensor host = gather({x}, -1);
  EXPECT_TRUE(host.is_cpu());
  EXPECT_EQ(host.to_vector<float>(), iota(6));
}

TEST(GatherGpu, ScalarsFromTwoDevices) {
  CUDP_REQUIRE_GPUS(2);
  const Tensor a = Tensor::full({}, 1.5f, Device::cuda(0));
  const Tensor b = Tensor::full({}, 2.5f, Device::cuda(1));
  const Tensor y = gather({a, b}, 0);
  EXPECT_EQ(y.shape(), (Shape{2}));
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{1.5f, 2.5f}));
}

// NOTE [Cross-device copies and memory lifetime]: a source dropped right after scatter/gather is
// freed on its stream after the copy has read it, so memory reused at once is not read
// half-written.
TEST(ScatterGpu, ASourceDroppedAtOnceIsReadBeforeItsMemoryIsReused) {
  CUDP_REQUIRE_GPUS(2);
  const int64_t n = 1 << 22;
  for (int iteration = 0; iteration < 10; ++iteration) {
    TensorList chunks;
    {
      const Tensor source = Tensor::full({2 * n}, 3.f, Device::cuda(0));
      chunks = scatter(source, {0, 1});
      chunks[0] = Tensor();  // drop the view too: only the copy on device 1 still needs the memory
    }
    const Tensor reuse = Tensor::full({2 * n}, -1.f, Device::cuda(0));  // likely the same block
    EXPECT_EQ(chunks[1].to_vector<float>(), std::vector<float>(n, 3.f)) << iteration;
  }
}

TEST(GatherGpu, SourcesDroppedAtOnceAreReadBeforeTheirMemoryIsReused) {
  CUDP_REQUIRE_GPUS(2);
  const int64_t n = 1 << 22;
  for (int iteration = 0; iteration < 10; ++iteration) {
    Tensor gathered;
    {
      const Tensor a = Tensor::full({n}, 1.f, Device::cuda(0));
      const Tensor b = Tensor::full({n}, 2.f, Device::cuda(1));
      gathered = gather({a, b}, 0);
    }
    const Tensor reuse = Tensor::full({n}, -1.f, Device::cuda(1));
    const auto values = gathered.to_vector<float>();
    EXPECT_EQ(std::vector<float>(values.begin() + n, values.end()), std::vector<float>(n, 2.f))
        << iteration;
  }
}

// Copies go to the caller's current streams (a StreamGuard), not to the default streams.
TEST(ScatterGpu, CopiesRunOnTheCallersCurrentStreams) {
  CUDP_REQUIRE_GPUS(2);
  const cuda::Stream s0 = cuda::Stream::create(0);
  const cuda::Stream s1 = cuda::Stream::create(1);
  cuda::StreamGuard g0(0, s0);
  cuda::StreamGuard g1(1, s1);
  const auto values = iota(1 << 20);
  const Tensor x = Tensor::from_vector(values, {1 << 10, 1 << 10}).pin_memory();
  const TensorList chunks = scatter(x, {0, 1});
  const Tensor y = gather(chunks, 1);
  s1.synchronize();  // only s1 (and what it waits for) has to finish for y
  EXPECT_EQ(y.to_vector<float>(), values);
}

TEST(ScatterGpu, InvalidDeviceIdNamesTheRange) {
  CUDP_REQUIRE_GPU();
  const int count = cuda::device_count();
  const std::string text = error_of([&] { scatter(Tensor::zeros({4, 2}), {0, count + 2}); });
  EXPECT_EQ(text.rfind(detail::str("invalid device id ", count + 2, ": valid ids are 0.."), 0), 0u)
      << text;
}

}  // namespace
}  // namespace cudp::parallel
