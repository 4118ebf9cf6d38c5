// Host tests of the parameter store (layers/module.h, NOTE [The parameter store]): a bf16 model
// flattened keeps a bf16 copy of its weights that equals its fp32 master weights rounded to
// nearest even after every writer -- flattening, SGD and AdamW steps (one launch for the model, or
// one per parameter), skipped steps, load_state_dict, reset_parameters -- and loses it when it may
// no longer hold (another policy, another device). The expected bits come from an independent
// rounding written here on the bit pattern, not from the library's conversion.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/tensor_bytes.h"
#include "layers/activation.h"
#include "layers/init.h"
#include "layers/linear.h"
#include "layers/optim.h"
#include "layers/sequential.h"

namespace cudp {
namespace {

using testing::bf16_bits;
using testing::random_vector;

// fp32 -> bf16 rounded to nearest, ties to even, on the bits (finite inputs only: the tests'
// weights are finite).
uint16_t round_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t lower = u & 0xFFFFu, upper = u >> 16;
  const bool up = lower > 0x8000u || (lower == 0x8000u && (upper & 1u));
  return static_cast<uint16_t>(upper + (up ? 1u : 0u));
}

std::vector<uint16_t> rounded(const Tensor& f32) {
  std::vector<uint16_t> bits;
  for (const float v : f32.to_vector<float>()) bits.push_back(round_to_bf16(v));
  return bits;
}

// Every parameter's compute copy equals its data rounded; returns how many were checked.
int expect_copies_current(Module& model) {
  int checked = 0;
  for (const auto& [name, p] : model.named_parameters()) {
    if (!p->compute.defined()) continue;
    EXPECT_EQ(p->compute.dtype(), DType::bf16) << name;
    EXPECT_EQ(p->compute.shape(), p->data.shape()) << name;
    EXPECT_EQ(bf16_bits(p->compute), rounded(p->data)) << name;
    ++checked;
  }
  return checked;
}

std::shared_ptr<Sequential> small_model() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Linear>(16, 24, true, 1), std::make_shared<ReLU>(),
      std::make_shared<Linear>(24, 8, true, 2)});
}

void set_grads(Module& model, int t) {
  int k = 0;
  for (Parameter* p : model.parameters()) {
    p->grad.copy_from(Tensor::from_vector(random_vector(p->grad.numel(), 100 * t + k++, -1.f, 1.f),
                                          p->grad.shape()));
  }
}

std::vector<std::vector<float>> data_of(Module& model) {
  std::vector<std::vector<float>> out;
  for (Parameter* p : model.parameters()) out.push_back(p->data.to_vector<float>());
  return out;
}

TEST(ParameterStore, FlatteningABf16ModelMakesTheCopiesAndAnFp32ModelNone) {
  auto fp32 = small_model();
  fp32->flatten_parameters();
  for (Parameter* p : fp32->parameters()) EXPECT_FALSE(p->compute.defined());

  auto bf16 = small_model();
  bf16->set_precision(Precision::bf16);
  bf16->flatten_parameters();
  EXPECT_EQ(expect_copies_current(*bf16), 4);
  // One buffer, at the master weights' element offsets.
  const auto params = bf16->parameters();
  const auto* base = params[0]->compute.data<__nv_bfloat16>();
  const float* data_base = params[0]->data.data<float>();
  for (Parameter* p : params) {
    EXPECT_TRUE(p->compute.shares_storage(params[0]->compute));
    EXPECT_EQ(p->compute.data<__nv_bfloat16>() - base, p->data.data<float>() - data_base);
  }
}

template <typename Optim, typename Options>
void expect_steps_keep_the_copies(const Options& options) {
  // The same steps with the store (one launch writes both) and without it (an fp32 model whose
  // weights are the same): the master weights must not change by the store's presence.
  auto with_store = small_model(), without = small_model();
  with_store->set_precision(Precision::bf16);
  with_store->flatten_parameters();
  without->flatten_parameters();
  Optim a(with_store->parameters(), options), b(without->parameters(), options);
  for (int t = 0; t < 3; ++t) {
    set_grads(*with_store, t);
    set_grads(*without, t);
    a.step();
    b.step();
    EXPECT_TRUE(a.last_step_was_flat());
    EXPECT_EQ(expect_copies_current(*with_store), 4) << "step " << t;
  }
  EXPECT_EQ(data_of(*with_store), data_of(*without));

  // Part of the model under another policy: its copies are dropped, the rest are written by
  // per-parameter updates.
  with_store->children()[2].second->set_precision(Precision::fp32);
  set_grads(*with_store, 3);
  a.step();
  EXPECT_FALSE(a.last_step_was_flat());
  EXPECT_EQ(expect_copies_current(*with_store), 2);
}

TEST(ParameterStore, SgdWritesTheCopiesWithTheMasterWeights) {
  expect_steps_keep_the_copies<SGD>(SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3});
}

TEST(ParameterStore, AdamWWritesTheCopiesWithTheMasterWeights) {
  expect_steps_keep_the_copies<AdamW>(AdamWOptions{.lr = 1e-2, .weight_decay = 1e-2});
}

TEST(ParameterStore, ASkippedStepLeavesWeightsAndCopiesAsTheyWere) {
  auto model = small_model();
  model->set_precision(Precision::bf16);
  model->flatten_parameters();
  SGD opt(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  set_grads(*model, 0);
  opt.step();
  const auto before = data_of(*model);
  std::vector<std::vector<uint16_t>> copies;
  for (Parameter* p : model->parameters()) copies.push_back(bf16_bits(p->compute));
  Tensor skip = Tensor::from_vector(std::vector<int32_t>{1}, {1});
  set_grads(*model, 1);
  opt.step(skip);
  EXPECT_EQ(data_of(*model), before);
  size_t k = 0;
  for (Parameter* p : model->parameters()) EXPECT_EQ(bf16_bits(p->compute), copies[k++]);
  EXPECT_EQ(opt.skipped_steps(), 1);
}

TEST(ParameterStore, LoadStateDictRefreshesTheCopies) {
  auto model = small_model(), other = small_model();
  model->set_precision(Precision::bf16);
  model->flatten_parameters();
  // Other weights: every parameter scaled, so that every copy must change.
  for (Parameter* p : other->parameters()) {
    std::vector<float> v = p->data.to_vector<float>();
    for (float& f : v) f = f * 3.0f + 0.25f;
    p->data.copy_from(Tensor::from_vector(v, p->data.shape()));
  }
  const auto old_copy = bf16_bits(model->parameters()[0]->compute);
  model->load_state_dict(other->state_dict());
  EXPECT_EQ(data_of(*model), data_of(*other));
  EXPECT_EQ(expect_copies_current(*model), 4);
  EXPECT_NE(bf16_bits(model->parameters()[0]->compute), old_copy);

  // A write through the data pointer is the caller's to announce.
  Parameter* w = model->parameters()[0];
  w->data.data<float>()[0] = 1234.5f;
  model->refresh_compute_copies();
  EXPECT_EQ(expect_copies_current(*model), 4);
}

TEST(ParameterStore, ResettingTheParametersRefreshesTheCopies) {
  auto model = small_model();
  model->set_precision(Precision::bf16);
  model->flatten_parameters();
  const auto old_copy = bf16_bits(model->parameters()[0]->compute);
  init::reset_parameters(*model, 12345);
  EXPECT_EQ(expect_copies_current(*model), 4);
  EXPECT_NE(bf16_bits(model->parameters()[0]->compute), old_copy);
}

TEST(ParameterStore, AnotherPolicyDropsTheCopiesAndTheSameDeviceKeepsThem) {
  auto model = small_model();
  model->set_precision(Precision::bf16);
  model->flatten_parameters();
  model->set_precision(Precision::tf32);
  for (Parameter* p : model->parameters()) EXPECT_FALSE(p->compute.defined());

  // to() the device it is on keeps the store (to another device drops it: the GPU tests).
  auto stays = small_model();
  stays->set_precision(Precision::bf16);
  stays->flatten_parameters();
  stays->to(Device::cpu());
  EXPECT_EQ(expect_copies_current(*stays), 4);
  // A clone has separate tensors and no copies until it is flattened.
  auto original = small_model();
  original->set_precision(Precision::bf16);
  original->flatten_parameters();
  const std::shared_ptr<Module> copy = original->clone(Device::cpu());
  for (Parameter* p : copy->parameters()) {
    EXPECT_FALSE(p->compute.defined());
  }
}

}  // namespace
}  // namespace cudp
