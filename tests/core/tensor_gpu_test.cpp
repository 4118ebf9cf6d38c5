// GPU tests of the core: copies in every direction (pinned and pageable, odd sizes), device-to-device
// and peer copies, the allocator's statistics, set_device and the guard, streams.
#include <gtest/gtest.h>

#include <numeric>
#include <thread>

#include "common/compare.h"
#include "common/gpu.h"
#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "engine/core/tensor.h"

namespace cudp {
namespace {

std::vector<float> iota_floats(size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(TensorGpu, HostDeviceRoundTripOddSizesPinnedAndPageable) {
  CUDP_REQUIRE_GPU();
  for (int64_t n : {1, 3, 7, 1023, 1025, (1 << 20) + 3}) {
    const auto values = testing::random_vector(static_cast<size_t>(n), 100 + n);
    const Tensor host = Tensor::from_vector(values, {n});
    for (bool pinned : {false, true}) {
      const Tensor src = pinned ? host.pin_memory() : host;
      EXPECT_EQ(src.is_pinned(), pinned);
      const Tensor dev = src.cuda(0);
      EXPECT_EQ(dev.device(), Device::cuda(0));
      EXPECT_EQ(dev.cpu().to_vector<float>(), values) << "n=" << n << " pinned=" << pinned;
    }
  }
}

TEST(TensorGpu, AsyncCopyFromPinnedOnAnExplicitStream) {
  CUDP_REQUIRE_GPU();
  const auto values = iota_floats(4099, -5.f);
  const Tensor pinned = Tensor::from_vector(values, {4099}).pin_memory();
  cuda::Stream stream = cuda::Stream::create(0);
  Tensor dev = Tensor::empty({4099}, DType::f32, Device::cuda(0));
  dev.copy_from(pinned, stream);
  Tensor back = Tensor::empty({4099}, DType::f32, Device::cpu(), /*pinned=*/true);
  back.copy_from(dev, stream);
  stream.synchronize();
  EXPECT_EQ(back.to_vector<float>(), values);
}

TEST(TensorGpu, DeviceToDeviceCopiesAndSlices) {
  CUDP_REQUIRE_GPU();
  const auto values = iota_floats(60, 1.f);
  const Tensor a = Tensor::from_vector(values, {10, 6}, Device::cuda(0));
  const Tensor b = a.clone();
  EXPECT_FALSE(b.shares_storage(a));
  EXPECT_EQ(b.to_vector<float>(), values);
  const Tensor s = a.slice(3, 5).clone();
  EXPECT_EQ(s.to_vector<float>(), std::vector<float>(values.begin() + 18, values.begin() + 30));
}

TEST(TensorGpu, FillAndRandomMatchTheCpuBitForBit) {
  CUDP_REQUIRE_GPU();
  Tensor cpu = Tensor::empty({5001});
  Tensor gpu = Tensor::empty({5001}, DType::f32, Device::cuda(0));
  cpu.uniform_(-1.f, 1.f, 11, 3);
  gpu.uniform_(-1.f, 1.f, 11, 3);
  EXPECT_EQ(gpu.to_vector<float>(), cpu.to_vector<float>());
  cpu.normal_(0.f, 2.f, 12);
  gpu.normal_(0.f, 2.f, 12);
  // normal_ uses logf/cosf, whose device and host implementations may differ in the last ulp.
  EXPECT_ALL_CLOSE(gpu.to_vector<float>(), cpu.to_vector<float>(), 1e-5, 1e-6);
  gpu.fill_(0.25f);
  EXPECT_EQ(gpu.to_vector<float>(), std::vector<float>(5001, 0.25f));
  gpu.zero_();
  EXPECT_EQ(gpu.to_vector<float>(), std::vector<float>(5001, 0.f));
}

TEST(TensorGpu, AllocatorStatisticsFollowTensors) {
  CUDP_REQUIRE_GPU();
  cuda::synchronize(0);
  const size_t before = cuda::memory_allocated(0);
  cuda::reset_peak_memory_stats(0);
  {
    const Tensor big = Tensor::empty({64 << 20}, DType::u8, Device::cuda(0));  // 64 MiB
    cuda::synchronize(0);
    EXPECT_GE(cuda::memory_allocated(0), before + (64u << 20));
    EXPECT_GE(cuda::memory_reserved(0), cuda::memory_allocated(0));
  }
  cuda::synchronize(0);
  EXPECT_LE(cuda::memory_allocated(0), before + (1u << 20));
  EXPECT_GE(cuda::max_memory_allocated(0), before + (64u << 20));
  // The pool keeps what was freed (release threshold raised): reserved stays up.
  EXPECT_GE(cuda::memory_reserved(0), 64u << 20);
  cuda::reset_peak_memory_stats(0);
  EXPECT_LT(cuda::max_memory_allocated(0), before + (64u << 20));
}

TEST(TensorGpu, OutOfMemoryNamesTheDeviceAndTheBytes) {
  CUDP_REQUIRE_GPU();
  try {
    const Tensor huge = Tensor::empty({int64_t(1) << 50}, DType::u8, Device::cuda(0));  // 1 PiB
    FAIL() << "allocated a petabyte";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.message();
    EXPECT_NE(msg.find("out of memory on cuda:0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1125899906842624 bytes"), std::string::npos) << msg;
  }
}

TEST(TensorGpu, SetDeviceAndGuardRestore) {
  CUDP_REQUIRE_GPU();
  const int count = cuda::device_count();
  cuda::set_device(0);
  EXPECT_EQ(cuda::current_device(), 0);
  {
    cuda::DeviceGuard guard(count - 1);
    EXPECT_EQ(cuda::current_device(), count - 1);
  }
  EXPECT_EQ(cuda::current_device(), 0);
  EXPECT_THROW(cuda::set_device(count), ValueError);
  EXPECT_EQ(cuda::current_device(), 0);
  const auto props = cuda::get_device_properties(0);
  EXPECT_GT(props.multiprocessors, 0);
  EXPECT_GT(props.total_memory, 0u);
  EXPECT_FALSE(props.pci_bus_id.empty());
}

TEST(TensorGpu, StreamGuardIsPerThread) {
  CUDP_REQUIRE_GPU();
  cuda::Stream mine = cuda::Stream::create(0);
  const cudaStream_t default_stream = cuda::current_stream(0);
  {
    cuda::StreamGuard guard(0, mine);
    EXPECT_EQ(cuda::current_stream(0), mine.get());
    cudaStream_t other_thread = nullptr;
    std::thread([&] { other_thread = cuda::current_stream(0); }).join();
    EXPECT_EQ(other_thread, default_stream);
  }
  EXPECT_EQ(cuda::current_stream(0), default_stream);
}

// NOTE [Memory that outlives its stream] (engine/core/memory.h): tensors made under a StreamGuard
// of a stream that is then destroyed keep their values and are freed afterwards without touching
// the dead stream. Without the allocator's record of retired streams, the frees below call
// cudaFreeAsync on a destroyed stream: a graphed reducer test that did this crashed in the driver.
TEST(TensorGpu, TensorsOutliveTheStreamTheyWereMadeOn) {
  CUDP_REQUIRE_GPU();
  std::vector<Tensor> kept;
  std::vector<std::vector<float>> expected;
  for (int round = 0; round < 3; ++round) {
    const cuda::Stream stream = cuda::Stream::create(0);
    const cuda::StreamGuard guard(0, stream);
    for (int i = 0; i < 8; ++i) {
      const auto values = iota_floats(1000 + static_cast<size_t>(i), float(round * 100 + i));
      kept.push_back(Tensor::from_vector(values, {1000 + i}).cuda(0));
      Tensor filled = Tensor::empty({257}, DType::f32, Device::cuda(0));
      filled.fill_(float(i));  // queued on the stream, which its destructor waits for
      kept.push_back(filled);
      expected.push_back(values);
      expected.push_back(std::vector<float>(257, float(i)));
    }
  }
  for (size_t k = 0; k < kept.size(); ++k) EXPECT_EQ(kept[k].cpu().to_vector<float>(), expected[k]);
  kept.clear();  // every one freed after its stream was destroyed
  // A stream made now may get a destroyed one's handle: memory made on it is freed on it.
  const cuda::Stream fresh = cuda::Stream::create(0);
  {
    const cuda::StreamGuard guard(0, fresh);
    const auto values = iota_floats(4096, 3.f);
    EXPECT_EQ(Tensor::from_vector(values, {4096}).cuda(0).cpu().to_vector<float>(), values);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(TensorGpu, PeerCopiesBetweenTwoGpusBothWays) {
  CUDP_REQUIRE_GPUS(2);
  const auto matrix = cuda::peer_access_matrix();
  ASSERT_EQ(matrix.size(), static_cast<size_t>(cuda::device_count()));
  for (int64_t n : {1, 5, 100003}) {
    const auto values = testing::random_vector(static_cast<size_t>(n), 7 * n);
    const Tensor on0 = Tensor::from_vector(values, {n}, Device::cuda(0));
    const Tensor on1 = on0.to(Device::cuda(1));
    EXPECT_EQ(on1.device(), Device::cuda(1));
    EXPECT_EQ(on1.to_vector<float>(), values);
    const Tensor back = on1.to(Device::cuda(0));
    EXPECT_EQ(back.to_vector<float>(), values);
  }
}

}  // namespace
}  // namespace cudp
