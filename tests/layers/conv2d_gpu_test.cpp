// Conv2d on CUDA against its CPU path (the reference), forward and backward, on random inputs of
// odd sizes: outputs, input gradients, parameter gradients and buffers (layer_testing.h's
// expect_gpu_matches_cpu). The GPU sums in fp32, in another order than the CPU's double sums; for
// reductions of a few hundred terms of magnitude <= 1 that stays within 1e-5 relative, with 1e-4
// absolute for outputs that cancel to near zero.
#include <gtest/gtest.h>

#include <tuple>

#include "common/compare.h"
#include "common/gpu.h"
#include "common/scoped_switch.h"
#include "kernels/conv2d_dense.h"
#include "layers/activation.h"
#include "layers/conv2d.h"
#include "layers/sequential.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::expect_gpu_matches_cpu;
using testing::random_tensor;

TEST(Conv2dGpuTest, MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  for (const auto& [k, stride, pad] :
       {std::tuple{3, 1, 1}, std::tuple{3, 2, 1}, std::tuple{1, 1, 0}, std::tuple{5, 2, 2}}) {
    Conv2d conv(5, 7, k, stride, pad, true);
    testing::randomize_parameters(conv, 1);
    expect_gpu_matches_cpu(conv, random_tensor({3, 11, 9, 5}, 2), 3, 1e-5, 1e-4);
  }
  Conv2d first_layer(3, 64, 3, 1, 1, true);  // VGG's first layer: three input channels
  expect_gpu_matches_cpu(first_layer, random_tensor({2, 13, 15, 3}, 4), 5, 1e-5, 1e-4);
  Conv2d no_bias(4, 6, 3, 1, 1, false);
  expect_gpu_matches_cpu(no_bias, random_tensor({1, 7, 7, 4}, 6), 7, 1e-5, 1e-4);
}

// Under the bf16 policy the GPU runs the tensor-core kernels on bf16 copies of x, w and dy, and the
// CPU path rounds the same operands the same way (layers/precision.h): the products are then exact
// on both sides and only the summation differs (fp32 on tensor cores, whose accumulation may drop
// low bits of the addends, against double), so 1e-4 holds. Skipping the rounding on either side
// changes results by about 2^-9 relative per product, tens of times more: this test tells.
TEST(Conv2dGpuTest, Bf16MatchesTheCpuPathWithRoundedOperands) {
  CUDP_REQUIRE_TENSOR_CORES();
  for (const auto& [c, k, kernel, pad] :
       {std::tuple{5, 7, 3, 1}, std::tuple{3, 64, 3, 1}, std::tuple{64, 64, 3, 1},
        std::tuple{16, 24, 1, 0}, std::tuple{8, 12, 5, 2}}) {
    Conv2d conv(c, k, kernel, 1, pad, true);
    testing::randomize_parameters(conv, 11);
    conv.set_precision(Precision::bf16);
    SCOPED_TRACE(::testing::Message() << "c " << c << " k " << k << " kernel " << kernel);
    expect_gpu_matches_cpu(conv, random_tensor({2, 9, 11, c}, 12), 13, 1e-4, 1e-4);
  }
}

// A 3x3 layer on a 2x2 image as a dense map (kernels/conv2d_dense.h): its three products are plain
// GEMMs of the bf16 operands, so the CPU path (the convolution on the same rounded operands) is its
// reference as for the other bf16 layers: 1e-4 as above, a bf16 output one unit apart at most.
// Batches of 3 and 1 (no tile's multiple), C != K both ways, with and without a bias, f32 and bf16
// inputs (dx in the input's dtype); K = 512 and 256 (with C = 512 and 64) read W_eff as a view of
// the filters, the others gather it; the forward and backward-data products with the planner's
// split-K, with 3 splits (the epilogue's bias, ReLU and mask then in the split-K reduction) and
// with 256-wide tiles in 2 splits.
TEST(Conv2dGpuTest, Bf16Dense2x2FormMatchesTheCpuPath) {
  CUDP_REQUIRE_TENSOR_CORES();
  const testing::ScopedSwitch<bool> dense(kernels::detail::conv_dense_2x2,
                                          kernels::detail::set_conv_dense_2x2, true);
  struct Case {
    int n, c, k;
    bool bias;
    DType input;
  };
  struct Plan {
    int splits, tile_n;  // 0: the planner's
  };
  for (const auto [splits, tile_n] : {Plan{0, 0}, Plan{3, 0}, Plan{2, 256}}) {
    const testing::ScopedSwitch<int> split_count(
        kernels::detail::conv_dense_2x2_splits, kernels::detail::set_conv_dense_2x2_splits, splits);
    const testing::ScopedSwitch<int> tile_width(kernels::detail::conv_dense_2x2_tile,
                                                kernels::detail::set_conv_dense_2x2_tile, tile_n);
    for (const Case& t :
         {Case{3, 64, 64, true, DType::bf16}, Case{1, 128, 64, false, DType::bf16},
          Case{2, 64, 192, true, DType::f32}, Case{3, 8, 16, true, DType::bf16},
          Case{4, 512, 512, true, DType::bf16}, Case{2, 64, 256, true, DType::f32}}) {
      SCOPED_TRACE(::testing::Message()
                   << "splits " << splits << " tile " << tile_n << " n " << t.n << " c " << t.c
                   << " k " << t.k << (t.bias ? "" : " no bias") << " input "
                   << dtype_name(t.input));
      Conv2d conv(t.c, t.k, 3, 1, 1, t.bias);
      testing::randomize_parameters(conv, 31, -0.3f, 0.3f);
      conv.set_precision(Precision::bf16);
      const Tensor x = convert(random_tensor({t.n, 2, 2, t.c}, 32), t.input);
      const auto gpu = expect_gpu_matches_cpu(conv, x, 33, 1e-4, 1e-4);
      EXPECT_TRUE(static_cast<Conv2d&>(*gpu).ran_dense_2x2());
    }
  }
  // Not the form's: a 3x3 input, 12 channels.
  for (const auto& [side, c] : {std::pair{3, 64}, std::pair{2, 12}}) {
    Conv2d conv(c, 64, 3, 1, 1);
    conv.set_precision(Precision::bf16);
    conv.to(Device::cuda(0));
    conv.forward(
        convert(random_tensor({2, side, side, c}, 34, -1.f, 1.f, Device::cuda(0)), DType::bf16));
    EXPECT_FALSE(conv.ran_dense_2x2()) << "side " << side << " c " << c;
  }
}

// VGG's last block in small, each layer in the dense form: the fused ReLUs, the mask handed to the
// next layer's backward-data (its epilogue masks on the product's output, dx as [N][4C]) and the
// bias gradients that layer then leaves to the layer before (a pass over dy). Against the CPU path
// within the tolerance of a stack of bf16 products (bf16_storage_gpu_test.cpp's small VGG: 1e-2),
// and against the implicit-GEMM form on the GPU, which the switch selects.
TEST(Conv2dGpuTest, Bf16Dense2x2LayersInAStackMatchTheCpuAndTheOtherForm) {
  CUDP_REQUIRE_TENSOR_CORES();
  const auto make = [] {
    auto net = std::make_shared<Sequential>();
    net->add(std::make_shared<Conv2d>(64, 128, 3, 1, 1));
    net->add(std::make_shared<ReLU>(true));
    net->add(std::make_shared<Conv2d>(128, 128, 3, 1, 1));
    net->add(std::make_shared<ReLU>(true));
    net->add(std::make_shared<Conv2d>(128, 64, 3, 1, 1));
    net->add(std::make_shared<ReLU>(true));
    testing::randomize_parameters(*net, 41, -0.1f, 0.1f);
    net->set_precision(Precision::bf16);
    return net;
  };
  const Tensor x = convert(random_tensor({8, 2, 2, 64}, 42), DType::bf16);
  std::vector<std::vector<float>> grads[2];
  for (const bool on : {true, false}) {
    SCOPED_TRACE(on ? "dense form" : "implicit GEMM");
    const testing::ScopedSwitch<bool> dense(kernels::detail::conv_dense_2x2,
                                            kernels::detail::set_conv_dense_2x2, on);
    auto cpu = make();
    const auto gpu =
        std::static_pointer_cast<Sequential>(expect_gpu_matches_cpu(*cpu, x, 43, 1e-2, 1e-2));
    for (const size_t i : {0, 2, 4}) {
      EXPECT_EQ(static_cast<Conv2d&>(*(*gpu)[i]).ran_dense_2x2(), on) << i;
      EXPECT_TRUE((*gpu)[i]->relu_fused()) << i;
    }
    EXPECT_TRUE((*gpu)[2]->input_grad_masked());
    EXPECT_TRUE((*gpu)[4]->input_grad_masked());
    for (const auto& [name, p] : gpu->named_parameters())
      grads[on].push_back(testing::values(p->grad));
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_ALL_CLOSE(grads[1][i], grads[0][i], 1e-2, 1e-2 * testing::max_abs(grads[0][i]))
        << "parameter " << i;
  }
}

// Under the tf32 policy the GPU runs forward, backward-data and backward-weight on TF32 tensor
// cores, and the CPU path computes with the unrounded fp32 operands (layers/precision.h), so the
// difference is TF32's operand rounding. Per output, as tests/kernels/matmul_gpu_test.cpp derives:
// at most 2^-9 |c| (each operand truncated to 10 mantissa bits, 2^-10 relative, a possible bias
// toward zero) plus 6 * 2^-10 * sqrt(sum p^2) for the random part. With operands uniform in
// [-1, 1) the terms have random signs, so sqrt(sum p^2) is about the outputs' standard deviation,
// and the largest of a tensor's >= 100 outputs is at least 2.5 of them: the random part is below
// 6 / 2.5 * 2^-10 = 2.4 * 2^-10 of max|c|, gpu_close's atol. The fp32 kernels would pass too; the
// last check rules them out (results bit-identical to the GPU's fp32 ones).
TEST(Conv2dGpuTest, Tf32MatchesTheCpuPathWithinTf32Precision) {
  CUDP_REQUIRE_TENSOR_CORES();
  constexpr double kRtol = 1.0 / 512, kAtol = 2.4 / 1024;
  for (const auto& [c, k, kernel, pad] :
       {std::tuple{5, 7, 3, 1}, std::tuple{3, 64, 3, 1}, std::tuple{64, 64, 3, 1},
        std::tuple{16, 24, 1, 0}, std::tuple{8, 12, 5, 2}}) {
    SCOPED_TRACE(::testing::Message() << "c " << c << " k " << k << " kernel " << kernel);
    Conv2d conv(c, k, kernel, 1, pad, true);
    testing::randomize_parameters(conv, 21);
    Conv2d fp32_conv(c, k, kernel, 1, pad, true);
    fp32_conv.load_state_dict(conv.state_dict());
    conv.set_precision(Precision::tf32);
    const Tensor x = random_tensor({2, 9, 11, c}, 22);
    const std::shared_ptr<Module> tf32 = expect_gpu_matches_cpu(conv, x, 23, kRtol, kAtol);
    const std::shared_ptr<Module> fp32 = expect_gpu_matches_cpu(fp32_conv, x, 23, 1e-5, 1e-4);
    EXPECT_FALSE(testing::bitwise_equal(testing::values(tf32->named_parameters()[0].second->grad),
                                        testing::values(fp32->named_parameters()[0].second->grad)))
        << "the tf32 weight gradient is the fp32 kernels'";
  }
}

}  // namespace
}  // namespace cudp
