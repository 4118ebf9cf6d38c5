// The VGG builder on the CPU: parameter counts of all eight torchvision models, torchvision's
// state_dict names, the compact head, reproducible seeding, input-size errors, clone, and a small
// model's forward and backward.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dropout.h"
#include "layers/linear.h"
#include "layers/vgg.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

// Counts from torchvision (sum of p.numel() over model.parameters()). Built without initialisation:
// 140M random draws per model on the CPU would dominate the test's time and prove nothing here.
TEST(VggTest, ParameterCountsMatchTorchvision) {
  struct Case {
    char config;
    bool batch_norm;
    int64_t count;
  };
  const Case cases[] = {{'A', false, 132'863'336}, {'B', false, 133'047'848},
                        {'D', false, 138'357'544}, {'E', false, 143'667'240},
                        {'A', true, 132'868'840},  {'B', true, 133'053'736},
                        {'D', true, 138'365'992},  {'E', true, 143'678'248}};
  for (const Case& c : cases) {
    Vgg net(init::skip_init, c.config, {.batch_norm = c.batch_norm});
    EXPECT_EQ(net.num_parameters(), c.count)
        << "config " << c.config << " batch_norm " << c.batch_norm;
  }
}

TEST(VggTest, BuildersPickTheirConfiguration) {
  const VggOptions compact{.num_classes = 10, .head = VggHead::Compact};
  EXPECT_EQ(vgg11(compact)->config(), 'A');
  EXPECT_EQ(vgg13(compact)->config(), 'B');
  EXPECT_EQ(vgg16(compact)->config(), 'D');
  EXPECT_EQ(vgg19(compact)->config(), 'E');
  EXPECT_EQ(vgg16(compact)->features()->size(), 31u);  // 13 convs, 13 ReLUs, 5 pools
}

TEST(VggTest, Vgg16StateDictHasTorchvisionsKeys) {
  auto net = std::make_shared<Vgg>(init::skip_init, 'D', VggOptions{});
  std::set<std::string> expected;
  for (int i : {0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28}) {
    expected.insert("features." + std::to_string(i) + ".weight");
    expected.insert("features." + std::to_string(i) + ".bias");
  }
  for (int i : {0, 3, 6}) {
    expected.insert("classifier." + std::to_string(i) + ".weight");
    expected.insert("classifier." + std::to_string(i) + ".bias");
  }
  std::set<std::string> keys;
  for (auto& [name, t] : net->named_parameters()) keys.insert(name);
  EXPECT_EQ(keys, expected);
  EXPECT_TRUE(net->named_buffers().empty());
  EXPECT_EQ(net->type_name(), "VGG");
  EXPECT_NE(net->avgpool(), nullptr);
  const auto& first = *net->named_parameters()[0].second;
  EXPECT_EQ(first.data.shape(), (Shape{64, 3, 3, 3}));  // KRSC inside; OIHW [64, 3, 3, 3] outside
  EXPECT_EQ(net->classifier()->named_parameters()[0].second->data.shape(), (Shape{4096, 25088}));
}

TEST(VggTest, Vgg16BnHasTorchvisionsBatchNormKeys) {
  auto net = std::make_shared<Vgg>(init::skip_init, 'D', VggOptions{.batch_norm = true});
  std::set<std::string> buffers;
  for (auto& [name, t] : net->named_buffers()) buffers.insert(name);
  EXPECT_EQ(buffers.size(), 13u * 3);
  for (int i : {1, 4, 8, 11, 15, 18, 21, 25, 28, 31, 35, 38, 41}) {
    for (const char* b : {"running_mean", "running_var", "num_batches_tracked"}) {
      EXPECT_TRUE(buffers.count("features." + std::to_string(i) + "." + b)) << i << b;
    }
  }
  EXPECT_EQ(net->features()->size(), 44u);
}

TEST(VggTest, CompactHeadIsSmall) {
  auto net = vgg11({.in_channels = 1, .num_classes = 10, .head = VggHead::Compact});
  EXPECT_EQ(net->avgpool(), nullptr);
  std::set<std::string> children;
  for (auto& [name, child] : net->children()) children.insert(name);
  EXPECT_EQ(children, (std::set<std::string>{"features", "flatten", "classifier"}));
  const auto state = net->state_dict();
  EXPECT_EQ(state.at("features.0.weight").shape(), (Shape{64, 1, 3, 3}));
  EXPECT_EQ(state.at("classifier.0.weight").shape(), (Shape{512, 512}));
  EXPECT_EQ(state.at("classifier.3.weight").shape(), (Shape{512, 512}));
  EXPECT_EQ(state.at("classifier.6.weight").shape(), (Shape{10, 512}));
}

TEST(VggTest, OneSeedReproducesTheModel) {
  const VggOptions options{
      .num_classes = 10, .batch_norm = true, .head = VggHead::Compact, .seed = 5};
  auto a = vgg11(options), b = vgg11(options);
  auto c = vgg11({.num_classes = 10, .batch_norm = true, .head = VggHead::Compact, .seed = 6});
  const auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(values(pa[i].second->data), values(pb[i].second->data)) << pa[i].first;
  }
  EXPECT_NE(values(pa[0].second->data), values(pc[0].second->data));
  // The derivation documented in layers/init.h.
  Conv2d alone(3, 64, 3, 1, 1, true, init::derive_seed(5, "features.0"));
  EXPECT_EQ(values(alone.weight().data), values(pa[0].second->data));
  Linear head(512, 10, true, init::derive_seed(5, "classifier.6"));
  EXPECT_EQ(values(head.weight().data),
            values(a->classifier()->named_parameters()[4].second->data));
  // torchvision's init: BN weight 1 and bias 0, every bias 0.
  for (auto& [name, p] : a->named_parameters()) {
    if (name.find("bias") != std::string::npos) {
      for (float v : values(p->data)) ASSERT_EQ(v, 0.0f) << name;
    }
  }
  for (float v : values(a->state_dict().at("features.1.weight"))) ASSERT_EQ(v, 1.0f);
  auto d2 = std::static_pointer_cast<Dropout>((*a->classifier())[2]);
  auto d5 = std::static_pointer_cast<Dropout>((*a->classifier())[5]);
  EXPECT_EQ(d2->seed(), init::derive_seed(5, "classifier.2"));
  EXPECT_NE(d2->seed(), d5->seed());
}

TEST(VggTest, InputSizeMustBeAMultipleOf32) {
  auto net = vgg11({.num_classes = 10, .head = VggHead::Compact});
  EXPECT_THROW_WITH(net->forward(random_tensor({1, 30, 30, 3}, 1)),
                    "VGG: input size 30x30 is not a multiple of 32");
  EXPECT_THROW_WITH(net->forward(random_tensor({1, 64, 64, 3}, 1)),
                    "VGG with the Compact head takes 32x32 inputs, got 64x64");
  EXPECT_THROW_WITH(vgg('C'), "vgg: unknown configuration 'C'");
  EXPECT_THROW_WITH(vgg11({.dropout = 1.0f}), "vgg: dropout must be in [0, 1), got 1");
}

TEST(VggTest, SmallModelForwardAndBackwardOnTheCpu) {
  auto net = vgg11({.num_classes = 10, .batch_norm = true, .head = VggHead::Compact, .seed = 1});
  const Tensor x = random_tensor({2, 32, 32, 3}, 2);
  const Tensor y = net->forward(x);
  ASSERT_EQ(y.shape(), (Shape{2, 10}));
  for (float v : values(y)) ASSERT_TRUE(std::isfinite(v));
  const Tensor dx = net->backward(random_tensor({2, 10}, 3));
  EXPECT_EQ(dx.shape(), x.shape());
  for (auto& [name, p] : net->named_parameters()) {
    const auto g = values(p->grad);
    double norm = 0;
    for (float v : g) {
      ASSERT_TRUE(std::isfinite(v)) << name;
      norm += double(v) * v;
    }
    EXPECT_GT(norm, 0.0) << name;
  }
  // Features and classifier run separately, with the flatten between, give the same output.
  net->eval();
  const Tensor whole = net->forward(x);
  Tensor parts = net->features()->forward(x);
  parts = net->classifier()->forward(net->flatten()->forward(parts));
  EXPECT_EQ(values(parts), values(whole));
}

TEST(VggTest, CloneKeepsValuesAndDropoutState) {
  auto net = vgg11({.num_classes = 10, .head = VggHead::Compact, .seed = 2});
  net->forward(random_tensor({2, 32, 32, 3}, 4));  // advances the dropout offsets
  auto copy = std::static_pointer_cast<Vgg>(net->clone(Device::cpu()));
  EXPECT_EQ(copy->config(), 'A');
  const auto a = net->named_parameters(), b = copy->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(values(a[i].second->data), values(b[i].second->data));
  for (size_t i : {2, 5}) {
    EXPECT_EQ(std::static_pointer_cast<Dropout>((*copy->classifier())[i])->offset(),
              std::static_pointer_cast<Dropout>((*net->classifier())[i])->offset());
  }
  const Tensor x = random_tensor({2, 32, 32, 3}, 5);
  EXPECT_EQ(values(copy->forward(x)), values(net->forward(x)));  // same masks too
}

TEST(VggTest, SetPrecisionReachesEveryLayerAndItsClones) {
  auto net = std::make_shared<Vgg>(init::skip_init, 'A',
                                   VggOptions{.num_classes = 10, .head = VggHead::Compact});
  EXPECT_EQ(net->precision(), Precision::fp32);
  net->set_precision(Precision::bf16);
  int products = 0;
  for (auto& [path, m] : net->named_modules()) {
    EXPECT_EQ(m->precision(), Precision::bf16) << path;
    if (auto* conv = dynamic_cast<Conv2d*>(m)) {
      EXPECT_EQ(conv->math(), kernels::Math::BF16) << path;
      ++products;
    }
    if (auto* linear = dynamic_cast<Linear*>(m)) {
      EXPECT_EQ(linear->math(), kernels::Math::BF16) << path;
      ++products;
    }
  }
  EXPECT_EQ(products, 8 + 3);  // VGG-11: 8 convolutions; the compact head: 3 linear layers
  auto copy = net->clone(Device::cpu());
  for (auto& [path, m] : copy->named_modules()) {
    EXPECT_EQ(m->precision(), Precision::bf16) << path;
  }
  net->set_precision(Precision::tf32);
  EXPECT_EQ(std::static_pointer_cast<Conv2d>((*net->features())[0])->math(), kernels::Math::TF32);
}

}  // namespace
}  // namespace cudp
