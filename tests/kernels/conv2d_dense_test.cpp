// Host tests of the dense 2 x 2 form's CPU references (kernels/conv2d_dense.h): W_eff and the fold,
// composed with the matrix product's CPU reference (kernels/matmul.h), are the convolution itself.
// The truth is the convolution's own references (kernels/conv2d.h: loops over the definition, in
// double): on bf16 operands, whose products are exact in double, both sides add the same terms in
// double and round once, so they agree to a few fp32 ulps (the fold adds fp32 partial sums:
// 1e-6 relative of the largest gradient covers its roundings). And the shapes the form refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/compare.h"
#include "common/expect_error.h"
#include "kernels/conv2d_dense.h"
#include "kernels/layout.h"
#include "kernels/matmul.h"
#include "tests/kernels/conv2d_dense_testing.h"

namespace cudp::kernels {
namespace {

using testing_dense::Bf16Values;
using testing_dense::dense_2x2_shape;
using testing_dense::random_bf16;

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}

class Conv2dDenseCpu : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(Conv2dDenseCpu, TheProductsOfTheDenseFormAreTheConvolution) {
  const auto [n, c, k] = GetParam();
  const Conv2dShape s = dense_2x2_shape(n, c, k);
  const int64_t inputs = 4 * int64_t(c), outputs = 4 * int64_t(k);
  const Bf16Values x = random_bf16(size_t(s.x_size()), 1), w = random_bf16(size_t(s.w_size()), 2),
                   dy = random_bf16(size_t(s.y_size()), 3), b = random_bf16(size_t(k), 4);
  std::vector<__nv_bfloat16> w_eff(size_t(outputs * inputs));
  std::vector<float> bias_eff(static_cast<size_t>(outputs));
  conv2d_dense_2x2_filters_cpu(w.bits.data(), s, w_eff.data(), b.values.data(), bias_eff.data());

  // The fp32 filters give the same W_eff as their bf16 rounding.
  {
    std::vector<float> w32(w.values);
    std::mt19937 rng(5);
    for (float& v : w32) v += std::uniform_real_distribution<float>(-1e-3f, 1e-3f)(rng);
    std::vector<__nv_bfloat16> rounded(w32.size()), from_rounded(w_eff.size()),
        from_f32(w_eff.size());
    f32_to_bf16_cpu(w32.data(), rounded.data(), int64_t(w32.size()));
    conv2d_dense_2x2_filters_cpu(rounded.data(), s, from_rounded.data(), nullptr, nullptr);
    conv2d_dense_2x2_filters_cpu(w32.data(), s, from_f32.data(), nullptr, nullptr);
    EXPECT_EQ(0, std::memcmp(from_rounded.data(), from_f32.data(), from_f32.size() * 2))
        << "W_eff from fp32 filters is not W_eff from their bf16 rounding";
  }

  for (const bool relu : {false, true}) {
    SCOPED_TRACE(relu ? "forward with a fused ReLU" : "forward");
    std::vector<float> y(size_t(s.y_size())), want(y.size());
    MatmulProblem p;
    p.m = n;
    p.n = int(outputs);
    p.k = int(inputs);
    p.a = x.bits.data();
    p.lda = inputs;
    p.b = w_eff.data();
    p.ldb = inputs;
    p.c = y.data();
    p.ldc = outputs;
    p.bias = bias_eff.data();
    p.relu = relu;
    matmul_cpu(p);
    conv2d_forward_cpu(s, x.values.data(), w.values.data(), b.values.data(), want.data(), relu);
    EXPECT_ALL_CLOSE(y, want, 1e-6, 1e-6 * max_abs(want));
  }
  {
    SCOPED_TRACE("backward-data");
    std::vector<float> dx(size_t(s.x_size())), want(dx.size());
    MatmulProblem p;
    p.m = n;
    p.n = int(inputs);
    p.k = int(outputs);
    p.a = dy.bits.data();
    p.lda = outputs;
    p.b = w_eff.data();
    p.ldb = inputs;
    p.b_transposed = true;
    p.c = dx.data();
    p.ldc = inputs;
    matmul_cpu(p);
    conv2d_backward_data_cpu(s, dy.values.data(), w.values.data(), want.data());
    EXPECT_ALL_CLOSE(dx, want, 1e-6, 1e-6 * max_abs(want));
  }
  for (const float beta : {0.f, 0.5f}) {
    SCOPED_TRACE(beta == 0 ? "backward-weight, written" : "backward-weight, accumulated");
    std::vector<float> dw_eff(size_t(outputs * inputs));
    MatmulProblem p;
    p.m = int(outputs);
    p.n = int(inputs);
    p.k = n;
    p.a = dy.bits.data();
    p.lda = outputs;
    p.a_transposed = true;
    p.b = x.bits.data();
    p.ldb = inputs;
    p.b_transposed = true;
    p.c = dw_eff.data();
    p.ldc = inputs;
    matmul_cpu(p);
    // dw holds an earlier gradient; with beta 0 even NaN there must not show.
    const Bf16Values before = random_bf16(size_t(s.w_size()), 6);
    std::vector<float> dw(before.values), want(before.values);
    if (beta == 0) std::fill(dw.begin(), dw.end(), std::numeric_limits<float>::quiet_NaN());
    conv2d_dense_2x2_fold_cpu(dw_eff.data(), s, dw.data(), beta);
    conv2d_backward_weight_cpu(s, x.values.data(), dy.values.data(), want.data(), beta);
    EXPECT_ALL_CLOSE(dw, want, 1e-6, 1e-6 * max_abs(want));
  }
}

// Batches of 1 and 3 (no multiple of a tile), C != K both ways, the smallest channels (8).
INSTANTIATE_TEST_SUITE_P(Shapes, Conv2dDenseCpu,
                         ::testing::Values(std::tuple{1, 8, 8}, std::tuple{3, 16, 8},
                                           std::tuple{2, 8, 24}, std::tuple{5, 32, 16}));

TEST(Conv2dDenseShapes, OnlyA3x3LayerOfStride1AndPadding1OnA2x2InputTakesTheDenseForm) {
  EXPECT_TRUE(conv2d_dense_2x2_applies(dense_2x2_shape(4, 512, 512)));
  EXPECT_TRUE(conv2d_dense_2x2_applies(dense_2x2_shape(1, 8, 16)));
  Conv2dShape s = dense_2x2_shape(2, 12, 16);  // C not a multiple of 8
  EXPECT_FALSE(conv2d_dense_2x2_applies(s));
  std::vector<__nv_bfloat16> w(size_t(s.w_size())), w_eff(size_t(16 * s.c * s.k));
  EXPECT_VALUE_ERROR(conv2d_dense_2x2_filters_cpu(w.data(), s, w_eff.data(), nullptr, nullptr),
                     "conv2d_dense_2x2_filters_cpu: the dense form takes a 3x3 convolution of "
                     "stride 1 and padding 1 on a 2x2 input with C and K multiples of 8; got input "
                     "2x2, filters 3x3, stride 1, padding 1, C 12, K 16");
  s = dense_2x2_shape(2, 16, 16);
  s.h = s.w = 4;
  EXPECT_FALSE(conv2d_dense_2x2_applies(s));
  s = dense_2x2_shape(2, 16, 16);
  s.stride_h = s.stride_w = 2;
  EXPECT_FALSE(conv2d_dense_2x2_applies(s));
  std::vector<float> dw_eff(16 * 16 * 16 * 4), dw(size_t(16 * 9 * 16));
  EXPECT_VALUE_ERROR(conv2d_dense_2x2_fold_cpu(dw_eff.data(), s, dw.data(), 0.f),
                     "conv2d_dense_2x2_fold_cpu: the dense form takes");
  s = dense_2x2_shape(2, 16, 16);
  s.pad_h = s.pad_w = 0;
  EXPECT_FALSE(conv2d_dense_2x2_applies(s));
  s = dense_2x2_shape(2, 16, 16);
  s.r = s.s = 1;
  s.pad_h = s.pad_w = 0;
  EXPECT_FALSE(conv2d_dense_2x2_applies(s));
}

// The reference reads B's dense 2 x 2 view (MatmulProblem::b_dense_k) and a bias by period as
// the gathered W_eff and bias_eff: the same products in the same order, the same bits, for the
// forward (B n x k, bias, ReLU) and backward-data (B stored k x n). The GPU tests hold the
// kernels to the gathered products.
TEST(Conv2dDenseView, TheReferenceReadsTheViewAsTheGatheredCopy) {
  const int n = 2, c = 64, k = 256;
  const Conv2dShape s = dense_2x2_shape(n, c, k);
  ASSERT_TRUE(conv2d_dense_2x2_view_applies(s));
  EXPECT_FALSE(conv2d_dense_2x2_view_applies(dense_2x2_shape(n, 64, 128)));  // K
  EXPECT_FALSE(conv2d_dense_2x2_view_applies(dense_2x2_shape(n, 32, 256)));  // C
  const int64_t inputs = 4 * int64_t(c), outputs = 4 * int64_t(k);
  const Bf16Values x = random_bf16(size_t(s.x_size()), 11), w = random_bf16(size_t(s.w_size()), 12),
                   dy = random_bf16(size_t(s.y_size()), 13), b = random_bf16(size_t(k), 14);
  std::vector<__nv_bfloat16> w_eff(size_t(outputs * inputs));
  std::vector<float> bias_eff(static_cast<size_t>(outputs));
  conv2d_dense_2x2_filters_cpu(w.bits.data(), s, w_eff.data(), b.values.data(), bias_eff.data());
  for (const bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward-data" : "forward");
    MatmulProblem p;
    p.m = n;
    p.n = int(backward ? inputs : outputs);
    p.k = int(backward ? outputs : inputs);
    p.a = backward ? dy.bits.data() : x.bits.data();
    p.lda = p.k;
    p.b_transposed = backward;
    p.ldc = p.n;
    p.relu = !backward;
    std::vector<float> gathered(size_t(n) * p.n), viewed(gathered.size());
    MatmulProblem g = p, v = p;
    g.b = w_eff.data();
    g.ldb = inputs;
    g.bias = backward ? nullptr : bias_eff.data();
    g.c = gathered.data();
    v.b = w.bits.data();
    v.ldb = 9 * int64_t(c);
    v.b_dense_k = k;
    v.b_dense_c = c;
    v.bias = backward ? nullptr : b.values.data();
    v.bias_period = backward ? 0 : k;
    v.c = viewed.data();
    matmul_cpu(g);
    matmul_cpu(v);
    EXPECT_EQ(0, std::memcmp(gathered.data(), viewed.data(), gathered.size() * sizeof(float)));
  }
}

TEST(Conv2dDenseShapes, TheSplitCountSwitchRefusesANegativeCount) {
  const int before = detail::conv_dense_2x2_splits();
  EXPECT_VALUE_ERROR(detail::set_conv_dense_2x2_splits(-1),
                     "set_conv_dense_2x2_splits: splits must be >= 0 (0: the planner's), got -1");
  EXPECT_EQ(detail::conv_dense_2x2_splits(), before);
}

TEST(Conv2dDenseShapes, TheTileWidthSwitchRefusesAWidthWithoutKernels) {
  const int before = detail::conv_dense_2x2_tile();
  for (const int width : {-64, 32, 96, 512}) {
    EXPECT_VALUE_ERROR(detail::set_conv_dense_2x2_tile(width),
                       "set_conv_dense_2x2_tile: the tile width must be 64, 128 or 256 (0: the "
                       "planner's), got " +
                           std::to_string(width));
  }
  EXPECT_EQ(detail::conv_dense_2x2_tile(), before);
}

}  // namespace
}  // namespace cudp::kernels
