// Module's shared machinery on the CPU: names, checks and their messages, gradient accumulation,
// state_dict round trips and strict loading, clone, flatten_parameters, modes and devices.
#include <gtest/gtest.h>

#include <cstdint>

#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dropout.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

// conv (with BN) -> relu -> pool -> flatten -> linear, on [N, 6, 6, 3] inputs.
std::shared_ptr<Sequential> small_net(uint64_t seed) {
  auto net = std::make_shared<Sequential>();
  net->add(std::make_shared<Conv2d>(3, 4, 3, 1, 1, true, seed));
  net->add(std::make_shared<BatchNorm2d>(4));
  net->add(std::make_shared<ReLU>());
  net->add(std::make_shared<MaxPool2d>(2));
  net->add(std::make_shared<Flatten>());
  net->add(std::make_shared<Linear>(4 * 3 * 3, 5, true, seed + 1));
  return net;
}

// A module that claims to live on a GPU without allocating anything, to test the device check's
// message on a machine without one.
class PretendOnDevice : public Module {
 public:
  explicit PretendOnDevice(Device device) { device_ = device; }
  std::string type_name() const override { return "Linear"; }

 protected:
  Tensor forward_one(const Tensor& x) override { return x; }
  std::shared_ptr<Module> make_empty_copy() const override {
    return std::make_shared<PretendOnDevice>(device_);
  }
};

TEST(ModuleTest, NamesFollowPyTorch) {
  auto net = small_net(1);
  std::vector<std::string> names;
  for (auto& [name, p] : net->named_parameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "5.weight",
                                             "5.bias"}));
  std::vector<std::string> buffers;
  for (auto& [name, b] : net->named_buffers()) buffers.push_back(name);
  EXPECT_EQ(buffers,
            (std::vector<std::string>{"1.running_mean", "1.running_var", "1.num_batches_tracked"}));
  std::vector<std::string> modules;
  for (auto& [path, m] : net->named_modules()) modules.push_back(path + ":" + m->type_name());
  EXPECT_EQ(modules, (std::vector<std::string>{":Sequential", "0:Conv2d", "1:BatchNorm2d", "2:ReLU",
                                               "3:MaxPool2d", "4:Flatten", "5:Linear"}));
  EXPECT_EQ(net->num_parameters(), 4 * 3 * 3 * 3 + 4 + 4 + 4 + 36 * 5 + 5);
  EXPECT_EQ(net->parameters().size(), 6u);
}

TEST(ModuleTest, StateDictHasPyTorchLayoutsAndDtypes) {
  auto net = small_net(1);
  const auto state = net->state_dict();
  EXPECT_EQ(state.size(), 9u);
  EXPECT_EQ(state.at("0.weight").shape(), (Shape{4, 3, 3, 3}));  // OIHW
  EXPECT_EQ(state.at("5.weight").shape(), (Shape{5, 36}));
  const Tensor& count = state.at("1.num_batches_tracked");
  EXPECT_EQ(count.shape(), Shape{});
  EXPECT_EQ(count.dtype(), DType::i64);
  EXPECT_EQ(count.to_vector<int64_t>(), std::vector<int64_t>{0});
  for (const auto& [name, t] : state) EXPECT_TRUE(t.is_cpu()) << name;
}

TEST(ModuleTest, ForwardRejectsAnUndefinedInput) {
  Linear linear(3, 2);
  EXPECT_THROW_WITH(linear.forward(Tensor()), "Linear: input is undefined");
}

TEST(ModuleTest, BackwardNeedsAForwardFirst) {
  Linear linear(3, 2);
  EXPECT_THROW_WITH(linear.backward(random_tensor({4, 2}, 1)),
                    "Linear: backward() called without a forward()");
}

// As in PyTorch (without retain_graph), a backward frees what its forward saved: through a whole
// network, a second backward on the same forward is refused with the way out, and after a new
// forward it gives the first one's gradients again.
TEST(ModuleTest, BackwardFreesWhatTheForwardSaved) {
  auto net = small_net(1);
  const Tensor x = random_tensor({2, 6, 6, 3}, 4);
  const Tensor y = net->forward(x);
  const Tensor g = random_tensor(y.shape(), 5);
  const std::vector<float> dx1 = values(net->backward(g));
  EXPECT_THROW_WITH(net->backward(g),
                    "backward() called without a forward() since the last "
                    "backward");
  net->forward(x);
  EXPECT_EQ(values(net->backward(g)), dx1);
}

TEST(ModuleTest, DeviceMismatchNamesBothDevicesAndTheFix) {
  PretendOnDevice m(Device::cuda(0));
  EXPECT_THROW_WITH(m.forward(random_tensor({2, 2}, 1)),
                    "Linear: input is on cpu but the module's parameters are on cuda:0; move the "
                    "input with .to(cuda:0) or the module with .to(cpu)");
}

TEST(ModuleTest, ParameterGradientsAccumulateAndInputGradientsAreWritten) {
  Linear linear(5, 3, true, 7);
  const Tensor x = random_tensor({4, 5}, 2);
  const Tensor g = random_tensor({4, 3}, 3);
  linear.forward(x);
  const std::vector<float> dx1 = values(linear.backward(g));
  const std::vector<float> dw1 = values(linear.weight().grad);
  const std::vector<float> db1 = values(linear.bias().grad);
  linear.forward(x);
  const std::vector<float> dx2 = values(linear.backward(g));  // same batch, second backward
  EXPECT_EQ(dx2, dx1);                                        // written, not accumulated
  std::vector<float> twice_w(dw1), twice_b(db1);
  for (float& v : twice_w) v *= 2;
  for (float& v : twice_b) v *= 2;
  EXPECT_ALL_CLOSE(values(linear.weight().grad), twice_w, 1e-6, 1e-7);
  EXPECT_ALL_CLOSE(values(linear.bias().grad), twice_b, 1e-6, 1e-7);
  linear.zero_grad();
  for (Parameter* p : linear.parameters()) {
    for (float v : values(p->grad)) ASSERT_EQ(v, 0.0f);
  }
}

TEST(ModuleTest, StateDictRoundTripAndSnapshot) {
  auto a = small_net(1);
  testing::randomize_parameters(*a, 10);
  a->forward(random_tensor({2, 6, 6, 3}, 4));  // moves BN's running statistics and count
  const auto state = a->state_dict();
  auto b = small_net(2);
  b->load_state_dict(state);
  const auto again = b->state_dict();
  ASSERT_EQ(again.size(), state.size());
  for (const auto& [name, t] : state) {
    if (t.dtype() == DType::i64) {
      EXPECT_EQ(again.at(name).to_vector<int64_t>(), t.to_vector<int64_t>()) << name;
    } else {
      EXPECT_EQ(values(again.at(name)), values(t)) << name;
    }
  }
  EXPECT_EQ(std::static_pointer_cast<BatchNorm2d>((*b)[1])->num_batches_tracked(), 1);
  // The state is a snapshot: changing the model afterwards does not change it.
  const std::vector<float> before = values(state.at("5.bias"));
  a->named_parameters()[5].second->data.fill_(42.0f);
  EXPECT_EQ(values(state.at("5.bias")), before);
  // And the same inputs give the same outputs.
  const Tensor x = random_tensor({2, 6, 6, 3}, 5);
  a->load_state_dict(state);
  a->eval();
  b->eval();
  EXPECT_EQ(values(a->forward(x)), values(b->forward(x)));
}

TEST(ModuleTest, StrictLoadNamesEveryProblem) {
  auto net = small_net(1);
  auto state = net->state_dict();
  const auto untouched = values(net->named_parameters()[0].second->data);

  auto missing = state;
  missing.erase("5.bias");
  EXPECT_THROW_WITH(net->load_state_dict(missing), "missing key '5.bias'");

  auto extra = state;
  extra.emplace("6.weight", Tensor::zeros({1}));
  EXPECT_THROW_WITH(net->load_state_dict(extra), "unexpected key '6.weight'");

  auto wrong_shape = state;
  wrong_shape["0.weight"] = Tensor::zeros({4, 3, 5, 5});
  EXPECT_THROW_WITH(net->load_state_dict(wrong_shape),
                    "size mismatch for '0.weight': found shape [4, 3, 5, 5], the module expects "
                    "[4, 3, 3, 3]");

  auto wrong_dtype = state;
  wrong_dtype["1.num_batches_tracked"] = Tensor::zeros({}, DType::i32);
  EXPECT_THROW_WITH(
      net->load_state_dict(wrong_dtype),
      "dtype mismatch for '1.num_batches_tracked': found i32, the module expects i64");

  // All problems in one message; nothing was loaded by the failed attempts.
  auto several = missing;
  several["0.weight"] = Tensor::zeros({4, 3, 5, 5});
  several["0.bias"] = Tensor::full({4}, 3.0f);
  try {
    net->load_state_dict(several);
    ADD_FAILURE() << "expected a ValueError";
  } catch (const ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("Error(s) in loading state_dict for Sequential"), std::string::npos)
        << what;
    EXPECT_NE(what.find("missing key '5.bias'"), std::string::npos) << what;
    EXPECT_NE(what.find("size mismatch for '0.weight'"), std::string::npos) << what;
  }
  EXPECT_EQ(values(net->named_parameters()[0].second->data), untouched);
  EXPECT_NE(values(net->named_parameters()[1].second->data), std::vector<float>(4, 3.0f));
}

TEST(ModuleTest, NonStrictLoadSkipsMissingAndUnexpectedButNotShapes) {
  auto net = small_net(1);
  auto state = net->state_dict();
  state.erase("5.bias");
  state.emplace("extra", Tensor::zeros({1}));
  state["5.weight"] = Tensor::full({5, 36}, 0.5f);
  net->load_state_dict(state, /*strict=*/false);
  EXPECT_EQ(values(net->named_parameters()[4].second->data), std::vector<float>(180, 0.5f));
  state["0.bias"] = Tensor::zeros({7});
  EXPECT_THROW_WITH(net->load_state_dict(state, false), "size mismatch for '0.bias'");
}

TEST(ModuleTest, CloneIsADeepEqualCopy) {
  auto net = small_net(3);
  testing::randomize_parameters(*net, 20);
  auto dropout = std::make_shared<Dropout>(0.3f, 99);
  net->add(dropout);
  const Tensor x = random_tensor({2, 6, 6, 3}, 6);
  net->forward(x);  // advances BN's count and the dropout offset
  net->eval();
  auto copy = std::static_pointer_cast<Sequential>(net->clone(Device::cpu()));
  EXPECT_FALSE(copy->is_training());
  EXPECT_FALSE((*copy)[1]->is_training());
  EXPECT_EQ(copy->type_name(), "Sequential");
  const auto pa = net->named_parameters(), pb = copy->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].first, pb[i].first);
    EXPECT_EQ(values(pa[i].second->data), values(pb[i].second->data));
    EXPECT_FALSE(pa[i].second->data.shares_storage(pb[i].second->data));
    for (float v : values(pb[i].second->grad)) ASSERT_EQ(v, 0.0f);
  }
  auto copied_dropout = std::static_pointer_cast<Dropout>((*copy)[6]);
  EXPECT_EQ(copied_dropout->seed(), 99u);
  EXPECT_EQ(copied_dropout->offset(), dropout->offset());
  EXPECT_EQ(std::static_pointer_cast<BatchNorm2d>((*copy)[1])->num_batches_tracked(), 1);
  EXPECT_EQ(values(copy->forward(x)), values(net->forward(x)));
}

TEST(ModuleTest, FlattenParametersKeepsValuesAndAliasesTheFlatBuffers) {
  auto net = small_net(4);
  testing::randomize_parameters(*net, 30);
  std::vector<std::vector<float>> before;
  for (Parameter* p : net->parameters()) before.push_back(values(p->data));
  const Tensor x = random_tensor({2, 6, 6, 3}, 7);
  const Tensor g = random_tensor({2, 5}, 8);
  net->forward(x);
  net->backward(g);
  std::vector<std::vector<float>> grads;
  for (Parameter* p : net->parameters()) grads.push_back(values(p->grad));

  auto [flat, flat_grad] = net->flatten_parameters();
  EXPECT_EQ(flat.dim(), 1);
  EXPECT_EQ(flat.numel(), flat_grad.numel());
  EXPECT_GE(flat.numel(), net->num_parameters());
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i]->data.shares_storage(flat));
    EXPECT_TRUE(params[i]->grad.shares_storage(flat_grad));
    EXPECT_EQ(values(params[i]->data), before[i]);
    EXPECT_EQ(values(params[i]->grad), grads[i]);
    // Every parameter starts on a 256-byte boundary.
    const auto offset = static_cast<const char*>(params[i]->data.data_ptr()) -
                        static_cast<const char*>(flat.data_ptr());
    EXPECT_EQ(offset % 256, 0);
  }
  // Writes through the flat buffers are the parameters' values, and backward accumulates into them.
  flat_grad.zero_();
  net->forward(x);
  net->backward(g);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_ALL_CLOSE(values(params[i]->grad), grads[i], 1e-6, 1e-6);
  }
  flat.fill_(0.25f);
  EXPECT_EQ(values(params[0]->data), std::vector<float>(params[0]->data.numel(), 0.25f));
}

TEST(ModuleTest, TrainAndEvalReachEveryChild) {
  auto net = small_net(1);
  net->eval();
  for (auto& [path, m] : net->named_modules()) EXPECT_FALSE(m->is_training()) << path;
  net->train();
  for (auto& [path, m] : net->named_modules()) EXPECT_TRUE(m->is_training()) << path;
}

TEST(ModuleTest, MovingToTheSameDeviceKeepsTensors) {
  Linear linear(3, 2);
  const Tensor w = linear.weight().data;
  linear.to(Device::cpu());
  EXPECT_TRUE(linear.weight().data.shares_storage(w));
  EXPECT_EQ(linear.device(), Device::cpu());
}

TEST(ModuleTest, SequentialRejectsAModuleOnAnotherDevice) {
  Sequential seq;
  EXPECT_THROW_WITH(seq.add(std::make_shared<PretendOnDevice>(Device::cuda(1))),
                    "Sequential::add: module 0 (Linear) is on cuda:1 but the Sequential is on cpu");
}

}  // namespace
}  // namespace cudp
