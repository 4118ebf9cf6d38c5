// GPU tests of kernels/elementwise.h: every kernel against its CPU reference, bit for bit (each
// element is one IEEE operation, the same on both sides), on fresh random inputs of odd sizes, with
// pointers aligned, misaligned alike (scalar head + float4 body + scalar tail) and misaligned
// differently (all scalar); in place where the API allows it; outputs poisoned first, and the
// poisoned elements around each output checked untouched. ReLU is also checked against cuDNN.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/gpu.h"
#include "common/guarded_buffer.h"
#include "engine/core/stream.h"
#include "engine/core/vendor_check.h"
#include "kernels/elementwise.h"

namespace cudp::kernels {
namespace {

// A typed null: the float and bf16 overloads would make a bare nullptr ambiguous.
constexpr float* kNoFloats = nullptr;

const int64_t kSizes[] = {1, 3, 5, 7, 1023, 1025, (int64_t(1) << 20) + 3};

// Element offsets of the first input, the second input and the output from their (256-byte aligned)
// allocations.
struct Shifts {
  int a, b, out;
};
const Shifts kShifts[] = {{0, 0, 0}, {1, 1, 1}, {3, 3, 3}, {1, 0, 0}, {0, 2, 1}};

// n floats `shift` elements into a poisoned allocation, guard band checked.
using Slice = testing::GuardedBuffer<float>;

std::string where(int64_t n, const Shifts& s) {
  return "n = " + std::to_string(n) + ", shifts (" + std::to_string(s.a) + ", " +
         std::to_string(s.b) + ", " + std::to_string(s.out) + ")";
}

TEST(ElementwiseGpu, ReluForwardMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 100;
  for (int64_t n : kSizes) {
    for (const Shifts& s : kShifts) {
      SCOPED_TRACE(where(n, s));
      const std::vector<float> x = testing::random_vector(n, ++seed);
      std::vector<float> expected(n);
      relu_forward_cpu(x.data(), expected.data(), n);
      Slice dx(n, s.a), dy(n, s.out);
      dx.upload(x);
      relu_forward(dx.get(), dy.get(), n, stream);
      EXPECT_ALL_CLOSE(dy.download(), expected, 0.0, 0.0);
      EXPECT_TRUE(dy.guards_intact());
      // In place.
      Slice xy(n, s.a);
      xy.upload(x);
      relu_forward(xy.get(), xy.get(), n, stream);
      EXPECT_ALL_CLOSE(xy.download(), expected, 0.0, 0.0);
      EXPECT_TRUE(xy.guards_intact());
    }
  }
}

TEST(ElementwiseGpu, ReluBackwardMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 200;
  for (int64_t n : kSizes) {
    for (const Shifts& s : kShifts) {
      SCOPED_TRACE(where(n, s));
      std::vector<float> y = testing::random_vector(n, ++seed);
      relu_forward_cpu(y.data(), y.data(), n);  // a real ReLU output: zeros and positives
      const std::vector<float> g = testing::random_vector(n, ++seed);
      std::vector<float> expected(n);
      relu_backward_cpu(y.data(), g.data(), expected.data(), n);
      Slice dy_out(n, s.a), dg(n, s.b), dx(n, s.out);
      dy_out.upload(y);
      dg.upload(g);
      relu_backward(dy_out.get(), dg.get(), dx.get(), n, stream);
      EXPECT_ALL_CLOSE(dx.download(), expected, 0.0, 0.0);
      EXPECT_TRUE(dx.guards_intact());
      relu_backward(dy_out.get(), dg.get(), dg.get(), n, stream);  // dx aliases dy
      EXPECT_ALL_CLOSE(dg.download(), expected, 0.0, 0.0);
      EXPECT_TRUE(dg.guards_intact());
    }
  }
}

TEST(ElementwiseGpu, ScaleMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 300;
  for (int64_t n : kSizes) {
    for (const Shifts& s : kShifts) {
      SCOPED_TRACE(where(n, s));
      const std::vector<float> x = testing::random_vector(n, ++seed);
      std::vector<float> expected = x;
      scale_cpu(expected.data(), -1.7f, n);
      Slice dx(n, s.out);
      dx.upload(x);
      scale(dx.get(), -1.7f, n, stream);
      EXPECT_ALL_CLOSE(dx.download(), expected, 0.0, 0.0);
      EXPECT_TRUE(dx.guards_intact());
    }
  }
}

TEST(ElementwiseGpu, AxpyMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 400;
  for (int64_t n : kSizes) {
    for (const Shifts& s : kShifts) {
      SCOPED_TRACE(where(n, s));
      const std::vector<float> x = testing::random_vector(n, ++seed);
      const std::vector<float> y = testing::random_vector(n, ++seed);
      std::vector<float> expected = y;
      axpy_cpu(0.3f, x.data(), expected.data(), n);
      Slice dx(n, s.a), dy(n, s.out);
      dx.upload(x);
      dy.upload(y);
      axpy(0.3f, dx.get(), dy.get(), n, stream);
      EXPECT_ALL_CLOSE(dy.download(), expected, 0.0, 0.0);
      EXPECT_TRUE(dy.guards_intact());
    }
  }
}

TEST(ElementwiseGpu, AddMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 500;
  for (int64_t n : kSizes) {
    for (const Shifts& s : kShifts) {
      SCOPED_TRACE(where(n, s));
      const std::vector<float> a = testing::random_vector(n, ++seed);
      const std::vector<float> b = testing::random_vector(n, ++seed);
      std::vector<float> expected(n);
      add_cpu(a.data(), b.data(), expected.data(), n);
      Slice da(n, s.a), db(n, s.b), out(n, s.out);
      da.upload(a);
      db.upload(b);
      add(da.get(), db.get(), out.get(), n, stream);
      EXPECT_ALL_CLOSE(out.download(), expected, 0.0, 0.0);
      EXPECT_TRUE(out.guards_intact());
      add(da.get(), db.get(), da.get(), n, stream);  // out aliases a
      EXPECT_ALL_CLOSE(da.download(), expected, 0.0, 0.0);
    }
  }
}

// More ranges than one launch takes (64), of every length from empty to past 2^20 + some, some
// overlapping, at odd offsets: the GPU zeroes what the reference does and nothing else.
TEST(ElementwiseGpu, ZeroRangesMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  const int64_t n = (int64_t(1) << 21) + 77;
  std::vector<FloatRange> ranges;
  int64_t at = 3;
  for (int r = 0; r < 150; ++r) {
    const int64_t length = r % 7 == 0 ? 0 : r == 40 ? (int64_t(1) << 20) + 5 : (r * 37) % 1500;
    ranges.push_back({at, std::min(n, at + length)});
    at = r % 5 == 0 ? at + length / 2 : at + length + (r % 3);  // every fifth overlaps the next
    if (at >= n) at = n - 1;
  }
  const std::vector<float> data = testing::random_vector(n, 900, 1.f, 2.f);
  std::vector<float> expected = data;
  zero_ranges_cpu(expected.data(), ranges.data(), int64_t(ranges.size()));
  Slice buffer(n, 1);
  buffer.upload(data);
  zero_ranges(buffer.get(), ranges.data(), int64_t(ranges.size()), stream);
  EXPECT_ALL_CLOSE(buffer.download(), expected, 0.0, 0.0);
  EXPECT_TRUE(buffer.guards_intact());
  EXPECT_NO_THROW(zero_ranges(nullptr, nullptr, 0, stream));
  const FloatRange backwards[] = {{4, 2}};
  EXPECT_THROW(zero_ranges(buffer.get(), backwards, 1, stream), ValueError);
}

// flag_non_finite over 150 spans of one buffer (more than one launch's 64), of every length up to
// 2^20 + 5 (and empty ones), with a NaN, +inf or -inf planted in some (first, last or middle
// element), against the CPU reference; flags already set stay set.
TEST(ElementwiseGpu, FlagNonFiniteMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  const int64_t n = (int64_t(1) << 22);
  std::vector<float> data = testing::random_vector(n, 910, -3.f, 3.f);
  Slice buffer(n, 1);
  std::vector<std::pair<int64_t, int64_t>> where;  // (begin, size)
  int64_t at = 0;
  for (int s = 0; s < 150; ++s) {
    const int64_t size = s % 9 == 0 ? 0 : s == 70 ? (int64_t(1) << 20) + 5 : (s * 53) % 3000 + 1;
    where.emplace_back(at, size);
    if (size > 0 && s % 4 == 1) {
      const int64_t k = s % 3 == 0 ? 0 : s % 3 == 1 ? size - 1 : size / 2;
      data[at + k] = s % 8 == 1   ? std::numeric_limits<float>::quiet_NaN()
                     : s % 8 == 5 ? std::numeric_limits<float>::infinity()
                                  : -std::numeric_limits<float>::infinity();
    }
    at += size;
  }
  ASSERT_LE(at, n);
  buffer.upload(data);
  std::vector<FloatSpan> on_host, on_device;
  for (const auto& [begin, size] : where) {
    on_host.push_back({data.data() + begin, size});
    on_device.push_back({buffer.get() + begin, size});
  }
  std::vector<int> expected(where.size(), 0);
  expected[3] = 1;  // set before: stays
  flag_non_finite_cpu(on_host.data(), int64_t(on_host.size()), expected.data());
  int flagged = 0;
  for (int f : expected) flagged += f;
  EXPECT_GT(flagged, 30);
  int* flags = nullptr;
  ASSERT_EQ(cudaMalloc(&flags, where.size() * sizeof(int)), cudaSuccess);
  // Everything on the test's stream (non-blocking: the legacy stream's calls would not be ordered
  // with the kernel), then waited for.
  ASSERT_EQ(cudaMemsetAsync(flags, 0, where.size() * sizeof(int), stream), cudaSuccess);
  const int one = 1;
  ASSERT_EQ(cudaMemcpyAsync(flags + 3, &one, sizeof(int), cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  flag_non_finite(on_device.data(), int64_t(on_device.size()), flags, stream);
  std::vector<int> got(where.size());
  ASSERT_EQ(
      cudaMemcpyAsync(got.data(), flags, got.size() * sizeof(int), cudaMemcpyDeviceToHost, stream),
      cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaFree(flags);
  EXPECT_EQ(got, expected);
  EXPECT_TRUE(buffer.guards_intact());
  const FloatSpan negative[] = {{buffer.get(), -1}};
  int flag = 0;
  EXPECT_THROW(flag_non_finite(negative, 1, &flag, stream), ValueError);
}

TEST(ElementwiseGpu, ZeroSizeLaunchesNothing) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  EXPECT_NO_THROW(relu_forward(kNoFloats, kNoFloats, 0, stream));
  EXPECT_NO_THROW(relu_backward(kNoFloats, kNoFloats, kNoFloats, 0, stream));
  EXPECT_NO_THROW(scale(nullptr, 2.0f, 0, stream));
  EXPECT_NO_THROW(axpy(2.0f, nullptr, nullptr, 0, stream));
  EXPECT_NO_THROW(add(nullptr, nullptr, nullptr, 0, stream));
  EXPECT_THROW(relu_forward(kNoFloats, kNoFloats, 3, stream), ValueError);
  EXPECT_THROW(add(nullptr, nullptr, nullptr, -1, stream), ValueError);
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

TEST(ElementwiseGpu, ReluMatchesCudnn) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  cudnnHandle_t handle = nullptr;
  cudnnTensorDescriptor_t desc = nullptr;
  cudnnActivationDescriptor_t act = nullptr;
  CUDP_CUDNN_CHECK(cudnnCreate(&handle));
  CUDP_CUDNN_CHECK(cudnnSetStream(handle, stream));
  CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&desc));
  CUDP_CUDNN_CHECK(cudnnCreateActivationDescriptor(&act));
  CUDP_CUDNN_CHECK(
      cudnnSetActivationDescriptor(act, CUDNN_ACTIVATION_RELU, CUDNN_PROPAGATE_NAN, 0.0));
  for (int64_t n : {int64_t(1025), (int64_t(1) << 20) + 3}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const std::vector<float> x = testing::random_vector(n, 600 + n);
    CUDP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT,
                                                static_cast<int>(n), 1, 1, 1));
    Slice dx(n, 0), ours(n, 0), theirs(n, 0);
    dx.upload(x);
    relu_forward(dx.get(), ours.get(), n, stream);
    const float one = 1.0f, zero = 0.0f;
    CUDP_CUDNN_CHECK(
        cudnnActivationForward(handle, act, &one, desc, dx.get(), &zero, desc, theirs.get()));
    EXPECT_ALL_CLOSE(ours.download(), theirs.download(), 0.0, 0.0);
  }
  cudnnDestroyActivationDescriptor(act);
  cudnnDestroyTensorDescriptor(desc);
  cudnnDestroy(handle);
}

}  // namespace
}  // namespace cudp::kernels
