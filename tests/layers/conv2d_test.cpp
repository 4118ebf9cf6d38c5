// Conv2d on the CPU: the forward against a direct double-precision convolution written from
// PyTorch's definition over the *exported* OIHW weight (which checks the KRSC <-> OIHW conversion
// and the NHWC indexing together), finite-difference gradients, accumulation, and the OIHW
// export/import round trip.
#include <gtest/gtest.h>

#include "common/bf16.h"
#include "common/tf32.h"
#include "engine/core/error.h"
#include "layers/conv2d.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

// y[n, p, q, o] = b[o] + sum_{i, r, s} x[n, p*stride - pad + r, q*stride - pad + s, i] * w[o, i, r,
// s]
std::vector<double> direct_conv(const Tensor& x_nhwc, const Tensor& w_oihw, const Tensor& bias,
                                int stride, int pad) {
  const auto x = values(x_nhwc), w = values(w_oihw);
  const auto b = bias.defined() ? values(bias) : std::vector<float>{};
  const int64_t N = x_nhwc.size(0), H = x_nhwc.size(1), W = x_nhwc.size(2), C = x_nhwc.size(3);
  const int64_t O = w_oihw.size(0), R = w_oihw.size(2), S = w_oihw.size(3);
  const int64_t P = (H + 2 * pad - R) / stride + 1, Q = (W + 2 * pad - S) / stride + 1;
  std::vector<double> y;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t o = 0; o < O; ++o) {
          double sum = b.empty() ? 0.0 : b[o];
          for (int64_t i = 0; i < C; ++i)
            for (int64_t r = 0; r < R; ++r)
              for (int64_t s = 0; s < S; ++s) {
                const int64_t h = p * stride - pad + r, v = q * stride - pad + s;
                if (h < 0 || h >= H || v < 0 || v >= W) continue;
                sum += double(x[((n * H + h) * W + v) * C + i]) * w[((o * C + i) * R + r) * S + s];
              }
          y.push_back(sum);
        }
  return y;
}

TEST(Conv2dTest, ForwardMatchesTheDefinitionOnExportedWeights) {
  for (const auto& [stride, pad] : {std::pair{1, 1}, std::pair{2, 0}, std::pair{2, 1}}) {
    Conv2d conv(3, 5, 3, stride, pad, true, 11);
    testing::randomize_parameters(conv, 1);
    const Tensor x = random_tensor({2, 7, 6, 3}, 2);
    const Tensor y = conv.forward(x);
    const int64_t p = (7 + 2 * pad - 3) / stride + 1, q = (6 + 2 * pad - 3) / stride + 1;
    EXPECT_EQ(y.shape(), (Shape{2, p, q, 5}));
    const auto state = conv.state_dict();
    EXPECT_ALL_CLOSE(values(y), direct_conv(x, state.at("weight"), state.at("bias"), stride, pad),
                     1e-6, 1e-6)
        << "stride " << stride << " pad " << pad;
  }
}

TEST(Conv2dTest, WithoutBias) {
  Conv2d conv(4, 3, 1, 1, 0, /*bias=*/false);
  EXPECT_FALSE(conv.has_bias());
  EXPECT_EQ(conv.named_parameters().size(), 1u);
  EXPECT_THROW(conv.bias(), ValueError);
  const Tensor x = random_tensor({1, 3, 2, 4}, 3);
  EXPECT_ALL_CLOSE(values(conv.forward(x)),
                   direct_conv(x, conv.state_dict().at("weight"), {}, 1, 0), 1e-6, 1e-6);
}

TEST(Conv2dTest, GradientsMatchFiniteDifferences) {
  Conv2d conv(3, 4, 3, 2, 1, true);
  testing::randomize_parameters(conv, 4);
  testing::check_gradients(conv, random_tensor({2, 5, 7, 3}, 5), 6, {.h = 0.25});
}

TEST(Conv2dTest, GradientsOfAPaddedStrideOneConv) {
  Conv2d conv(2, 3, 3, 1, 1, true);
  testing::randomize_parameters(conv, 7);
  testing::check_gradients(conv, random_tensor({1, 4, 5, 2}, 8), 9, {.h = 0.25});
}

TEST(Conv2dTest, OihwExportImportRoundTrip) {
  Conv2d a(3, 6, 3, 1, 1, true, 1);
  const auto state = a.state_dict();
  const Tensor& oihw = state.at("weight");
  EXPECT_EQ(oihw.shape(), (Shape{6, 3, 3, 3}));
  // Element (o, i, r, s) of the export is element (o, r, s, i) of the internal KRSC weight.
  const auto krsc = values(a.weight().data), exported = values(oihw);
  for (int o = 0; o < 6; ++o)
    for (int i = 0; i < 3; ++i)
      for (int r = 0; r < 3; ++r)
        for (int s = 0; s < 3; ++s)
          ASSERT_EQ(exported[((o * 3 + i) * 3 + r) * 3 + s], krsc[((o * 3 + r) * 3 + s) * 3 + i]);
  Conv2d b(3, 6, 3, 1, 1, true, 2);
  b.load_state_dict(state);
  EXPECT_EQ(values(b.weight().data), krsc);
  EXPECT_EQ(values(b.state_dict().at("weight")), exported);
}

TEST(Conv2dTest, RejectsAWrongInput) {
  Conv2d conv(3, 4, 3);
  EXPECT_THROW_WITH(conv.forward(random_tensor({1, 5, 5, 4}, 1)),
                    "Conv2d: expected an NHWC f32 input [N, H, W, 3], got Tensor[1, 5, 5, 4]");
}

// The CPU path under bf16 is the GPU's reference: it must compute with the operands rounded to bf16
// (round to nearest even) and store the output rounded once, nothing else. Checked against a
// convolution of pre-rounded tensors in fp32 whose output is then rounded, and against the fp32
// result, which it must differ from (the rounding is not skipped).
TEST(Conv2dTest, Bf16PolicyRoundsTheOperandsAndTheOutputOnTheCpu) {
  Conv2d conv(6, 5, 3, 1, 1, true);
  testing::randomize_parameters(conv, 21);
  const Tensor x = random_tensor({2, 5, 6, 6}, 22);
  auto rounded = [](const Tensor& t) {
    std::vector<float> v = values(t);
    for (float& f : v) f = testing::bf16_rounded(f);
    return Tensor::from_vector(v, t.shape());
  };
  Conv2d reference(6, 5, 3, 1, 1, true);
  reference.weight().data.copy_from(rounded(conv.weight().data));
  reference.bias().data.copy_from(conv.bias().data);  // the bias is added in fp32
  const std::vector<float> expected = values(rounded(reference.forward(rounded(x))));
  const std::vector<float> fp32 = values(conv.forward(x));
  conv.set_precision(Precision::bf16);
  const Tensor y = conv.forward(x);
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_EQ(values(y), expected);
  EXPECT_NE(values(y), fp32);
  // Gradients: dx (f32, the input's dtype) from the bf16 dy and rounded w, dW from rounded x and
  // dy.
  const Tensor g = rounded(random_tensor({2, 5, 6, 5}, 23));
  conv.zero_grad();
  reference.zero_grad();
  const Tensor dx = conv.backward(convert(g, DType::bf16));
  EXPECT_EQ(dx.dtype(), DType::f32);
  EXPECT_EQ(values(dx), values(reference.backward(g)));
  EXPECT_EQ(values(conv.weight().grad), values(reference.weight().grad));
  EXPECT_EQ(values(conv.bias().grad), values(reference.bias().grad));
  // A gradient of another dtype than the output's is refused, naming the rule (after a new
  // forward: the backward above freed what the last one saved).
  conv.forward(x);
  EXPECT_THROW_WITH(conv.backward(g), "a gradient has its value's dtype");
}

// Under tf32 the CPU path truncates each product's operands to TF32 as the tensor cores read them
// (layers/precision.h) and computes in fp32. Checked against an fp32 layer run on truncated
// tensors (its output from truncated x and w, dx from truncated dy and w, dW from truncated x and
// dy) and against fp32 on the tensors as they are, which each product must differ from; the bias
// gradient is a reduction of dy as it is, fp32's.
TEST(Conv2dTest, Tf32PolicyTruncatesTheOperandsOfEveryProductOnTheCpu) {
  Conv2d conv(4, 6, 3, 1, 1, true), fp32(4, 6, 3, 1, 1, true), reference(4, 6, 3, 1, 1, true);
  testing::randomize_parameters(conv, 24);
  fp32.load_state_dict(conv.state_dict());
  auto truncated = [](const Tensor& t) {
    std::vector<float> v = values(t);
    for (float& f : v) f = testing::tf32_truncated(f);
    return Tensor::from_vector(v, t.shape());
  };
  reference.weight().data.copy_from(truncated(conv.weight().data));
  reference.bias().data.copy_from(conv.bias().data);
  conv.set_precision(Precision::tf32);
  const Tensor x = random_tensor({2, 5, 5, 4}, 25), g = random_tensor({2, 5, 5, 6}, 26);
  const Tensor y = conv.forward(x);
  EXPECT_EQ(y.dtype(), DType::f32);
  EXPECT_EQ(values(y), values(reference.forward(truncated(x))));
  EXPECT_NE(values(y), values(fp32.forward(x)));
  conv.zero_grad();
  fp32.zero_grad();
  reference.zero_grad();
  const Tensor dx = conv.backward(g);
  EXPECT_EQ(dx.dtype(), DType::f32);
  EXPECT_EQ(values(dx), values(reference.backward(truncated(g))));
  EXPECT_NE(values(dx), values(fp32.backward(g)));
  EXPECT_EQ(values(conv.weight().grad), values(reference.weight().grad));
  EXPECT_NE(values(conv.weight().grad), values(fp32.weight().grad));
  EXPECT_EQ(values(conv.bias().grad), values(fp32.bias().grad));
  EXPECT_NE(values(conv.bias().grad), values(reference.bias().grad));
}

TEST(Conv2dTest, InitIsKaimingFanOut) {
  Conv2d conv(16, 32, 3, 1, 1, true, 5);
  const auto w = values(conv.weight().data);
  double sum = 0, sq = 0;
  for (float v : w) sum += v, sq += double(v) * v;
  const double mean = sum / w.size(), std = std::sqrt(sq / w.size() - mean * mean);
  const double expected = std::sqrt(2.0 / (32 * 9));  // 4608 samples: std within ~3%
  EXPECT_NEAR(std, expected, 0.04 * expected);
  EXPECT_NEAR(mean, 0.0, 4 * expected / std::sqrt(double(w.size())));
  for (float v : values(conv.bias().data)) EXPECT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace cudp
