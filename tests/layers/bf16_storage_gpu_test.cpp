// The bf16 policy's storage between layers on the GPU, against the CPU path (its reference):
// the fused ReLU's backward with the bias gradient (kernels/bias.h), ReLU and max pooling on bf16
// (exact: compared bit for bit), Conv2d with bf16 input and output on every operand path (bf16
// input used in place, f32 input converted, padded channels, K not a multiple of 8), a small
// VGG-like stack end to end, and fused ReLU against the ReLU module bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <string>
#include <tuple>

#include "common/gpu.h"
#include "common/scoped_switch.h"
#include "engine/core/error.h"
#include "kernels/bias.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dropout.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "tests/layers/fusion_nets.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

// Small integers in [-8, 8] as bf16: every fp32 sum of fewer than 2^20 of them is exact, whatever
// the order, so the GPU's column sums must equal the CPU's double sums exactly.
Tensor small_integers(const Shape& shape, uint64_t seed) {
  std::vector<float> v =
      testing::random_vector(static_cast<size_t>(shape_numel(shape)), seed, -8.5f, 8.5f);
  for (float& f : v) f = std::nearbyint(f);
  return convert(Tensor::from_vector(v, shape), DType::bf16);
}

TEST(Bf16StorageGpu, ReluMaskAndBiasGradientMatchTheCpuExactly) {
  CUDP_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const cudaStream_t stream = stream_for(gpu);
  for (const auto& [rows, cols] : {std::tuple<int64_t, int64_t>{1, 1},
                                   {5, 3},
                                   {1025, 12},
                                   {(1 << 14) + 3, 64},
                                   {(1 << 18) + 1, 128},
                                   {4097, 100}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    const Tensor y = convert(random_tensor({rows, cols}, 1), DType::bf16);
    const Tensor dy = small_integers({rows, cols}, 2);
    Tensor masked_cpu = Tensor::empty({rows, cols}, DType::bf16);
    Tensor db_cpu = Tensor::full({cols}, 3.0f);
    kernels::relu_mask_bias_grad_cpu(y.data<__nv_bfloat16>(), dy.data<__nv_bfloat16>(),
                                     masked_cpu.data<__nv_bfloat16>(), db_cpu.data<float>(), rows,
                                     cols, 1.0f);
    const Tensor y_gpu = y.to(gpu), dy_gpu = dy.to(gpu);
    Tensor masked = Tensor::empty({rows, cols}, DType::bf16, gpu);
    Tensor db = Tensor::full({cols}, 3.0f, gpu);
    kernels::relu_mask_bias_grad(y_gpu.data<__nv_bfloat16>(), dy_gpu.data<__nv_bfloat16>(),
                                 masked.data<__nv_bfloat16>(), db.data<float>(), rows, cols, 1.0f,
                                 stream);
    EXPECT_EQ(values(masked), values(masked_cpu));
    EXPECT_EQ(values(db), values(db_cpu));
    // In place (dy_masked = dy) and without a bias: the same mask.
    Tensor inplace = dy.to(gpu);
    kernels::relu_mask_bias_grad(y_gpu.data<__nv_bfloat16>(), inplace.data<__nv_bfloat16>(),
                                 inplace.data<__nv_bfloat16>(), nullptr, rows, cols, 1.0f, stream);
    EXPECT_EQ(values(inplace), values(masked_cpu));
    // The bf16 bias gradient alone (beta = 0 ignores what dbias held).
    Tensor plain = Tensor::full({cols}, std::nanf(""), gpu);
    kernels::bias_grad(dy_gpu.data<__nv_bfloat16>(), plain.data<float>(), rows, cols, 0.0f, stream);
    Tensor plain_cpu = Tensor::zeros({cols});
    kernels::bias_grad_cpu(dy.data<__nv_bfloat16>(), plain_cpu.data<float>(), rows, cols, 0.0f);
    EXPECT_EQ(values(plain), values(plain_cpu));
  }
}

// The module on the CPU and its clone on the GPU, the same input and upstream gradient: outputs and
// input gradients equal bit for bit (layers whose results are some of their inputs' values).
void expect_exactly_the_cpus(Module& cpu, const Tensor& x, uint64_t seed) {
  std::shared_ptr<Module> gpu = cpu.clone(Device::cuda(0));
  const Tensor y_cpu = cpu.forward(x), y_gpu = gpu->forward(x.to(Device::cuda(0)));
  EXPECT_EQ(y_gpu.dtype(), y_cpu.dtype());
  EXPECT_EQ(values(y_gpu), values(y_cpu));
  const Tensor g = convert(random_tensor(y_cpu.shape(), seed), y_cpu.dtype());
  const Tensor dx_cpu = cpu.backward(g), dx_gpu = gpu->backward(g.to(Device::cuda(0)));
  EXPECT_EQ(dx_gpu.dtype(), dx_cpu.dtype());
  EXPECT_EQ(values(dx_gpu), values(dx_cpu));
}

TEST(Bf16StorageGpu, ReluAndMaxPoolOnBf16MatchTheCpuBitForBit) {
  CUDP_REQUIRE_GPU();
  for (const auto& [kernel, stride, pad] :
       {std::tuple{2, 2, 0}, std::tuple{3, 2, 1}, std::tuple{3, 1, 1}}) {
    for (const int c : {5, 64}) {
      SCOPED_TRACE("pool " + std::to_string(kernel) + "/" + std::to_string(stride) + "/" +
                   std::to_string(pad) + ", c " + std::to_string(c));
      auto pool = std::make_shared<MaxPool2d>(kernel, stride, pad);
      expect_exactly_the_cpus(*pool, convert(random_tensor({2, 9, 7, c}, 3), DType::bf16), 4);
    }
  }
  auto relu = std::make_shared<ReLU>();
  expect_exactly_the_cpus(*relu, convert(random_tensor({3, 5, 7, 11}, 5), DType::bf16), 6);
}

// Conv2d under bf16 on each operand path. Products of bf16 operands are exact on both sides; the
// sums differ by fp32 against double (1e-4 covers them, as the fp32-output test of
// layers/conv2d_gpu_test.cpp argues) and a bf16 output may round to the neighbouring value
// (gpu_close allows one bf16 unit).
TEST(Bf16StorageGpu, Conv2dOnEveryOperandPathMatchesTheCpu) {
  CUDP_REQUIRE_TENSOR_CORES();
  struct Case {
    int c, k;
    DType input;
    bool relu;
  };
  for (const Case& t : {Case{3, 64, DType::f32, true}, Case{64, 64, DType::bf16, true},
                        Case{64, 128, DType::bf16, false}, Case{8, 12, DType::bf16, true},
                        Case{5, 16, DType::bf16, false}, Case{16, 24, DType::f32, false}}) {
    SCOPED_TRACE("c " + std::to_string(t.c) + " k " + std::to_string(t.k) + " input " +
                 dtype_name(t.input) + (t.relu ? " relu" : ""));
    auto net = std::make_shared<Sequential>();
    net->add(std::make_shared<Conv2d>(t.c, t.k, 3, 1, 1));
    if (t.relu) net->add(std::make_shared<ReLU>());
    testing::randomize_parameters(*net, 7, -0.3f, 0.3f);
    net->set_precision(Precision::bf16);
    const Tensor x = convert(random_tensor({2, 10, 12, t.c}, 8), t.input);
    auto gpu = testing::expect_gpu_matches_cpu(*net, x, 9, 1e-4, 1e-4);
    EXPECT_EQ((*static_cast<Sequential&>(*gpu)[0]).relu_fused(), t.relu);
  }
}

// Backward-data on the filters rotated in the forward's conversion pass (training) and on filters
// rotated by backward itself (a forward in eval mode keeps no rotated copy): the same operands
// through the same kernel, so the same bits.
TEST(Bf16StorageGpu, FiltersRotatedInTheForwardGiveTheSameInputGradient) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Device gpu = Device::cuda(0);
  auto conv = std::make_shared<Conv2d>(64, 128, 3, 1, 1);
  testing::randomize_parameters(*conv, 16, -0.3f, 0.3f);
  conv->set_precision(Precision::bf16);
  conv->to(gpu);
  const Tensor x = convert(random_tensor({2, 12, 10, 64}, 17, -1.f, 1.f, gpu), DType::bf16);
  const Tensor g = convert(random_tensor({2, 12, 10, 128}, 18, -1.f, 1.f, gpu), DType::bf16);
  conv->train();
  conv->forward(x);
  const std::vector<float> trained = values(conv->backward(g));
  conv->eval();
  conv->forward(x);
  EXPECT_EQ(values(conv->backward(g)), trained);
}

// Linear under bf16: the products on bf16 copies of x and W (W read k x n by backward-data; feature
// counts multiples of 8),
// and the float launchers' path (odd counts), each against the CPU path, with f32 and bf16 inputs;
// the input gradient has the input's dtype.
TEST(Bf16StorageGpu, LinearOnBothPathsMatchesTheCpu) {
  CUDP_REQUIRE_TENSOR_CORES();
  for (const auto& [in, out] : {std::pair{64, 24}, std::pair{40, 10}, std::pair{20, 16}}) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::to_string(in) + " -> " + std::to_string(out) + ", input " +
                   dtype_name(dtype));
      auto linear = std::make_shared<Linear>(in, out);
      testing::randomize_parameters(*linear, 19, -0.3f, 0.3f);
      linear->set_precision(Precision::bf16);
      const Tensor x = convert(random_tensor({6, in}, 20), dtype);
      auto gpu = testing::expect_gpu_matches_cpu(*linear, x, 21, 1e-4, 1e-4);
    }
  }
}

std::shared_ptr<Sequential> small_net(uint64_t seed) {
  auto net = std::make_shared<Sequential>();
  net->add(std::make_shared<Conv2d>(3, 32, 3, 1, 1));
  net->add(std::make_shared<ReLU>(true));
  net->add(std::make_shared<Conv2d>(32, 64, 3, 1, 1));
  net->add(std::make_shared<ReLU>(true));
  net->add(std::make_shared<MaxPool2d>(2));
  net->add(std::make_shared<Conv2d>(64, 64, 3, 1, 1));
  net->add(std::make_shared<ReLU>(true));
  net->add(std::make_shared<MaxPool2d>(2));
  net->add(std::make_shared<Flatten>());
  net->add(std::make_shared<Linear>(64 * 4 * 4, 10));
  testing::randomize_parameters(*net, seed, -0.2f, 0.2f);
  return net;
}

// End to end: where an activation lies within the sums' difference of a bf16 rounding boundary the
// two sides round it to neighbours (2^-8 relative), and the next products carry that forward; a
// ReLU mask may flip where a value rounds to either side of zero. 1e-2 on the values of this
// 4-product stack holds that and is still ten times below what skipping one layer's bf16 rounding
// on one side changes.
TEST(Bf16StorageGpu, ASmallVggMatchesTheCpuEndToEnd) {
  CUDP_REQUIRE_TENSOR_CORES();
  auto net = small_net(10);
  net->set_precision(Precision::bf16);
  testing::expect_gpu_matches_cpu(*net, random_tensor({4, 16, 16, 3}, 11), 12, 1e-2, 1e-2);
}

// The fused ReLU on the GPU, under every policy: the SIMT kernels (fp32) and the tensor cores
// (tf32, bf16) give the ReLU module's bits, with the mask hand-off
// (Module::request_input_grad_mask) where it applies: the pooling after a fused ReLU masks in its
// backward's pass under every policy, the Conv2d after one in backward-data's epilogue on the
// tensor cores (bf16 and tf32; fp32 keeps the mask in the fused layer's own pass).
class FusedReluGpu : public ::testing::TestWithParam<Precision> {};

TEST_P(FusedReluGpu, GivesTheReluModulesBits) {
  if (GetParam() == Precision::fp32) {
    CUDP_REQUIRE_GPU();
  } else {
    CUDP_REQUIRE_TENSOR_CORES();
  }
  const Device gpu = Device::cuda(0);
  auto fused = small_net(13);
  auto separate = small_net(13);
  fused->set_precision(GetParam());
  separate->set_precision(GetParam());
  separate->set_fusion(false);
  fused->to(gpu);
  separate->to(gpu);
  const Tensor x = random_tensor({4, 16, 16, 3}, 14, -1.f, 1.f, gpu);
  const Tensor y1 = fused->forward(x), y2 = separate->forward(x);
  EXPECT_TRUE((*fused)[0]->relu_fused());
  EXPECT_FALSE((*separate)[0]->relu_fused());
  const bool tensor_cores = GetParam() != Precision::fp32;
  EXPECT_EQ((*fused)[2]->input_grad_masked(), tensor_cores);
  EXPECT_TRUE((*fused)[4]->input_grad_masked());
  EXPECT_TRUE((*fused)[7]->input_grad_masked());
  EXPECT_FALSE((*separate)[4]->input_grad_masked());
  EXPECT_EQ(values(y1), values(y2));
  const Tensor g = random_tensor(y1.shape(), 15, -1.f, 1.f, gpu);
  fused->zero_grad();
  separate->zero_grad();
  EXPECT_EQ(values(fused->backward(g)), values(separate->backward(g)));
  // The bias hand-off (Module::request_input_grad_sums): each pooling after a fused ReLU added up
  // the bias gradient of the convolution before it (parameters 3 and 5) in its own pass, and under
  // tf32 the second convolution's backward-data added up the first's (parameter 1) on the way
  // (under bf16 that sum is bias_grad's pass over dx, the same order as the separate layer's).
  // Those are the same fp32 sums (1,024 and 256 terms below 1 in magnitude) in another order: they
  // differ by a few units in the last place of the partial sums (~1e-6), where one term lost or
  // counted twice would move them by that term (~1e-2 here); kernels' MaxPoolGpu and Conv2dTcTyped
  // tests bound the sums against double. Everything else is bits.
  EXPECT_TRUE((*fused)[4]->input_grad_summed());
  EXPECT_TRUE((*fused)[7]->input_grad_summed());
  EXPECT_FALSE((*separate)[4]->input_grad_summed());
  EXPECT_EQ((*fused)[2]->input_grad_summed(), tensor_cores);
  const bool first_bias_reordered = GetParam() == Precision::tf32;
  const auto a = fused->parameters(), b = separate->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    const std::vector<float> got = values(a[i]->grad), want = values(b[i]->grad);
    if (i != 3 && i != 5 && !(i == 1 && first_bias_reordered)) {
      EXPECT_EQ(got, want) << "parameter " << i;
      continue;
    }
    ASSERT_EQ(got.size(), want.size());
    for (size_t j = 0; j < got.size(); ++j) {
      EXPECT_NEAR(got[j], want[j], 2e-5 * (1.0 + std::fabs(want[j])))
          << "parameter " << i << ", element " << j;
    }
  }
}

// Two models from `make` on the GPU under `precision`, the second with set_fusion(false): the
// same output, input gradient and parameter gradients (==, element by element). Returns the fused
// model, its forward and backward done (its hand-off flags are those of that forward).
template <typename Make>
std::shared_ptr<Sequential> expect_gpu_fusion_is_exact(const Make& make, Precision precision,
                                                       const Shape& input, uint64_t seed) {
  const Device gpu = Device::cuda(0);
  auto fused = make(), separate = make();
  for (auto* m : {fused.get(), separate.get()}) {
    m->set_precision(precision);
    m->to(gpu);
  }
  separate->set_fusion(false);
  const Tensor x = random_tensor(input, seed, -1.f, 1.f, gpu);
  const Tensor y = fused->forward(x);
  EXPECT_EQ(values(y), values(separate->forward(x)));
  for (size_t i = 0; i < separate->size(); ++i) EXPECT_FALSE((*separate)[i]->relu_fused()) << i;
  const Tensor g = random_tensor(y.shape(), seed + 1, -1.f, 1.f, gpu);
  fused->zero_grad();
  separate->zero_grad();
  EXPECT_EQ(values(fused->backward(g)), values(separate->backward(g)));
  const auto a = fused->parameters(), b = separate->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(values(a[i]->grad), values(b[i]->grad)) << "parameter " << i;
  }
  return fused;
}

// The ReLUs after VGG's classifier layers run inside them on the GPU too: Linear(64, 32) on the
// bf16 tensor cores throughout, Linear(32, 12) with its backward on the float launcher (12
// outputs), Linear(12, 10) on it entirely; the ReLU modules' bits everywhere, bias gradients
// included (the mask and the column sums in one pass, the same sums in the same order).
TEST_P(FusedReluGpu, LinearGivesTheReluModulesBits) {
  if (GetParam() == Precision::fp32) {
    CUDP_REQUIRE_GPU();
  } else {
    CUDP_REQUIRE_TENSOR_CORES();
  }
  const auto make = [] { return testing::classifier_net(64, 32, 12, 51, 0.3f); };
  auto fused = expect_gpu_fusion_is_exact(make, GetParam(), {40, 64}, 52);
  EXPECT_TRUE((*fused)[0]->relu_fused());
  EXPECT_TRUE((*fused)[3]->relu_fused());
}

// VGG-BN's blocks (testing::batchnorm_block_net) for [4, 16, 16, 3] inputs.
std::shared_ptr<Sequential> batchnorm_net() {
  return testing::batchnorm_block_net(32, 64, 8, 71, 0.2f);
}

// The bias hand-off is process-wide (bench_train --bias-handoff): off for a scope, restored
// however it ends.
struct BiasHandoffOff {
  BiasHandoffOff() { detail::set_bias_handoff(false); }
  ~BiasHandoffOff() { detail::set_bias_handoff(was_on); }
  const bool was_on = detail::bias_handoff();
};

// BatchNorm2d's fused ReLU hands its mask to the layer after it on the GPU: the pooling's codes
// backward (every policy) and backward-data's epilogue (tf32 and bf16; under fp32 the Conv2d
// declines and BatchNorm masks itself). The ReLU modules' bits everywhere. The bias hand-off is
// off here (BatchNorm's sums of dx for the convolution before it are the next test's).
TEST_P(FusedReluGpu, BatchNormHandsItsMaskOn) {
  if (GetParam() == Precision::fp32) {
    CUDP_REQUIRE_GPU();
  } else {
    CUDP_REQUIRE_TENSOR_CORES();
  }
  const BiasHandoffOff no_bias_handoff;
  auto fused = expect_gpu_fusion_is_exact(batchnorm_net, GetParam(), {4, 16, 16, 3}, 72);
  EXPECT_TRUE((*fused)[3]->input_grad_masked());
  EXPECT_EQ((*fused)[7]->input_grad_masked(), GetParam() != Precision::fp32);
  EXPECT_FALSE((*fused)[1]->input_grad_summed());
}

// BatchNorm2d adds up the bias gradient of the convolution before it in its dx pass (Module's bias
// hand-off), so the convolution reads its output gradient once. Against the same layers run one
// by one (no fusion, no hand-off): the output, the input gradient and every other gradient the
// same bits; the two convolutions' biases before a BatchNorm (parameters 1 and 5) are fp32 sums of
// the same dx in another order, so each is compared with a double sum of the dx the BatchNorm
// wrote (the one-by-one run's), within a few roundings of sum |dx| of the channel, the bound of
// the kernel's test (kernels' BatchNormGpu.DxColumnSumsAreTheBiasGradientBefore). One term lost or
// counted twice would move a sum by about sum |dx| / rows, 1/1,024 or 1/256 of it here.
TEST_P(FusedReluGpu, BatchNormAddsUpTheConvolutionsBiasGradient) {
  if (GetParam() == Precision::fp32) {
    CUDP_REQUIRE_GPU();
  } else {
    CUDP_REQUIRE_TENSOR_CORES();
  }
  const Device gpu = Device::cuda(0);
  auto model = batchnorm_net(), layers = batchnorm_net();
  for (auto* m : {model.get(), layers.get()}) {
    m->set_precision(GetParam());
    m->to(gpu);
  }
  const Tensor x = random_tensor({4, 16, 16, 3}, 72, -1.f, 1.f, gpu);
  const Tensor y = model->forward(x);
  std::vector<Tensor> outputs{x};
  for (size_t i = 0; i < layers->size(); ++i) outputs.push_back((*layers)[i]->forward(outputs[i]));
  EXPECT_EQ(values(y), values(outputs.back()));
  const Tensor g = random_tensor(y.shape(), 73, -1.f, 1.f, gpu);
  model->zero_grad();
  layers->zero_grad();
  const Tensor dx = model->backward(g);
  // input_grads[i]: the gradient of child i's input, that is of child i - 1's output.
  std::vector<Tensor> input_grads(layers->size() + 1);
  input_grads.back() = g;
  for (size_t i = layers->size(); i-- > 0;) {
    input_grads[i] = (*layers)[i]->backward(input_grads[i + 1]);
  }
  EXPECT_EQ(values(dx), values(input_grads[0]));
  EXPECT_TRUE((*model)[1]->input_grad_summed());
  EXPECT_TRUE((*model)[5]->input_grad_summed());
  const auto a = model->parameters(), b = layers->parameters();
  ASSERT_EQ(a.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) {
    if (i != 1 && i != 5) {
      EXPECT_EQ(values(a[i]->grad), values(b[i]->grad)) << "parameter " << i;
      continue;
    }
    const std::vector<float> d = values(input_grads[i]);  // BatchNorm's dx: children 1 and 5
    const std::vector<float> got = values(a[i]->grad), own = values(b[i]->grad);
    const size_t c = got.size();
    std::vector<double> exact(c, 0.0), scale(c, 0.0);
    for (size_t j = 0; j < d.size(); ++j) {
      exact[j % c] += d[j];
      scale[j % c] += std::fabs(d[j]);
    }
    for (size_t ch = 0; ch < c; ++ch) {
      EXPECT_NEAR(got[ch], exact[ch], 2e-7 * scale[ch]) << "parameter " << i << ", channel " << ch;
      EXPECT_NEAR(own[ch], exact[ch], 2e-7 * scale[ch]) << "parameter " << i << ", channel " << ch;
    }
  }
}

// A bf16 layer before a tf32 one (set_precision on part of a model): the tf32 Conv2d masks the bf16
// layer's fused ReLU in backward-data's epilogue, but leaves that layer's bias gradient to it,
// since the gradient it hands back is rounded to bf16 on the way (Module widened its input): the
// bf16 layer adds up the rounded values, as it does without the fusion, so every gradient has the
// unfused model's bits. (Had the tf32 layer added up its fp32 dx, the first bias gradient would
// differ from the unfused one by the bf16 rounding of each term.)
TEST(Bf16StorageGpu, Tf32ConvLeavesABf16LayersBiasSum) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Device gpu = Device::cuda(0);
  const auto make = [&](bool fusion) {
    auto net = std::make_shared<Sequential>();
    net->add(std::make_shared<Conv2d>(8, 32, 3, 1, 1));
    net->add(std::make_shared<ReLU>(true));
    net->add(std::make_shared<Conv2d>(32, 64, 3, 1, 1));
    testing::randomize_parameters(*net, 23, -0.2f, 0.2f);
    (*net)[0]->set_precision(Precision::bf16);
    (*net)[2]->set_precision(Precision::tf32);
    net->set_fusion(fusion);
    net->to(gpu);
    return net;
  };
  auto fused = make(true), separate = make(false);
  const Tensor x = random_tensor({4, 12, 12, 8}, 24, -1.f, 1.f, gpu);
  const Tensor y1 = fused->forward(x), y2 = separate->forward(x);
  EXPECT_TRUE((*fused)[0]->relu_fused());
  EXPECT_TRUE((*fused)[2]->input_grad_masked());
  EXPECT_EQ(values(y1), values(y2));
  const Tensor g = random_tensor(y1.shape(), 25, -1.f, 1.f, gpu);
  fused->zero_grad();
  separate->zero_grad();
  EXPECT_EQ(values(fused->backward(g)), values(separate->backward(g)));
  EXPECT_FALSE((*fused)[2]->input_grad_summed());
  const auto a = fused->parameters(), b = separate->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(values(a[i]->grad), values(b[i]->grad)) << "parameter " << i;
  }
}

// The bias gradients' last launches queued through a backward and run as one at its end
// (kernels/bias.h, NOTE [Deferred bias gradients]): the same bits as one launch each, for every
// gradient of a model with the poolings' and backward-data's hand-off (small_net) and one with
// BatchNorm's (batchnorm_net). And a backward hook sees its module's gradients complete: the hook
// on the second convolution copies its bias gradient (parameter 3, added up by the pooling after
// it, whose sum is queued) as the hook runs, and the copy is the final gradient, not the zeros
// the gradient held before the flush. A second queued run of each model goes inside a scope of
// the test's own, so the model's is not the outermost and leaves its sums queued: some are (the
// model queues), and they land at the test's flush.
TEST_P(FusedReluGpu, QueuedBiasSumsGiveTheBitsOfOneLaunchEach) {
  if (GetParam() == Precision::fp32) {
    CUDP_REQUIRE_GPU();
  } else {
    CUDP_REQUIRE_TENSOR_CORES();
  }
  const testing::ScopedSwitch<bool> restore(kernels::detail::deferred_bias_grads,
                                            kernels::detail::set_deferred_bias_grads,
                                            kernels::detail::deferred_bias_grads());
  const Device gpu = Device::cuda(0);
  const auto run = [&](const std::shared_ptr<Sequential>& net, const Shape& input, bool queued,
                       Tensor* hooked, bool outer_scope = false) {
    kernels::detail::set_deferred_bias_grads(queued);
    net->set_precision(GetParam());
    net->to(gpu);
    if (hooked != nullptr) {
      Module& conv = *(*net)[2];
      conv.set_backward_hook(
          [&conv, hooked] { *hooked = conv.parameters()[1]->grad.clone_async(); });
    }
    const Tensor x = random_tensor(input, 80, -1.f, 1.f, gpu);
    const Tensor y = net->forward(x);
    net->zero_grad();
    const Tensor g = random_tensor(y.shape(), 81, -1.f, 1.f, gpu);
    Tensor dx;
    if (outer_scope) {
      kernels::DeferredBiasGrads scope(0, stream_for(gpu));
      EXPECT_TRUE(scope.active());
      dx = net->backward(g);
      EXPECT_GT(kernels::detail::deferred_bias_grads_queued(), 0) << "the model queued nothing";
      kernels::flush_deferred_bias_grads();
    } else {
      dx = net->backward(g);
    }
    std::vector<std::vector<float>> grads{values(dx)};
    for (const auto& p : net->parameters()) grads.push_back(values(p->grad));
    return grads;
  };
  Tensor hooked;
  const auto queued = run(small_net(30), {4, 16, 16, 3}, true, &hooked);
  const auto each = run(small_net(30), {4, 16, 16, 3}, false, nullptr);
  ASSERT_EQ(queued.size(), each.size());
  for (size_t i = 0; i < queued.size(); ++i) {
    EXPECT_EQ(queued[i], each[i]) << (i == 0 ? "the input gradient" : "a parameter gradient")
                                  << " (" << i << ")";
  }
  ASSERT_TRUE(hooked.defined());
  EXPECT_EQ(values(hooked), queued[4]) << "the hook ran before its bias gradient was complete";
  EXPECT_NE(values(hooked), std::vector<float>(queued[4].size(), 0.f));
  // And without the hook, inside a scope of the test's: the pooling's and backward-data's sums
  // were queued, and land with the same bits at the test's flush.
  const auto outer = run(small_net(30), {4, 16, 16, 3}, true, nullptr, true);
  for (size_t i = 0; i < outer.size(); ++i) EXPECT_EQ(outer[i], each[i]) << i;
  const auto bn_queued = run(batchnorm_net(), {4, 16, 16, 3}, true, nullptr, true);
  const auto bn_each = run(batchnorm_net(), {4, 16, 16, 3}, false, nullptr);
  ASSERT_EQ(bn_queued.size(), bn_each.size());
  for (size_t i = 0; i < bn_queued.size(); ++i) EXPECT_EQ(bn_queued[i], bn_each[i]) << i;
}

INSTANTIATE_TEST_SUITE_P(Bf16StorageGpu, FusedReluGpu,
                         ::testing::Values(Precision::fp32, Precision::tf32, Precision::bf16),
                         [](const auto& info) { return std::string(precision_name(info.param)); });

}  // namespace
}  // namespace cudp
