// GPU tests of the parameter store (layers/module.h, NOTE [The parameter store]). Training a bf16
// model whose Conv2d and Linear read the store's copies (flattened, the copies written by SGD in
// the launch that updates the master weights) must give, bit for bit, what the same model gives
// when each layer converts its fp32 weights at every forward (not flattened): the losses of every
// step, every parameter and the optimizer's state; and so must the same training replayed from a
// CUDA graph. The copies equal the master weights rounded to nearest even at the end, and the
// layers are shown to read them: a copy overwritten changes the output until
// refresh_compute_copies() restores it.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/gpu.h"
#include "common/tensor_bytes.h"
#include "engine/core/error.h"
#include "engine/parallel/data_parallel.h"
#include "kernels/layout.h"
#include "layers/activation.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/train.h"

namespace cudp {
namespace {

using testing::bf16_bits;
using testing::bytes_of;
using testing::random_vector;

const Device kGpu = Device::cuda(0);

// Convolutions whose filters the tensor-core products read as stored (channels a multiple of 8,
// 64 filters: no padded or rotated copy), and a Linear with a bf16-readable weight: every product
// reads the store.
std::shared_ptr<Module> model() {
  auto net = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(8, 64, 3, 1, 1, true, 41), std::make_shared<ReLU>(true),
      std::make_shared<Conv2d>(64, 64, 3, 1, 1, true, 42), std::make_shared<ReLU>(true),
      std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(64 * 4 * 4, 16, true, 43)});
  net->set_precision(Precision::bf16);
  return net->clone(kGpu);
}

std::pair<Tensor, Tensor> batch(int n, uint64_t seed) {
  std::vector<int32_t> labels(n);
  std::mt19937 gen(static_cast<uint32_t>(seed));
  for (auto& l : labels) l = static_cast<int32_t>(gen() % 16);
  return {Tensor::from_vector(random_vector(static_cast<size_t>(n) * 8 * 8 * 8, seed), {n, 8, 8, 8})
              .to(kGpu),
          Tensor::from_vector(labels, {n}).to(kGpu)};
}

// The CPU reference's rounding of the master weights.
std::vector<uint16_t> rounded(const Tensor& f32) {
  const std::vector<float> v = f32.to_vector<float>();
  std::vector<uint16_t> bits;
  for (const float x : v) bits.push_back(kernels::detail::f32_to_bf16_bits(x));
  return bits;
}

Parameter* parameter(Module& net, const std::string& name) {
  for (const auto& [n, p] : net.named_parameters()) {
    if (n == name) return p;
  }
  throw std::runtime_error("no parameter " + name);
}

struct Trained {
  std::vector<std::vector<float>> losses;
  std::map<std::string, std::vector<unsigned char>> model, optimizer;
};

constexpr int kSteps = 6;

template <typename StepFn>
Trained train(Module& net, SGD& opt, StepFn&& step) {
  std::vector<Tensor> losses;
  for (int t = 0; t < kSteps; ++t) {
    opt.set_lr(0.05 * (1.0 + 0.25 * (t % 3)));
    const auto [x, y] = batch(16, 500 + t);
    losses.push_back(step(x, y).loss);
  }
  Trained r;
  for (const Tensor& l : losses) r.losses.push_back(l.to_vector<float>());
  r.model = bytes_of(net.state_dict());
  r.optimizer = bytes_of(opt.state_dict());
  return r;
}

void expect_copies_current(Module& net) {
  int checked = 0;
  for (const auto& [name, p] : net.named_parameters()) {
    ASSERT_TRUE(p->compute.defined()) << name;
    EXPECT_EQ(bf16_bits(p->compute), rounded(p->data)) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 6);
}

TEST(ParameterStoreGpu, TrainingOnTheStoreEqualsConvertingAtEveryForwardBitForBit) {
  CUDP_REQUIRE_GPU();
  const SGDOptions options{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4};
  auto plain = model();  // not flattened: every forward converts its weights
  auto stored = plain->clone(kGpu);
  auto graphed = plain->clone(kGpu);
  stored->flatten_parameters();
  graphed->flatten_parameters();
  for (Parameter* p : plain->parameters()) ASSERT_FALSE(p->compute.defined());
  expect_copies_current(*stored);

  SGD plain_opt(plain->parameters(), options), stored_opt(stored->parameters(), options),
      graphed_opt(graphed->parameters(), options);
  CrossEntropyLoss plain_loss, stored_loss, graphed_loss;
  const Trained a = train(*plain, plain_opt, [&](const Tensor& x, const Tensor& y) {
    return train_step_async(*plain, plain_loss, plain_opt, x, y);
  });
  const Trained b = train(*stored, stored_opt, [&](const Tensor& x, const Tensor& y) {
    return train_step_async(*stored, stored_loss, stored_opt, x, y);
  });
  GraphedStep step(*graphed, graphed_loss, graphed_opt);
  const Trained c = train(*graphed, graphed_opt,
                          [&](const Tensor& x, const Tensor& y) { return step.step(x, y); });
  EXPECT_TRUE(stored_opt.last_step_was_flat());
  EXPECT_GT(step.replays(), 0);

  EXPECT_EQ(b.losses, a.losses);
  EXPECT_EQ(c.losses, a.losses);
  EXPECT_NE(a.losses[0], a.losses[kSteps - 1]);  // it trained
  for (const auto& [name, bytes] : a.model) {
    EXPECT_EQ(b.model.at(name), bytes) << name;
    EXPECT_EQ(c.model.at(name), bytes) << name;
  }
  EXPECT_EQ(b.optimizer, a.optimizer);
  EXPECT_EQ(c.optimizer, a.optimizer);
  expect_copies_current(*stored);
  expect_copies_current(*graphed);
}

TEST(ParameterStoreGpu, TheLayersReadTheCopies) {
  CUDP_REQUIRE_GPU();
  auto plain = model();
  auto stored = plain->clone(kGpu);
  stored->flatten_parameters();
  plain->eval();
  stored->eval();
  const auto [x, y] = batch(4, 7);
  const std::vector<float> expected = plain->forward(x).to_vector<float>();
  EXPECT_EQ(stored->forward(x).to_vector<float>(), expected);
  // The second convolution's copy zeroed behind the store's back: the output changes...
  Parameter* w = parameter(*stored, "2.weight");
  ASSERT_EQ(w->data.shape(), (Shape{64, 3, 3, 64}));
  CUDP_CUDA_CHECK(cudaMemset(w->compute.data_ptr(), 0, w->compute.nbytes()));
  EXPECT_NE(stored->forward(x).to_vector<float>(), expected);
  // ... until the copies are refreshed from the master weights.
  stored->refresh_compute_copies();
  EXPECT_EQ(stored->forward(x).to_vector<float>(), expected);
  // The same for the Linear's weight.
  Parameter* fc = parameter(*stored, "6.weight");
  CUDP_CUDA_CHECK(cudaMemset(fc->compute.data_ptr(), 0, fc->compute.nbytes()));
  EXPECT_NE(stored->forward(x).to_vector<float>(), expected);
  stored->refresh_compute_copies();
  EXPECT_EQ(stored->forward(x).to_vector<float>(), expected);
}

// A wrapper on another device than the model it holds (DataParallel with its output on the CPU):
// the copies are refreshed through the modules that own them, on the model's device.
TEST(ParameterStoreGpu, AWrapperOnAnotherDeviceRefreshesItsModelsCopies) {
  CUDP_REQUIRE_GPU();
  auto net = model();
  DataParallel dp(net, {0}, /*output_device=*/-1);
  ASSERT_TRUE(dp.device().is_cpu());
  expect_copies_current(*net);  // the replica set flattened the model on GPU 0
  Parameter* w = parameter(*net, "2.weight");
  CUDP_CUDA_CHECK(cudaMemset(w->compute.data_ptr(), 0, w->compute.nbytes()));
  dp.refresh_compute_copies();
  expect_copies_current(*net);
  CUDP_CUDA_CHECK(cudaMemset(w->compute.data_ptr(), 0, w->compute.nbytes()));
  dp.load_state_dict(dp.state_dict());
  expect_copies_current(*net);
}

TEST(ParameterStoreGpu, MovingToAnotherDeviceDropsTheCopies) {
  CUDP_REQUIRE_GPU();
  auto net = model();
  net->flatten_parameters();
  expect_copies_current(*net);
  net->to(Device::cpu());
  for (Parameter* p : net->parameters()) EXPECT_FALSE(p->compute.defined());
}

}  // namespace
}  // namespace cudp
