// The dense 2 x 2 form's GPU kernels (kernels/conv2d_dense.h) against their CPU references, bit for
// bit: W_eff gathered from bf16 filters and from fp32 filters (rounded by the kernel), with and
// without bias_eff; the fold written (beta 0 over NaN, which must not show) and accumulated. The
// references themselves are checked against the convolution in conv2d_dense_test.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "common/device_buffer.h"
#include "common/expect_error.h"
#include "common/gpu.h"
#include "kernels/conv2d_dense.h"
#include "kernels/layout.h"
#include "tests/kernels/conv2d_dense_testing.h"

namespace cudp::kernels {
namespace {

using testing_dense::dense_2x2_shape;

using testing::DeviceBuffer;

std::vector<float> uniform(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

class Conv2dDenseGpu : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(Conv2dDenseGpu, TheFiltersGatherIsTheReferencesBitForBit) {
  CUDP_REQUIRE_GPU();
  const auto [c, k] = GetParam();
  const Conv2dShape s = dense_2x2_shape(2, c, k);
  const size_t eff = size_t(16) * c * k;
  const std::vector<float> w32 = uniform(size_t(s.w_size()), 1), bias = uniform(size_t(k), 2);
  std::vector<__nv_bfloat16> w16(w32.size());
  f32_to_bf16_cpu(w32.data(), w16.data(), int64_t(w32.size()));
  std::vector<__nv_bfloat16> want(eff);
  std::vector<float> want_bias(size_t(4) * k);
  conv2d_dense_2x2_filters_cpu(w32.data(), s, want.data(), bias.data(), want_bias.data());

  const DeviceBuffer<float> dw32(w32), dbias(bias);
  const DeviceBuffer<__nv_bfloat16> dw16(w16);
  for (const bool from_f32 : {false, true}) {
    for (const bool with_bias : {true, false}) {
      SCOPED_TRACE(::testing::Message() << (from_f32 ? "fp32" : "bf16") << " filters, "
                                        << (with_bias ? "with" : "without") << " bias");
      DeviceBuffer<__nv_bfloat16> out(eff);
      DeviceBuffer<float> out_bias(size_t(4) * k);
      out_bias.fill(std::numeric_limits<float>::quiet_NaN());
      const float* b = with_bias ? dbias.get() : nullptr;
      if (from_f32) {
        conv2d_dense_2x2_filters(dw32.get(), s, out.get(), b, out_bias.get(), nullptr);
      } else {
        conv2d_dense_2x2_filters(dw16.get(), s, out.get(), b, out_bias.get(), nullptr);
      }
      EXPECT_TRUE(same_bits(out.download(), want));
      const std::vector<float> got_bias = out_bias.download();
      if (with_bias) {
        EXPECT_TRUE(same_bits(got_bias, want_bias));
      } else {  // untouched
        for (float v : got_bias) ASSERT_TRUE(std::isnan(v)) << "bias_eff written without a bias";
      }
    }
  }
}

TEST_P(Conv2dDenseGpu, TheFoldIsTheReferencesBitForBit) {
  CUDP_REQUIRE_GPU();
  const auto [c, k] = GetParam();
  const Conv2dShape s = dense_2x2_shape(2, c, k);
  const std::vector<float> dw_eff = uniform(size_t(16) * c * k, 3),
                           before = uniform(size_t(s.w_size()), 4);
  const DeviceBuffer<float> d_eff(dw_eff);
  for (const float beta : {0.f, 1.f, 0.5f}) {
    SCOPED_TRACE(::testing::Message() << "beta " << beta);
    std::vector<float> want(before);
    if (beta == 0.f) std::fill(want.begin(), want.end(), std::numeric_limits<float>::quiet_NaN());
    DeviceBuffer<float> dw(want);
    conv2d_dense_2x2_fold_cpu(dw_eff.data(), s, want.data(), beta);
    conv2d_dense_2x2_fold(d_eff.get(), s, dw.get(), beta, nullptr);
    const std::vector<float> got = dw.download();
    EXPECT_TRUE(same_bits(got, want));
    if (beta == 0.f) {
      for (float v : got) ASSERT_FALSE(std::isnan(v)) << "beta 0 read the old gradient";
    }
  }
}

// VGG's 512-channel layers, the smallest channels, and C != K both ways.
INSTANTIATE_TEST_SUITE_P(Shapes, Conv2dDenseGpu,
                         ::testing::Values(std::tuple{512, 512}, std::tuple{8, 8},
                                           std::tuple{16, 40}, std::tuple{64, 8}));

TEST(Conv2dDenseGpuErrors, AShapeOutsideTheFormOrAnUnalignedPointerIsRefusedByName) {
  CUDP_REQUIRE_GPU();
  Conv2dShape s = dense_2x2_shape(2, 16, 16);
  DeviceBuffer<float> w(size_t(s.w_size()) + 4), dw_eff(size_t(16 * 16 * 16)),
      dw(size_t(s.w_size()) + 4);
  DeviceBuffer<__nv_bfloat16> w_eff(size_t(16 * 16 * 16));
  EXPECT_VALUE_ERROR(
      conv2d_dense_2x2_filters(w.get() + 1, s, w_eff.get(), nullptr, nullptr, nullptr),
      "conv2d_dense_2x2_filters: w and w_eff must be 16-byte aligned");
  EXPECT_VALUE_ERROR(conv2d_dense_2x2_fold(dw_eff.get(), s, dw.get() + 2, 0.f, nullptr),
                     "conv2d_dense_2x2_fold: dw_eff and dw must be 16-byte aligned");
  s.c = 20;  // not a multiple of 8
  EXPECT_VALUE_ERROR(conv2d_dense_2x2_fold(dw_eff.get(), s, dw.get(), 0.f, nullptr),
                     "conv2d_dense_2x2_fold: the dense form takes a 3x3 convolution");
  s.c = 16;
  s.h = s.w = 3;
  EXPECT_VALUE_ERROR(conv2d_dense_2x2_filters(w.get(), s, w_eff.get(), nullptr, nullptr, nullptr),
                     "got input 3x3");
}

}  // namespace
}  // namespace cudp::kernels
