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
#include "kernels/matmul.h"
#include "tests/kernels/conv2d_dense_testing.h"

namespace cudp::kernels {
namespace {

using testing_dense::dense_2x2_shape;
using testing_dense::random_bf16;
using testing_dense::uniform;

using testing::DeviceBuffer;

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

// The forward (C = x W_eff^T + bias_eff, ReLU) and backward-data (C = dy W_eff, B stored k x n,
// a ReLU mask) with W_eff read as a view of the filters (MatmulProblem::b_dense_k) and the bias by
// period K (bias_period), against the same products on the gathered W_eff and bias_eff: the same
// values in the same k order, so the same bits, at every tile width, with and without split-K
// (the epilogue then in the reduction), fp32 and bf16 C.
TEST(Conv2dDenseGpuView, TheFiltersViewGivesTheGatheredProductsBits) {
  CUDP_REQUIRE_TENSOR_CORES();
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const int sms = detail::multiprocessor_count(device);
  for (const auto& [n, c, k] :
       {std::tuple{3, 64, 256}, std::tuple{200, 512, 512}, std::tuple{130, 128, 256}}) {
    const Conv2dShape s = dense_2x2_shape(n, c, k);
    ASSERT_TRUE(conv2d_dense_2x2_view_applies(s));
    const int64_t outs = 4 * int64_t{k}, ins = 4 * int64_t{c};
    const std::vector<__nv_bfloat16> w = random_bf16(size_t(s.w_size()), 5).bits;
    const std::vector<float> bias = uniform(size_t(k), 6);
    std::vector<__nv_bfloat16> w_eff(size_t(outs * ins));
    std::vector<float> bias_eff(static_cast<size_t>(outs));
    conv2d_dense_2x2_filters_cpu(w.data(), s, w_eff.data(), bias.data(), bias_eff.data());
    const DeviceBuffer<__nv_bfloat16> dw(w), dw_eff(w_eff),
        dx(random_bf16(size_t(n * ins), 7).bits), ddy(random_bf16(size_t(n * outs), 8).bits),
        dmask(random_bf16(size_t(n * ins), 9).bits);
    const DeviceBuffer<float> dbias(bias), dbias_eff(bias_eff),
        dmask32(uniform(size_t(n * ins), 9));  // the mask is in C's type
    for (const int tile_n : {64, 128, 256}) {
      for (const int splits : {1, 3}) {
        for (const DType c_type : {DType::BF16, DType::F32}) {
          SCOPED_TRACE(::testing::Message()
                       << "n " << n << " c " << c << " k " << k << " tile_n " << tile_n
                       << " splits " << splits << " C " << dtype_name(c_type));
          for (const bool backward : {false, true}) {
            SCOPED_TRACE(backward ? "backward-data" : "forward");
            MatmulProblem p;
            p.m = n;
            p.n = int(backward ? ins : outs);
            p.k = int(backward ? outs : ins);
            p.a = backward ? ddy.get() : dx.get();
            p.lda = p.k;
            p.b_transposed = backward;
            p.ldc = p.n;
            p.c_type = c_type;
            if (backward) {
              p.mask = c_type == DType::BF16 ? static_cast<const void*>(dmask.get())
                                             : static_cast<const void*>(dmask32.get());
            } else {
              p.relu = true;
            }
            const size_t out_bytes = size_t(n) * p.n * dtype_size(c_type);
            DeviceBuffer<uint8_t> gathered(out_bytes), viewed(out_bytes);
            MatmulProblem g = p;
            g.b = dw_eff.get();
            g.ldb = ins;
            g.bias = backward ? nullptr : dbias_eff.get();
            g.c = gathered.get();
            MatmulProblem v = p;
            v.b = dw.get();
            v.ldb = 9 * int64_t{c};
            v.b_dense_k = k;
            v.b_dense_c = c;
            v.bias = backward ? nullptr : dbias.get();
            v.bias_period = backward ? 0 : k;
            v.c = viewed.get();
            ASSERT_EQ(matmul_unsupported_reason(v, device), "");
            const MatmulPlan plan = make_matmul_plan(g, tile_n, splits, sms);
            matmul_with_plan(g, plan, nullptr);
            matmul_with_plan(v, plan, nullptr);
            EXPECT_TRUE(same_bits(viewed.download(), gathered.download()));
          }
        }
      }
    }
  }
}

// The view's shape rules, named: K a multiple of 256 and C of 64 (one tap per box), B W_eff's
// shape over filters of row stride 9C, bf16, A stored m x k; a bias period needs a bias.
TEST(Conv2dDenseGpuView, AViewOutsideItsRulesIsRefusedByName) {
  CUDP_REQUIRE_TENSOR_CORES();
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  MatmulProblem p;
  p.m = 2;
  p.n = 4 * 256;
  p.k = 4 * 64;
  DeviceBuffer<__nv_bfloat16> buffer(size_t(256) * 9 * 64);
  DeviceBuffer<float> out(size_t(2) * 4 * 256);
  p.a = p.b = buffer.get();
  p.lda = p.k;
  p.ldb = 9 * 64;
  p.c = out.get();
  p.ldc = p.n;
  p.b_dense_k = 256;
  p.b_dense_c = 64;
  EXPECT_EQ(matmul_unsupported_reason(p, device), "");
  MatmulProblem q = p;
  q.b_dense_k = 128;
  q.n = 4 * 128;
  EXPECT_EQ(matmul_unsupported_reason(q, device).rfind("the dense 2x2 view of B (b_dense_k, "
                                                       "b_dense_c) needs K a multiple of 256 and "
                                                       "C a multiple of 64, got K=128 C=64",
                                                       0),
            0u)
      << matmul_unsupported_reason(q, device);
  q = p;
  q.ldb = 4 * 64;
  EXPECT_EQ(matmul_unsupported_reason(q, device),
            "the dense 2x2 view of B is W_eff, 4K x 4C = 1024 x 256, over filters of row stride "
            "ldb = 9C = 576; got 1024 x 256 (n x k) and ldb=256");
  q = p;
  q.k = 4 * 128;
  EXPECT_EQ(matmul_unsupported_reason(q, device).rfind("the dense 2x2 view of B is W_eff", 0), 0u);
  q = p;
  q.math = Math::TF32;
  EXPECT_EQ(matmul_unsupported_reason(q, device),
            "the dense 2x2 view of B is read in bf16 with A stored m x k (not a_transposed)");
  q = p;
  q.bias_period = 256;
  EXPECT_EQ(matmul_unsupported_reason(q, device),
            "bias_period=256: it is 0 (one bias a column) or the period of a given bias, > 0");
  q.bias_period = -1;
  EXPECT_VALUE_ERROR(matmul(q, nullptr), "matmul: bias_period=-1");
}

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
