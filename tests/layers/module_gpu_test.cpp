// Module machinery on CUDA: clone and to() between devices, flatten_parameters keeping values on
// the GPU, state_dict from GPU modules (as CPU tensors in PyTorch's layout), load into a GPU
// module, and the device-mismatch error with real tensors.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::random_tensor;
using testing::values;

std::shared_ptr<Sequential> small_net() {
  auto net = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, 4, 3, 1, 1, true, 1), std::make_shared<BatchNorm2d>(4),
      std::make_shared<ReLU>(), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(36, 5, true, 2)});
  testing::randomize_parameters(*net, 3);
  return net;
}

TEST(ModuleGpuTest, CloneToCudaCopiesEverything) {
  CUDP_REQUIRE_GPU();
  auto net = small_net();
  net->forward(random_tensor({2, 6, 6, 3}, 1));
  auto gpu = net->clone(Device::cuda(0));
  EXPECT_EQ(gpu->device(), Device::cuda(0));
  for (auto& [path, m] : gpu->named_modules()) EXPECT_EQ(m->device(), Device::cuda(0)) << path;
  const auto a = net->named_parameters(), b = gpu->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(b[i].second->data.is_cuda());
    EXPECT_TRUE(b[i].second->grad.is_cuda());
    EXPECT_EQ(values(b[i].second->data), values(a[i].second->data)) << a[i].first;
  }
  const auto sa = net->state_dict(), sb = gpu->state_dict();
  for (const auto& [name, t] : sa) {
    EXPECT_TRUE(sb.at(name).is_cpu());
    if (t.dtype() == DType::f32) {
      EXPECT_EQ(values(sb.at(name)), values(t)) << name;
    }
  }
  EXPECT_EQ(sb.at("1.num_batches_tracked").to_vector<int64_t>(), std::vector<int64_t>{1});
  // And back.
  auto back = gpu->clone(Device::cpu());
  EXPECT_EQ(values(back->named_parameters()[0].second->data), values(a[0].second->data));
}

TEST(ModuleGpuTest, ToMovesAndRoundTrips) {
  CUDP_REQUIRE_GPU();
  auto net = small_net();
  const auto before = net->state_dict();
  net->cuda(0);
  EXPECT_TRUE(net->named_parameters()[0].second->data.is_cuda());
  EXPECT_TRUE(net->named_buffers()[2].second->is_cuda());
  net->cpu();
  const auto after = net->state_dict();
  for (const auto& [name, t] : before) {
    if (t.dtype() == DType::f32) {
      EXPECT_EQ(values(after.at(name)), values(t)) << name;
    }
  }
}

TEST(ModuleGpuTest, LoadStateDictIntoAGpuModule) {
  CUDP_REQUIRE_GPU();
  auto source = small_net();
  auto target = small_net();
  testing::randomize_parameters(*target, 50);
  target->cuda(0);
  target->load_state_dict(source->state_dict());
  const Tensor x = random_tensor({2, 6, 6, 3}, 2);
  source->eval();
  target->eval();
  EXPECT_ALL_CLOSE(values(target->forward(x.cuda(0))), values(source->forward(x)), 1e-5, 1e-5);
}

TEST(ModuleGpuTest, FlattenParametersKeepsValuesOnTheGpu) {
  CUDP_REQUIRE_GPU();
  auto net = small_net();
  net->cuda(0);
  const Tensor x = random_tensor({2, 6, 6, 3}, 3).cuda(0);
  const Tensor g = random_tensor({2, 5}, 4).cuda(0);
  const Tensor y = net->forward(x);
  net->backward(g);
  std::vector<std::vector<float>> data, grads;
  for (Parameter* p : net->parameters()) {
    data.push_back(values(p->data));
    grads.push_back(values(p->grad));
  }
  auto [flat, flat_grad] = net->flatten_parameters();
  EXPECT_TRUE(flat.is_cuda());
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i]->data.shares_storage(flat));
    EXPECT_EQ(values(params[i]->data), data[i]);
    EXPECT_EQ(values(params[i]->grad), grads[i]);
  }
  // The model computes the same through the views, and its gradients land in flat_grad.
  flat_grad.zero_();
  EXPECT_EQ(values(net->forward(x)), values(y));
  net->backward(g);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(values(params[i]->grad), grads[i]);
}

TEST(ModuleGpuTest, DeviceMismatchIsAClearError) {
  CUDP_REQUIRE_GPU();
  Linear linear(3, 2);
  EXPECT_THROW_WITH(linear.forward(random_tensor({2, 3}, 1).cuda(0)),
                    "Linear: input is on cuda:0 but the module's parameters are on cpu; move the "
                    "input with .to(cpu) or the module with .to(cuda:0)");
  linear.cuda(0);
  EXPECT_THROW_WITH(linear.forward(random_tensor({2, 3}, 1)),
                    "Linear: input is on cpu but the module's parameters are on cuda:0; move the "
                    "input with .to(cuda:0) or the module with .to(cpu)");
  linear.forward(random_tensor({2, 3}, 1).cuda(0));
  EXPECT_THROW_WITH(linear.backward(random_tensor({2, 2}, 2)),
                    "Linear: grad_output is on cpu but the module's parameters are on cuda:0");
}

TEST(ModuleGpuTest, SecondGpuWhenPresent) {
  CUDP_REQUIRE_GPUS(2);
  auto net = small_net();
  auto on1 = net->clone(Device::cuda(1));
  const Tensor x = random_tensor({2, 6, 6, 3}, 5);
  EXPECT_THROW_WITH(
      on1->forward(x.cuda(0)),
      "Sequential: input is on cuda:0 but the module's parameters are on cuda:1; move "
      "the input with .to(cuda:1) or the module with .to(cuda:0)");
  net->eval();
  on1->eval();
  EXPECT_ALL_CLOSE(values(on1->forward(x.cuda(1))), values(net->forward(x)), 1e-5, 1e-5);
}

}  // namespace
}  // namespace cudp
