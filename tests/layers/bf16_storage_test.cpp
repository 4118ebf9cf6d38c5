// The bf16 policy's storage between layers and the ReLU fusion, on the CPU (the GPU's reference):
// which dtype each layer returns, that a gradient has its value's dtype, that a layer which does
// not take bf16 sees its input widened and returns its input gradient narrowed, that a fused ReLU
// gives the same bits as the ReLU module, and that a model whose input needs no gradient skips it.
#include <gtest/gtest.h>

#include <algorithm>

#include "common/bf16.h"
#include "engine/core/error.h"
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

// A small VGG-like stack: the first layer's 3 channels, a fused ReLU, pooling, a second conv whose
// ReLU is fused too, then a classifier that does not take bf16.
std::shared_ptr<Sequential> small_net(uint64_t seed) {
  auto net = std::make_shared<Sequential>();
  net->add(std::make_shared<Conv2d>(3, 8, 3, 1, 1));
  net->add(std::make_shared<ReLU>(true));
  net->add(std::make_shared<MaxPool2d>(2));
  net->add(std::make_shared<Conv2d>(8, 16, 3, 1, 1));
  net->add(std::make_shared<ReLU>());
  net->add(std::make_shared<Flatten>());
  net->add(std::make_shared<Linear>(16 * 4 * 4, 10));
  testing::randomize_parameters(*net, seed, -0.5f, 0.5f);
  return net;
}

std::vector<float> gradients(Module& m) {
  std::vector<float> out;
  for (Parameter* p : m.parameters()) {
    const std::vector<float> g = values(p->grad);
    out.insert(out.end(), g.begin(), g.end());
  }
  return out;
}

// `fused` and `separate` (the same model, set_fusion(false)) under `precision`: the same output for
// x, the same input gradient and parameter gradients for a random output gradient. Returns the
// fused model, forward and backward done.
std::shared_ptr<Sequential> expect_fusion_is_exact(std::shared_ptr<Sequential> fused,
                                                   std::shared_ptr<Sequential> separate,
                                                   Precision precision, const Tensor& x,
                                                   uint64_t seed) {
  fused->set_precision(precision);
  separate->set_precision(precision);
  separate->set_fusion(false);
  const Tensor y1 = fused->forward(x), y2 = separate->forward(x);
  EXPECT_EQ(values(y1), values(y2));
  const Tensor g = random_tensor(y1.shape(), seed);
  fused->zero_grad();
  separate->zero_grad();
  EXPECT_EQ(values(fused->backward(g)), values(separate->backward(g)));
  EXPECT_EQ(gradients(*fused), gradients(*separate));
  return fused;
}

TEST(Bf16Storage, EachLayerReturnsItsDtypeAndGradientsHaveTheirValuesDtype) {
  auto net = small_net(1);
  net->set_precision(Precision::bf16);
  const Tensor x = random_tensor({2, 8, 8, 3}, 2);
  Tensor h = x;
  const std::vector<DType> expected = {DType::bf16, DType::bf16, DType::bf16, DType::bf16,
                                       DType::bf16, DType::bf16, DType::f32};
  for (size_t i = 0; i < net->size(); ++i) {
    h = (*net)[i]->forward(h);
    EXPECT_EQ(h.dtype(), expected[i]) << "layer " << i << " " << (*net)[i]->type_name();
  }
  // Backward layer by layer: each returns its input's dtype (Flatten keeps bf16, Linear takes it
  // and returns a bf16 gradient; the first conv's input was f32).
  Tensor g = random_tensor(h.shape(), 3);
  for (size_t i = net->size(); i-- > 0;) {
    g = (*net)[i]->backward(g);
    const DType input = i == 0 ? DType::f32 : expected[i - 1];
    EXPECT_EQ(g.dtype(), input) << "gradient into layer " << i;
  }
}

TEST(Bf16Storage, ThroughASequentialTheModelsInputGradientIsF32) {
  auto net = small_net(4);
  net->set_precision(Precision::bf16);
  const Tensor y = net->forward(random_tensor({2, 8, 8, 3}, 5));
  EXPECT_EQ(y.dtype(), DType::f32);  // Linear's output: it does not take bf16
  EXPECT_EQ(net->backward(random_tensor(y.shape(), 6)).dtype(), DType::f32);
}

// The ReLU that follows a Conv2d runs in its epilogue under every precision policy: the same bits
// as the ReLU module in forward, backward and every parameter gradient, and the ReLU module is not
// run.
class FusedRelu : public ::testing::TestWithParam<Precision> {};

TEST_P(FusedRelu, GivesTheReluModulesBits) {
  auto separate = small_net(7);
  auto fused =
      expect_fusion_is_exact(small_net(7), separate, GetParam(), random_tensor({3, 8, 8, 3}, 8), 9);
  EXPECT_TRUE((*fused)[0]->relu_fused());
  EXPECT_TRUE((*fused)[3]->relu_fused());
  EXPECT_FALSE((*separate)[0]->relu_fused());
  // The gradient reached the first layer's parameters through the masks (not all zero).
  const std::vector<float> first = values((*fused)[0]->parameters()[0]->grad);
  EXPECT_TRUE(std::any_of(first.begin(), first.end(), [](float v) { return v != 0.0f; }));
  // The inplace ReLU (layer 1) was skipped: it never ran, so it has nothing for a backward.
  const Tensor g = random_tensor({3, 8, 8, 8}, 10);
  const Tensor g1 = GetParam() == Precision::bf16 ? convert(g, DType::bf16) : g;
  EXPECT_THROW_WITH((*fused)[1]->backward(g1), "without a forward()");
}

INSTANTIATE_TEST_SUITE_P(Bf16Storage, FusedRelu,
                         ::testing::Values(Precision::fp32, Precision::tf32, Precision::bf16),
                         [](const auto& info) { return std::string(precision_name(info.param)); });

// The ReLU mask hand-off (Module::request_input_grad_mask): a fused ReLU followed by a Conv2d or a
// MaxPool2d leaves its backward's mask to that layer, which applies it to the gradient it returns
// (on the CPU after its reference; on the GPU in backward-data's epilogue or pooling's pass). Same
// bits as the ReLU modules, under every precision. A Flatten after a fused ReLU declines.
std::shared_ptr<Sequential> handoff_net(uint64_t seed, int hw) {
  auto net = std::make_shared<Sequential>();
  net->add(std::make_shared<Conv2d>(3, 8, 3, 1, 1));
  net->add(std::make_shared<ReLU>());
  net->add(std::make_shared<Conv2d>(8, 16, 3, 1, 1));  // masks the first conv's ReLU
  net->add(std::make_shared<ReLU>());
  net->add(std::make_shared<MaxPool2d>(2));  // masks the second conv's ReLU
  net->add(std::make_shared<Conv2d>(16, 16, 3, 1, 1));
  net->add(std::make_shared<ReLU>());
  net->add(std::make_shared<Flatten>());  // declines: the third conv masks its own
  net->add(std::make_shared<Linear>(16 * (hw / 2) * (hw / 2), 10));
  testing::randomize_parameters(*net, seed, -0.5f, 0.5f);
  return net;
}

class ReluMaskHandOff : public ::testing::TestWithParam<Precision> {};

TEST_P(ReluMaskHandOff, GivesTheReluModulesBits) {
  auto separate = handoff_net(31, 8);
  const Tensor x = random_tensor({3, 8, 8, 3}, 32);
  auto fused = expect_fusion_is_exact(handoff_net(31, 8), separate, GetParam(), x, 33);
  EXPECT_TRUE((*fused)[2]->input_grad_masked());
  EXPECT_TRUE((*fused)[4]->input_grad_masked());
  EXPECT_FALSE((*fused)[0]->input_grad_masked());  // nothing fused before it
  EXPECT_FALSE((*fused)[7]->input_grad_masked());  // Flatten is asked and declines
  EXPECT_FALSE((*separate)[2]->input_grad_masked());
  // A layer called alone after the Sequential's forward is asked nothing.
  Module& conv = *(*fused)[2];
  conv.forward((*fused)[0]->forward(x));
  EXPECT_FALSE(conv.input_grad_masked());
  // A request holds for one forward, one that fails included.
  const Tensor h = (*fused)[0]->forward(x);
  conv.request_input_grad_mask(true);
  EXPECT_THROW(conv.forward(random_tensor({3, 8, 8, 5}, 34)), std::exception);
  conv.forward(h);
  EXPECT_FALSE(conv.input_grad_masked());
}

INSTANTIATE_TEST_SUITE_P(Bf16Storage, ReluMaskHandOff,
                         ::testing::Values(Precision::fp32, Precision::tf32, Precision::bf16),
                         [](const auto& info) { return std::string(precision_name(info.param)); });

// BatchNorm2d's fused ReLU hands its mask to the layer after it too: a max pooling, a Conv2d. The
// same bits as the ReLU modules under every precision, and the BatchNorm layers' own backward no
// longer reads their output.
std::shared_ptr<Sequential> batchnorm_handoff_net(uint64_t seed) {
  return testing::batchnorm_block_net(8, 16, 4, seed, 0.5f);
}

TEST_P(ReluMaskHandOff, BatchNormGivesTheReluModulesBits) {
  auto separate = batchnorm_handoff_net(61);
  auto fused = expect_fusion_is_exact(batchnorm_handoff_net(61), separate, GetParam(),
                                      random_tensor({3, 8, 8, 3}, 62), 63);
  EXPECT_TRUE((*fused)[1]->relu_fused());
  EXPECT_TRUE((*fused)[3]->input_grad_masked());
  EXPECT_TRUE((*fused)[7]->input_grad_masked());
  EXPECT_FALSE((*separate)[3]->input_grad_masked());
  // In evaluation (the frozen statistics' backward), the same.
  auto frozen = batchnorm_handoff_net(61), frozen_separate = batchnorm_handoff_net(61);
  frozen->eval();
  frozen_separate->eval();
  expect_fusion_is_exact(frozen, frozen_separate, GetParam(), random_tensor({3, 8, 8, 3}, 64), 65);
  EXPECT_TRUE((*frozen)[3]->input_grad_masked());
  // Switched off (bench_train --bn-mask-handoff off), BatchNorm masks itself: the same bits. The
  // switch is process-wide: restored however the block ends.
  struct Restore {
    ~Restore() { detail::set_batchnorm_mask_handoff(true); }
  } restore;
  detail::set_batchnorm_mask_handoff(false);
  auto own = expect_fusion_is_exact(batchnorm_handoff_net(61), batchnorm_handoff_net(61),
                                    GetParam(), random_tensor({3, 8, 8, 3}, 62), 63);
  EXPECT_FALSE((*own)[3]->input_grad_masked());
  EXPECT_EQ(values(own->parameters()[0]->grad), values(fused->parameters()[0]->grad));
}

// fuse_relu(true) holds for one forward: a layer called directly after a Sequential's forward
// computes itself alone (negative outputs stay).
TEST(Bf16Storage, AFusedReluHoldsForOneForwardOnly) {
  auto net = small_net(21);
  net->set_precision(Precision::bf16);
  const Tensor x = random_tensor({2, 8, 8, 3}, 22);
  net->forward(x);
  Module& conv = *(*net)[0];
  EXPECT_TRUE(conv.relu_fused());
  const std::vector<float> alone = values(conv.forward(x));
  EXPECT_FALSE(conv.relu_fused());
  EXPECT_LT(*std::min_element(alone.begin(), alone.end()), 0.0f);
}

// A layer that cannot fuse refuses to be asked.
TEST(Bf16Storage, ALayerThatCannotFuseRefuses) {
  Flatten flatten;
  EXPECT_FALSE(flatten.can_fuse_relu());
  EXPECT_THROW_WITH(flatten.fuse_relu(true), "Flatten cannot apply a ReLU to its output");
}

// A classifier as VGG's: Linear, ReLU, Dropout, Linear, ReLU, Linear. The ReLUs after the Linear
// layers run inside them (max(y, 0) after the bias; the mask in the bias gradient's pass): the
// ReLU modules' bits everywhere, under every precision, the Dropout between them included (the
// same seed in both models: the same mask).
std::shared_ptr<Sequential> classifier_net(uint64_t seed) {
  return testing::classifier_net(32, 24, 16, seed, 0.5f);
}

TEST_P(FusedRelu, LinearGivesTheReluModulesBits) {
  auto separate = classifier_net(41);
  auto fused = expect_fusion_is_exact(classifier_net(41), separate, GetParam(),
                                      random_tensor({6, 32}, 42), 43);
  EXPECT_TRUE((*fused)[0]->relu_fused());
  EXPECT_TRUE((*fused)[3]->relu_fused());
  EXPECT_FALSE((*fused)[5]->relu_fused());  // nothing after it
  EXPECT_FALSE((*separate)[0]->relu_fused());
  // The masks reached the first layer's gradient: some rows zeroed, not all.
  const std::vector<float> first = values((*fused)[0]->parameters()[0]->grad);
  EXPECT_TRUE(std::any_of(first.begin(), first.end(), [](float v) { return v != 0.0f; }));
  EXPECT_TRUE(std::any_of(first.begin(), first.end(), [](float v) { return v == 0.0f; }));
}

// A layer that does not take bf16 (Linear) computes on the widened values (exact) and returns its
// input gradient rounded to bf16: bit for bit what it gives on an f32 copy, then rounded.
TEST(Bf16Storage, ALayerThatDoesNotTakeBf16SeesWidenedValues) {
  Linear a(6, 5), b(6, 5);
  testing::randomize_parameters(a, 12);
  testing::randomize_parameters(b, 12);
  const Tensor x = convert(random_tensor({4, 6}, 13), DType::bf16);
  const Tensor xf = convert(x, DType::f32);
  EXPECT_EQ(values(a.forward(x)), values(b.forward(xf)));
  const Tensor g = random_tensor({4, 5}, 14);
  const Tensor dx = a.backward(g);
  EXPECT_EQ(dx.dtype(), DType::bf16);
  EXPECT_EQ(values(dx), values(convert(b.backward(g), DType::bf16)));
  EXPECT_EQ(values(a.weight().grad), values(b.weight().grad));
}

// ReLU and MaxPool2d on bf16: the float path's results on the widened values, exactly (both
// return one of their inputs, or 0, or a sum of one element).
TEST(Bf16Storage, ReluAndMaxPoolOnBf16AreTheFloatPathsExactly) {
  const Tensor x = convert(random_tensor({2, 6, 6, 5}, 15), DType::bf16);
  const Tensor xf = convert(x, DType::f32);
  ReLU relu, relu_f;
  const Tensor y = relu.forward(x);
  EXPECT_EQ(y.dtype(), DType::bf16);
  EXPECT_EQ(values(y), values(relu_f.forward(xf)));
  const Tensor g = convert(random_tensor(y.shape(), 16), DType::bf16);
  EXPECT_EQ(values(relu.backward(g)), values(relu_f.backward(convert(g, DType::f32))));

  MaxPool2d pool(2), pool_f(2);
  const Tensor p = pool.forward(x);
  EXPECT_EQ(p.dtype(), DType::bf16);
  EXPECT_EQ(values(p), values(pool_f.forward(xf)));
  const Tensor gp = convert(random_tensor(p.shape(), 17), DType::bf16);
  const Tensor dx = pool.backward(gp);
  EXPECT_EQ(dx.dtype(), DType::bf16);
  EXPECT_EQ(values(dx), values(pool_f.backward(convert(gp, DType::f32))));
  pool.forward(x);  // the backward above freed what the forward saved
  EXPECT_THROW_WITH(pool.backward(convert(gp, DType::f32)), "a gradient has its value's dtype");
}

// set_input_grad(false) on a model: the first layer skips backward-data and the model's backward
// returns an undefined tensor; every parameter gradient is what it is with the input gradient.
TEST(InputGradient, AModelWhoseInputNeedsNoGradientSkipsItAndChangesNothingElse) {
  for (const Precision precision : {Precision::fp32, Precision::bf16}) {
    auto with = small_net(18), without = small_net(18);
    with->set_precision(precision);
    without->set_precision(precision);
    without->set_input_grad(false);
    const Tensor x = random_tensor({2, 8, 8, 3}, 19);
    const Tensor y = with->forward(x);
    EXPECT_EQ(values(without->forward(x)), values(y));
    const Tensor g = random_tensor(y.shape(), 20);
    with->zero_grad();
    without->zero_grad();
    EXPECT_TRUE(with->backward(g).defined());
    EXPECT_FALSE(without->backward(g).defined()) << precision_name(precision);
    EXPECT_FALSE((*without)[0]->input_grad());
    EXPECT_TRUE((*without)[3]->input_grad());  // the second conv's input needs its gradient
    EXPECT_EQ(gradients(*with), gradients(*without)) << precision_name(precision);
  }
}

}  // namespace
}  // namespace cudp
