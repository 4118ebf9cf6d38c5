// Deferred zeroing (layers/module.h, NOTE [Deferred zeroing]) against zeroing first, on any device
// and precision: two copies of one small network, one trained with zero_grad() (every gradient
// zeroed, then added to), the other with zero_grad(ZeroGrad::deferred) after its gradients were
// filled with NaN. The truth is the first copy: the second must give the same gradient values
// after every backward (== element by element, so that -0 and +0 agree and a NaN fails) and the
// same parameters after every step. A backward that read a deferred gradient, or a gradient that
// neither zero_grad nor its backward wrote, would carry the NaN into the comparison.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/compare.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/train.h"

namespace cudp::testing {

constexpr float kStaleNaN = std::numeric_limits<float>::quiet_NaN();

// Two sizes of one shape of network: Conv2d(3, c1) on 3 input channels (the padded first layer
// under bf16, the narrow kernels under TF32), ReLU, 2x2 max pooling, Conv2d(c1, c2), BatchNorm2d,
// ReLU, pooling, then Linear(c2 * (image/4)^2, hidden), ReLU, Linear(hidden, 10) (10 outputs: the
// float launcher under bf16). Conv2d and Linear defer; the convolutions' biases and BatchNorm do
// not. Small (8x8 images, 16 channels, batch 8) for the CPU references; wide (16x16 images, 64 and
// 128 channels, batch 32) on the GPU, where the layers take the kernels VGG's do: TF32's narrow
// first layer (64 filters on 3 channels) and boxes (64 input channels), filters of more than 64
// rows, and backward-weight products long in k (batch x pixels) against their m and n, which the
// planner splits.
struct DeferredZeroingNet {
  int image = 8, c1 = 16, c2 = 16, hidden = 32;
  int64_t batch = 8;
};
inline constexpr DeferredZeroingNet kSmallNet{};
inline constexpr DeferredZeroingNet kWideNet{16, 64, 128, 64, 32};

inline std::shared_ptr<Sequential> deferred_zeroing_net(const DeferredZeroingNet& n = kSmallNet) {
  const int features = n.c2 * (n.image / 4) * (n.image / 4);
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, n.c1, 3, 1, 1, true, 21), std::make_shared<ReLU>(true),
      std::make_shared<MaxPool2d>(2), std::make_shared<Conv2d>(n.c1, n.c2, 3, 1, 1, true, 22),
      std::make_shared<BatchNorm2d>(n.c2), std::make_shared<ReLU>(true),
      std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(features, n.hidden, true, 23), std::make_shared<ReLU>(true),
      std::make_shared<Linear>(n.hidden, 10, true, 24)});
}

// The parameters whose backward writes them whole: the names deferred_zeroing_net gives them.
inline const std::set<std::string>& deferred_parameter_names() {
  static const std::set<std::string> names = {"0.weight", "3.weight",  "8.weight",
                                              "8.bias",   "10.weight", "10.bias"};
  return names;
}

inline Tensor deferred_zeroing_images(int64_t n, uint64_t seed, Device device, int image = 8) {
  return Tensor::from_vector(
             random_vector(static_cast<size_t>(n) * image * image * 3, seed, -1.f, 1.f),
             {n, image, image, 3})
      .to(device);
}

inline Tensor deferred_zeroing_labels(int64_t n, uint64_t seed, Device device) {
  std::vector<int32_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) labels[static_cast<size_t>(i)] = int32_t((i * 7 + seed) % 10);
  return Tensor::from_vector(labels, {n}).to(device);
}

// Element by element with ==: -0 equals +0, NaN equals nothing.
inline void expect_same_values(const Tensor& actual, const Tensor& expected,
                               const std::string& what) {
  const std::vector<float> a = actual.to_vector<float>(), e = expected.to_vector<float>();
  ASSERT_EQ(a.size(), e.size()) << what;
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == e[i])) {
      if (wrong++ == 0) first = i;
    }
  }
  EXPECT_EQ(wrong, 0u) << what << ": " << wrong << " of " << a.size() << " elements differ, first ["
                       << first << "] " << a[first] << " vs " << e[first];
}

inline void fill_gradients(Module& m, float value) {
  for (Parameter* p : m.parameters()) p->grad.fill_(value);
}

// What a gradient that counts as zero may hold: NaN in every one still pending, as after a step
// that diverged, so that a read of it or a gradient left unwritten shows.
inline void poison_pending_gradients(Module& m) {
  for (Parameter* p : m.parameters()) {
    if (p->grad_zero_pending) p->grad.fill_(kStaleNaN);
  }
}

// The parameterised suites' cases, (precision, flat), and their names ("bf16Flat").
inline const auto kDeferredZeroingCases = ::testing::Combine(
    ::testing::Values(Precision::fp32, Precision::tf32, Precision::bf16), ::testing::Bool());
inline std::string deferred_zeroing_case_name(
    const ::testing::TestParamInfo<std::tuple<Precision, bool>>& info) {
  return std::string(precision_name(std::get<0>(info.param))) +
         (std::get<1>(info.param) ? "Flat" : "PerParameter");
}

struct DeferredZeroingCase {
  Device device = Device::cpu();
  Precision precision = Precision::fp32;
  bool flat = false;          // flatten_parameters() first: one launch over the flat buffer
  int64_t micro_batches = 1;  // > 1: forward_backward_micro_batches (accumulation)
  DeferredZeroingNet net = kSmallNet;
};

// Three steps of SGD with momentum and weight decay on each copy; see the header.
inline void expect_deferred_zeroing_equals_zeroing_first(const DeferredZeroingCase& c) {
  const int64_t batch = c.net.batch;
  auto filled = deferred_zeroing_net(c.net), deferred = deferred_zeroing_net(c.net);
  for (auto* m : {filled.get(), deferred.get()}) {
    m->to(c.device);
    m->set_precision(c.precision);
    if (c.flat) m->flatten_parameters();
  }
  const SGDOptions options{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3};
  SGD filled_opt(filled->parameters(), options), deferred_opt(deferred->parameters(), options);
  fill_gradients(*deferred, kStaleNaN);
  CrossEntropyLoss filled_loss, deferred_loss;
  const auto backward = [&](Module& m, CrossEntropyLoss& criterion, const Tensor& x,
                            const Tensor& y) {
    if (c.micro_batches > 1) {
      forward_backward_micro_batches(m, criterion, x, y, c.micro_batches);
    } else {
      criterion.forward(m.forward(x), y);
      m.backward(criterion.backward());
    }
  };
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Tensor x = deferred_zeroing_images(batch, 40 + step, c.device, c.net.image);
    const Tensor y = deferred_zeroing_labels(batch, step, c.device);
    filled_opt.zero_grad();
    backward(*filled, filled_loss, x, y);

    deferred_opt.zero_grad(ZeroGrad::deferred);
    for (auto& [name, p] : deferred->named_parameters()) {
      const bool expected = deferred_parameter_names().count(name) != 0;
      EXPECT_EQ(p->backward_writes_grad, expected) << name;
      EXPECT_EQ(p->grad_zero_pending, expected) << name;
      const std::vector<float> g = p->grad.to_vector<float>();
      if (expected && step == 0) {
        // Not written by zero_grad: still the stale NaN.
        EXPECT_TRUE(std::isnan(g.front()) && std::isnan(g.back())) << name;
      } else if (!expected) {
        EXPECT_EQ(g, std::vector<float>(g.size(), 0.f)) << name << " was not zeroed";
      }
    }
    poison_pending_gradients(*deferred);  // at every step, not only the first
    backward(*deferred, deferred_loss, x, y);
    const auto want = filled->named_parameters();
    const auto got = deferred->named_parameters();
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_FALSE(got[i].second->grad_zero_pending) << got[i].first << " is still pending";
      expect_same_values(got[i].second->grad, want[i].second->grad,
                         "the gradient of " + got[i].first);
    }
    filled_opt.step();
    deferred_opt.step();
    for (size_t i = 0; i < want.size(); ++i) {
      expect_same_values(got[i].second->data, want[i].second->data, got[i].first);
    }
  }
}

// A parameter the optimizer holds but no backward writes (an unused branch): after a deferred
// zero_grad over stale NaN, step() and grad_norm see it as zero, as zeroing first would.
inline void expect_unused_parameter_counts_as_zero(Device device, bool flat) {
  auto used = deferred_zeroing_net();
  auto unused = std::make_shared<Linear>(4, 3, true, 31);
  auto both = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{used, unused});
  both->to(device);
  if (flat) both->flatten_parameters();
  const std::vector<float> weight_before = unused->parameters()[0]->data.to_vector<float>();
  SGD opt(both->parameters(), {.lr = 0.1, .momentum = 0.9});
  opt.zero_grad(ZeroGrad::deferred);
  poison_pending_gradients(*both);
  CrossEntropyLoss criterion;
  criterion.forward(used->forward(deferred_zeroing_images(4, 50, device)),
                    deferred_zeroing_labels(4, 1, device));
  used->backward(criterion.backward());
  for (Parameter* p : unused->parameters()) EXPECT_TRUE(p->grad_zero_pending);
  const float norm = grad_norm(both->parameters()).to_vector<float>()[0];
  EXPECT_TRUE(std::isfinite(norm)) << norm;
  for (Parameter* p : unused->parameters()) {
    EXPECT_FALSE(p->grad_zero_pending);
    EXPECT_EQ(p->grad.to_vector<float>(), std::vector<float>(p->grad.numel(), 0.f));
  }
  opt.step();
  EXPECT_EQ(unused->parameters()[0]->data.to_vector<float>(), weight_before);
  // A parameter whose gradient counts as zero at step() (no grad_norm before it) moves as zero.
  opt.zero_grad(ZeroGrad::deferred);
  poison_pending_gradients(*both);
  criterion.forward(used->forward(deferred_zeroing_images(4, 51, device)),
                    deferred_zeroing_labels(4, 2, device));
  used->backward(criterion.backward());
  opt.step();
  for (Parameter* p : both->parameters()) {
    const std::vector<float> v = p->data.to_vector<float>();
    for (float e : v) ASSERT_TRUE(std::isfinite(e));
  }
  EXPECT_EQ(unused->parameters()[0]->data.to_vector<float>(), weight_before);
}

}  // namespace cudp::testing
