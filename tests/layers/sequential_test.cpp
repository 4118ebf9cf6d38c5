// Sequential on the CPU: index names, forward as the chain of its children, backward in reverse,
// the whole chain's gradient (linear pieces only, so finite differences are exact up to
// rounding), and a child's ValueError naming the child by its path (NOTE [Locating errors in
// children], layers/module.h), through nested Sequentials and VGG.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <typeinfo>

#include "layers/activation.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/vgg.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

TEST(SequentialTest, ChildrenAreNamedByIndex) {
  Sequential seq({std::make_shared<Linear>(4, 3), std::make_shared<ReLU>()});
  auto last = seq.add(std::make_shared<Linear>(3, 2));
  EXPECT_EQ(seq.size(), 3u);
  EXPECT_EQ(seq[2], last);
  std::vector<std::string> names;
  for (auto& [name, child] : seq.children()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"0", "1", "2"}));
  EXPECT_THROW_WITH(seq[3], "Sequential: index 3 out of range for 3 modules");
}

TEST(SequentialTest, ForwardChainsAndBackwardReverses) {
  auto conv = std::make_shared<Conv2d>(2, 3, 3, 1, 1, true, 1);
  auto relu = std::make_shared<ReLU>();
  auto pool = std::make_shared<MaxPool2d>(2);
  Sequential seq({conv, relu, pool});
  const Tensor x = random_tensor({2, 4, 4, 2}, 2);
  const Tensor y = seq.forward(x);
  // The same chain by hand, on a clone so that the two runs do not share saved state.
  auto by_hand = std::static_pointer_cast<Sequential>(seq.clone(Device::cpu()));
  Tensor expected = x;
  for (size_t i = 0; i < by_hand->size(); ++i) expected = (*by_hand)[i]->forward(expected);
  EXPECT_EQ(values(y), values(expected));
  const Tensor g = random_tensor(y.shape(), 3);
  const Tensor dx = seq.backward(g);
  Tensor dg = g;
  for (size_t i = by_hand->size(); i-- > 0;) dg = (*by_hand)[i]->backward(dg);
  EXPECT_EQ(values(dx), values(dg));
  EXPECT_EQ(values(conv->weight().grad),
            values(std::static_pointer_cast<Conv2d>((*by_hand)[0])->weight().grad));
}

// A chain propagates each layer's rounding through the next ones (a Linear over 12 features can
// multiply an input's error by up to 12 max|W|), so the rounding budget is larger than one layer's.
TEST(SequentialTest, GradientsThroughAChain) {
  Sequential seq({std::make_shared<Conv2d>(2, 3, 3, 2, 1), std::make_shared<AdaptiveAvgPool2d>(2),
                  std::make_shared<Flatten>(), std::make_shared<Linear>(12, 4)});
  testing::randomize_parameters(seq, 4);
  testing::check_gradients(seq, random_tensor({2, 5, 6, 2}, 5), 6, {.h = 0.25, .ulps = 32});
}

TEST(SequentialTest, EmptyIsTheIdentity) {
  Sequential seq;
  const Tensor x = random_tensor({2, 3}, 7);
  EXPECT_TRUE(seq.forward(x).shares_storage(x));
}

TEST(SequentialTest, RejectsANullModule) {
  Sequential seq;
  EXPECT_THROW_WITH(seq.add(std::shared_ptr<Module>()), "Sequential::add: module 0 is null");
}

// ---- errors located in children --------------------------------------------------------------

// What a ValueError thrown by `statement` carried; `thrown` false when it threw none.
struct Thrown {
  bool thrown = false;
  bool exactly_value_error = false;  // its dynamic type is ValueError itself, no subclass
  std::string message;
  std::string file;
  int line = 0;
};

Thrown value_error_of(const std::function<void()>& statement) {
  try {
    statement();
  } catch (const ValueError& e) {
    return {true, typeid(e) == typeid(ValueError), e.message(), e.file(), e.line()};
  }
  return {};
}

// The located error is `original` with the path in front, the same type, file and line.
void expect_located(const Thrown& located, const Thrown& original, const std::string& prefix) {
  ASSERT_TRUE(original.thrown) << "the wrong layer alone must throw";
  ASSERT_TRUE(located.thrown) << "expected a ValueError: " << prefix << original.message;
  EXPECT_TRUE(located.exactly_value_error);
  EXPECT_EQ(located.message, prefix + original.message);
  EXPECT_EQ(located.file, original.file);
  EXPECT_EQ(located.line, original.line);
}

// conv(3 -> 8) with its fused ReLU, a pool, then a convolution that wants 16 channels: the 4th
// layer gets 8.
std::shared_ptr<Sequential> wrong_at_layer_3() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, 8, 3, 1, 1), std::make_shared<ReLU>(),
      std::make_shared<MaxPool2d>(2), std::make_shared<Conv2d>(16, 4, 3, 1, 1)});
}

// What Conv2d(16 -> 4) says about the 8-channel tensor the chain above gives it.
Thrown conv16_on_8_channels() {
  return value_error_of([] { Conv2d(16, 4, 3, 1, 1).forward(random_tensor({2, 4, 4, 8}, 1)); });
}

TEST(SequentialTest, AChildsErrorNamesItsIndexAndType) {
  auto seq = wrong_at_layer_3();
  const Thrown located = value_error_of([&] { seq->forward(random_tensor({2, 8, 8, 3}, 2)); });
  expect_located(located, conv16_on_8_channels(), "in layer 3 (Conv2d) of a Sequential: ");
  EXPECT_EQ(
      located.message,
      "in layer 3 (Conv2d) of a Sequential: Conv2d: expected an NHWC f32 input [N, H, W, 16], "
      "got Tensor[2, 4, 4, 8] f32 cpu");
}

TEST(SequentialTest, NestedSequentialsGiveOneDottedPath) {
  auto outer = std::make_shared<Sequential>(
      std::vector<std::shared_ptr<Module>>{std::make_shared<Conv2d>(2, 3, 1), wrong_at_layer_3()});
  const Tensor x = random_tensor({2, 8, 8, 2}, 3);
  expect_located(value_error_of([&] { outer->forward(x); }), conv16_on_8_channels(),
                 "in layer 1.3 (Conv2d) of a Sequential: ");
  // One level more: the path grows at the front, the original text stays once.
  Sequential outermost({std::make_shared<ReLU>(), outer});
  expect_located(value_error_of([&] { outermost.forward(x); }), conv16_on_8_channels(),
                 "in layer 1.1.3 (Conv2d) of a Sequential: ");
}

TEST(SequentialTest, ABackwardErrorNamesTheChild) {
  Sequential seq(
      {std::make_shared<Linear>(4, 3), std::make_shared<ReLU>(), std::make_shared<Linear>(3, 2)});
  seq.forward(random_tensor({5, 4}, 4));
  const Tensor wrong = random_tensor({5, 3}, 5);  // the gradient of a [5, 2] output is [5, 2]
  const Thrown original = value_error_of([&] {
    Linear alone(3, 2);
    alone.forward(random_tensor({5, 3}, 6));
    alone.backward(wrong);
  });
  expect_located(value_error_of([&] { seq.backward(wrong); }), original,
                 "in layer 2 (Linear) of a Sequential: ");
}

// A child container's own error (not one of its children's) names that container, and a
// Sequential's own error is not prefixed at all.
TEST(SequentialTest, AContainersOwnErrorNamesTheContainer) {
  auto inner = std::make_shared<Sequential>(
      std::vector<std::shared_ptr<Module>>{std::make_shared<Linear>(4, 4)});
  Sequential outer({std::make_shared<ReLU>(), inner});
  const Tensor y = outer.forward(random_tensor({2, 4}, 7));
  const Tensor g = random_tensor(y.shape(), 8);
  inner->backward(g);  // uses the inner forward up: its next backward has none to follow
  const Thrown original = value_error_of([&] { inner->backward(g); });
  expect_located(value_error_of([&] { outer.backward(g); }), original,
                 "in layer 1 (Sequential) of a Sequential: ");
  // A second backward after a whole step is refused by the outer Sequential itself.
  outer.forward(random_tensor({2, 4}, 7));
  outer.backward(g);
  const Thrown own = value_error_of([&] { outer.backward(g); });
  ASSERT_TRUE(own.thrown);
  EXPECT_EQ(own.message.rfind("Sequential: backward() called without a forward()", 0), 0u)
      << own.message;
}

// Errors that are not the caller's input (a CUDA failure, an I/O error) pass unchanged, and so do
// those of a module that is not a registered child (forward_child has no name to give it).
class Throws : public Module {
 public:
  explicit Throws(std::function<void()> fail) : fail_(std::move(fail)) {}
  std::string type_name() const override { return "Throws"; }

 protected:
  Tensor forward_one(const Tensor& x) override {
    fail_();
    return x;
  }
  std::shared_ptr<Module> make_empty_copy() const override {
    return std::make_shared<Throws>(fail_);
  }

 private:
  std::function<void()> fail_;
};

TEST(SequentialTest, OnlyValueErrorsAreLocated) {
  Sequential cuda_failure({std::make_shared<ReLU>(), std::make_shared<Throws>([] {
                             throw CudaError(cudaErrorLaunchFailure, "kernel failed", "k.cu", 7);
                           })});
  try {
    cuda_failure.forward(random_tensor({2}, 8));
    ADD_FAILURE() << "expected a CudaError";
  } catch (const CudaError& e) {
    EXPECT_EQ(e.message(), "kernel failed");
    EXPECT_EQ(e.code(), cudaErrorLaunchFailure);
  }
  Sequential io_failure({std::make_shared<Throws>([] { throw IoError("no file", "f.cpp", 3); })});
  EXPECT_THROW_WITH(io_failure.forward(random_tensor({2}, 8)), "no file (at f.cpp:3)");
  Sequential value_failure(
      {std::make_shared<Throws>([] { throw ValueError("told to fail", "f.cpp", 5); })});
  EXPECT_VALUE_ERROR(value_failure.forward(random_tensor({2}, 8)),
                     "in layer 0 (Throws) of a Sequential: told to fail (at f.cpp:5)");
}

class CallsAStranger : public Module {
 public:
  std::string type_name() const override { return "CallsAStranger"; }

 protected:
  Tensor forward_one(const Tensor& x) override { return forward_child(stranger_, x); }
  std::shared_ptr<Module> make_empty_copy() const override {
    return std::make_shared<CallsAStranger>();
  }

 private:
  Throws stranger_{[] { throw ValueError("stranger failed", "f.cpp", 9); }};
};

TEST(SequentialTest, AModuleThatIsNoChildIsNotNamed) {
  CallsAStranger module;
  const Thrown thrown = value_error_of([&] { module.forward(random_tensor({2}, 9)); });
  ASSERT_TRUE(thrown.thrown);
  EXPECT_EQ(thrown.message, "stranger failed");
  EXPECT_EQ(thrown.line, 9);
}

// A message that only looks like a located one is not taken apart: here a child of the outer
// Sequential's type calls its own inner Sequential directly (not through forward_child), so the
// inner error's path says nothing of where the inner Sequential sits; the outer one names its
// child and keeps the inner text whole. And a subclass of ValueError passes unchanged.
class SequentialCallingDirectly : public Module {
 public:
  SequentialCallingDirectly() { register_module("inner", wrong_at_layer_3()); }
  std::string type_name() const override { return "Sequential"; }

 protected:
  Tensor forward_one(const Tensor& x) override { return children()[0].second->forward(x); }
  std::shared_ptr<Module> make_empty_copy() const override {
    return std::make_shared<SequentialCallingDirectly>();
  }
};

class SpecificError : public ValueError {
 public:
  using ValueError::ValueError;
};

TEST(SequentialTest, OnlyTheErrorAChildLocatedIsExtended) {
  Sequential outer({std::make_shared<SequentialCallingDirectly>()});
  expect_located(value_error_of([&] {
                   outer.forward(random_tensor({2, 8, 8, 3}, 2));
                 }),
                 conv16_on_8_channels(),
                 "in layer 0 (Sequential) of a Sequential: in layer 3 (Conv2d) of a Sequential: ");
  Sequential specific(
      {std::make_shared<Throws>([] { throw SpecificError("specific", "f.cpp", 11); })});
  try {
    specific.forward(random_tensor({2}, 8));
    ADD_FAILURE() << "expected a SpecificError";
  } catch (const SpecificError& e) {
    EXPECT_EQ(e.message(), "specific");
  }
}

// A correct model runs as before: the located calls change nothing but errors.
TEST(SequentialTest, ACorrectNestedModelIsUnaffected) {
  auto inner = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, 8, 3, 1, 1, true, 1), std::make_shared<ReLU>(),
      std::make_shared<MaxPool2d>(2)});
  Sequential seq({inner, std::make_shared<Flatten>(), std::make_shared<Linear>(8 * 4 * 4, 5)});
  testing::randomize_parameters(seq, 10);
  auto by_hand = std::static_pointer_cast<Sequential>(seq.clone(Device::cpu()));
  const Tensor x = random_tensor({2, 8, 8, 3}, 11);
  const Tensor y = seq.forward(x);
  Tensor expected = x;
  auto hand_inner = std::static_pointer_cast<Sequential>((*by_hand)[0]);
  for (size_t i = 0; i < hand_inner->size(); ++i) expected = (*hand_inner)[i]->forward(expected);
  for (size_t i = 1; i < by_hand->size(); ++i) expected = (*by_hand)[i]->forward(expected);
  EXPECT_EQ(values(y), values(expected));
  const Tensor g = random_tensor(y.shape(), 12);
  Tensor dg = g;
  for (size_t i = by_hand->size(); i-- > 1;) dg = (*by_hand)[i]->backward(dg);
  for (size_t i = hand_inner->size(); i-- > 0;) dg = (*hand_inner)[i]->backward(dg);
  EXPECT_EQ(values(seq.backward(g)), values(dg));
}

// VGG calls its Sequentials itself: the path starts with torchvision's names, in forward
// (features.0 gets the wrong channel count) and in backward (classifier.6 a wrong gradient).
TEST(SequentialTest, VggErrorsNameTorchvisionsPath) {
  auto net = vgg11({.num_classes = 10, .head = VggHead::Compact});
  const Tensor gray = random_tensor({1, 32, 32, 1}, 13);  // the model wants 3 channels
  const Thrown first_conv = value_error_of([&] { Conv2d(3, 64, 3, 1, 1).forward(gray); });
  expect_located(value_error_of([&] { net->forward(gray); }), first_conv,
                 "in layer features.0 (Conv2d) of a VGG: ");

  net->forward(random_tensor({1, 32, 32, 3}, 14));
  const Tensor wrong = random_tensor({1, 7}, 15);
  const Thrown last_linear = value_error_of([&] {
    Linear alone(512, 10);
    alone.forward(random_tensor({1, 512}, 16));
    alone.backward(wrong);
  });
  expect_located(value_error_of([&] { net->backward(wrong); }), last_linear,
                 "in layer classifier.6 (Linear) of a VGG: ");

  // A VGG inside a Sequential: the outer index goes in front of torchvision's path.
  Sequential wrapped({net});
  expect_located(value_error_of([&] { wrapped.forward(gray); }), first_conv,
                 "in layer 0.features.0 (Conv2d) of a Sequential: ");
}

}  // namespace
}  // namespace cudp
