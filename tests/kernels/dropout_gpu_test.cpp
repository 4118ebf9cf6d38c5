// GPU tests of kernels/dropout.h: the GPU's output equals the CPU reference's bit for bit (the same
// mask and the same single multiply) for odd sizes, every alignment case (float4 body with one
// Philox call per float4, body straddling two counters, all scalar), offsets around multiples of 4
// and across the 64-bit wrap; backward regenerates the forward's mask; p == 0 is the identity.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/gpu.h"
#include "common/guarded_buffer.h"
#include "engine/core/stream.h"
#include "kernels/dropout.h"

namespace cudp::kernels {
namespace {

const int64_t kSizes[] = {1, 3, 5, 7, 1023, 1025, (int64_t(1) << 20) + 3};
// (input, output) element offsets from their allocations.
const std::pair<int, int> kShifts[] = {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {1, 0}, {0, 3}};
const uint64_t kOffsets[] = {
    0, 1, 2, 3, 5, (uint64_t(1) << 40) + 2, std::numeric_limits<uint64_t>::max() - 5};

// n floats `shift` elements into a poisoned allocation, guard band checked.
using Slice = testing::GuardedBuffer<float>;

std::string where(int64_t n, std::pair<int, int> shifts, uint64_t offset, float p) {
  return "n = " + std::to_string(n) + ", shifts " + std::to_string(shifts.first) + "/" +
         std::to_string(shifts.second) + ", offset " + std::to_string(offset) +
         ", p = " + std::to_string(p);
}

TEST(DropoutGpu, ForwardAndBackwardMatchCpuBitForBit) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 1000;
  for (int64_t n : kSizes) {
    for (const auto& shifts : kShifts) {
      for (uint64_t offset : kOffsets) {
        for (float p : {0.1f, 0.5f}) {
          SCOPED_TRACE(where(n, shifts, offset, p));
          ++seed;
          const std::vector<float> x = testing::random_vector(n, seed);
          std::vector<float> expected(n);
          dropout_forward_cpu(x.data(), expected.data(), n, p, seed, offset);
          Slice dx(n, shifts.first), dy(n, shifts.second);
          dx.upload(x);
          dropout_forward(dx.get(), dy.get(), n, p, seed, offset, stream);
          EXPECT_ALL_CLOSE(dy.download(), expected, 0.0, 0.0);
          EXPECT_TRUE(dy.guards_intact());
          // Backward (same kernel, same mask) in place on the input's slice.
          dropout_backward(dx.get(), dx.get(), n, p, seed, offset, stream);
          EXPECT_ALL_CLOSE(dx.download(), expected, 0.0, 0.0);
          EXPECT_TRUE(dx.guards_intact());
        }
      }
    }
  }
}

TEST(DropoutGpu, BackwardRegeneratesTheForwardMask) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  const int64_t n = (int64_t(1) << 20) + 3;
  const float p = 0.3f, scale = dropout_scale(p);
  const std::vector<float> x = testing::random_vector(n, 1, 0.5f, 2.0f);    // never 0
  const std::vector<float> g = testing::random_vector(n, 2, -2.0f, -0.5f);  // never 0
  Slice dx(n, 0), dy(n, 0), dg(n, 1), dgx(n, 1);
  dx.upload(x);
  dg.upload(g);
  dropout_forward(dx.get(), dy.get(), n, p, 77, 4096, stream);
  dropout_backward(dg.get(), dgx.get(), n, p, 77, 4096, stream);
  const std::vector<float> y = dy.download(), gx = dgx.download();
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = y[i] != 0.0f;
    kept += keep;
    ASSERT_EQ(gx[i], keep ? g[i] * scale : 0.0f) << "element " << i;
    ASSERT_EQ(y[i], keep ? x[i] * scale : 0.0f) << "element " << i;
  }
  // The kept fraction is 1 - p within 6 binomial standard deviations (about 2800 here).
  EXPECT_NEAR(double(kept), n * (1.0 - p), 6 * std::sqrt(n * p * (1.0 - p)));
}

TEST(DropoutGpu, PZeroIsTheIdentity) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  for (int64_t n : {int64_t(1), int64_t(1025)}) {
    const std::vector<float> x = testing::random_vector(n, 3);
    Slice dx(n, 1), dy(n, 0);
    dx.upload(x);
    dropout_forward(dx.get(), dy.get(), n, 0.0f, 5, 0, stream);
    EXPECT_ALL_CLOSE(dy.download(), x, 0.0, 0.0);
    EXPECT_TRUE(dy.guards_intact());
    dropout_backward(dx.get(), dx.get(), n, 0.0f, 5, 0, stream);
    EXPECT_ALL_CLOSE(dx.download(), x, 0.0, 0.0);
  }
}

TEST(DropoutGpu, BadArguments) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  Slice d(4, 0);
  EXPECT_THROW(dropout_forward(d.get(), d.get(), 4, 1.0f, 1, 0, stream), ValueError);
  EXPECT_THROW(dropout_forward(d.get(), d.get(), 4, -0.5f, 1, 0, stream), ValueError);
  EXPECT_THROW(
      dropout_backward(d.get(), d.get(), 4, std::numeric_limits<float>::quiet_NaN(), 1, 0, stream),
      ValueError);
  EXPECT_THROW(dropout_forward(nullptr, d.get(), 4, 0.5f, 1, 0, stream), ValueError);
  EXPECT_NO_THROW(dropout_forward(nullptr, nullptr, 0, 0.5f, 1, 0, stream));
  EXPECT_TRUE(d.guards_intact());
}

}  // namespace
}  // namespace cudp::kernels
