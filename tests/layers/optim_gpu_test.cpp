// GPU tests of the optimizers and clipping: CUDA against the CPU path over several steps, flat
// against per-parameter on the device, state round trips through the host.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>

#include "common/compare.h"
#include "common/tensor_bytes.h"
#include "common/gpu.h"
#include "common/memory_hog.h"
#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/optim.h"
#include "layers/sequential.h"

namespace cudp {
namespace {

using testing::all_close;
using testing::bytes_of;
using testing::random_vector;

const Device kGpu = Device::cuda(0);

std::shared_ptr<Module> model_on(Device device) {
  auto model = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Linear>(33, 17, true, 1), std::make_shared<ReLU>(),
      std::make_shared<Linear>(17, 5, true, 2)});
  model->to(device);
  return model;
}

void set_grads(Module& model, int t) {
  int k = 0;
  for (Parameter* p : model.parameters()) {
    p->grad.copy_from(
        Tensor::from_vector(random_vector(p->grad.numel(), 1000 * t + k++), p->grad.shape()));
  }
}

void expect_close(const TensorMap& actual, const TensorMap& expected, double rtol, double atol) {
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, t] : expected) {
    EXPECT_TRUE(all_close(actual.at(name).to_vector<float>(), t.to_vector<float>(), rtol, atol))
        << name;
  }
}

// K steps of the same optimizer on the GPU and on the CPU, with the same gradients. The kernels
// and the CPU references evaluate one shared formula per element (kernels/optim.h), so the results
// agree to the last bits; the tolerance leaves room for a compiler's different sqrt/division only.
template <typename Optim, typename Options>
void expect_gpu_matches_cpu(const Options& options, bool flat) {
  auto cpu = model_on(Device::cpu()), gpu = model_on(kGpu);
  if (flat) gpu->flatten_parameters();
  Optim on_cpu(cpu->parameters(), options), on_gpu(gpu->parameters(), options);
  for (int t = 0; t < 5; ++t) {
    set_grads(*cpu, t);
    set_grads(*gpu, t);
    on_cpu.step();
    on_gpu.step();
    EXPECT_EQ(on_gpu.last_step_was_flat(), flat);
  }
  expect_close(gpu->state_dict(), cpu->state_dict(), 1e-6, 1e-7);
  expect_close(on_gpu.state_dict(), on_cpu.state_dict(), 1e-6, 1e-7);
}

// step_and_grad_norm on the device: the same bits as grad_norm() then step() (one launch doing
// both where the parameters are flat), the norm against the CPU's double sum.
template <typename Optim, typename Options>
void expect_step_and_grad_norm_on_gpu(const Options& options, bool flat) {
  SCOPED_TRACE(flat ? "flat" : "per parameter");
  auto with = model_on(kGpu), alone = model_on(kGpu), cpu = model_on(Device::cpu());
  if (flat) {
    with->flatten_parameters();
    alone->flatten_parameters();
  }
  Optim a(with->parameters(), options), b(alone->parameters(), options);
  for (int t = 0; t < 4; ++t) {
    set_grads(*with, t);
    set_grads(*alone, t);
    set_grads(*cpu, t);
    const Tensor norm = a.step_and_grad_norm();
    const Tensor expected = grad_norm(alone->parameters());
    b.step();
    EXPECT_EQ(a.last_norm_was_fused(), flat);
    EXPECT_TRUE(norm.is_cuda());
    EXPECT_EQ(norm.to_vector<float>(), expected.to_vector<float>()) << "step " << t;
    EXPECT_TRUE(all_close(norm.to_vector<float>(), grad_norm(cpu->parameters()).to_vector<float>(),
                          1e-6, 0));
  }
  EXPECT_EQ(bytes_of(with->state_dict()), bytes_of(alone->state_dict()));
  EXPECT_EQ(bytes_of(a.state_dict()), bytes_of(b.state_dict()));
}

TEST(OptimGpu, StepAndGradNormIsGradNormThenStepBitForBit) {
  CUDP_REQUIRE_GPU();
  for (const bool flat : {true, false}) {
    expect_step_and_grad_norm_on_gpu<SGD>(
        SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true}, flat);
    expect_step_and_grad_norm_on_gpu<AdamW>(AdamWOptions{.lr = 1e-2, .weight_decay = 0.1}, flat);
  }
}

TEST(OptimGpu, SgdNesterovWeightDecayMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const SGDOptions o{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true};
  expect_gpu_matches_cpu<SGD>(o, false);
  expect_gpu_matches_cpu<SGD>(o, true);
}

TEST(OptimGpu, SgdDampeningMatchesCpu) {
  CUDP_REQUIRE_GPU();
  expect_gpu_matches_cpu<SGD>(SGDOptions{.lr = 0.1, .momentum = 0.8, .dampening = 0.3}, true);
}

TEST(OptimGpu, AdamWMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const AdamWOptions o{.lr = 1e-2, .weight_decay = 0.05};
  expect_gpu_matches_cpu<AdamW>(o, false);
  expect_gpu_matches_cpu<AdamW>(o, true);
}

TEST(OptimGpu, StateRoundTripsThroughTheHost) {
  CUDP_REQUIRE_GPU();
  auto a = model_on(kGpu), b = model_on(kGpu);
  AdamW first(a->parameters(), {.lr = 1e-2}), second(b->parameters(), {.lr = 1e-2});
  set_grads(*a, 0);
  first.step();
  const TensorMap state = first.state_dict();
  for (const auto& [name, t] : state) EXPECT_TRUE(t.is_cpu()) << name;
  b->load_state_dict(a->state_dict());
  second.load_state_dict(state);
  set_grads(*a, 1);
  set_grads(*b, 1);
  first.step();
  second.step();
  expect_close(b->state_dict(), a->state_dict(), 0, 0);  // bit-identical
}

TEST(OptimGpu, ZeroGradOnTheDevice) {
  CUDP_REQUIRE_GPU();
  for (bool flat : {false, true}) {
    auto model = model_on(kGpu);
    if (flat) model->flatten_parameters();
    SGD sgd(model->parameters(), {});
    set_grads(*model, 0);
    sgd.zero_grad();
    for (Parameter* p : model->parameters()) {
      EXPECT_EQ(p->grad.to_vector<float>(), std::vector<float>(p->grad.numel(), 0.f));
    }
  }
}

TEST(OptimGpu, ClipGradNormMatchesCpu) {
  CUDP_REQUIRE_GPU();
  for (bool flat : {false, true}) {
    SCOPED_TRACE(flat ? "flat" : "per parameter");
    auto cpu = model_on(Device::cpu()), gpu = model_on(kGpu);
    if (flat) gpu->flatten_parameters();
    set_grads(*cpu, 3);
    set_grads(*gpu, 3);
    const Tensor norm = clip_grad_norm(gpu->parameters(), 1.0);
    EXPECT_EQ(norm.device(), kGpu);
    const float expected = clip_grad_norm(cpu->parameters(), 1.0).to_vector<float>()[0];
    EXPECT_GT(expected, 1.f);  // clipping happened
    // fp32 reduction on the device against double accumulation on the host.
    EXPECT_TRUE(all_close(norm.to_vector<float>(), std::vector<float>{expected}, 1e-5, 0));
    const auto gp = gpu->parameters(), cp = cpu->parameters();
    for (size_t i = 0; i < gp.size(); ++i) {
      EXPECT_TRUE(
          all_close(gp[i]->grad.to_vector<float>(), cp[i]->grad.to_vector<float>(), 1e-5, 1e-8));
    }
  }
}

// ---- step(skip) on the device -------------------------------------------------------------------


// The flag a training step writes on the GPU from its loss (finite or NaN) and gradient norm.
Tensor skip_flag_on_gpu(Module& model, bool diverged) {
  const Tensor loss = Tensor::full({}, diverged ? std::nanf("") : 0.75f, kGpu);
  const Tensor norm = clip_grad_norm(model.parameters(), std::numeric_limits<double>::infinity());
  return nonfinite_flag(loss, norm);
}

// Calls 0..4 on the GPU, 0 and 2 skipped (with NaN gradients); the reference, on the GPU too and
// ungated, takes only calls 1, 3, 4 with the same gradients: bit for bit the same parameters and
// state. With read_every_step every byte is also read around each skipped call; without, nothing
// is read until the end, so the later calls run on counts the device corrects (the trainer's way:
// no host read per step).
template <typename Optim, typename Options>
void expect_gpu_skips(const Options& options, bool flat, bool read_every_step) {
  SCOPED_TRACE(::testing::Message() << "flat " << flat << ", read every step " << read_every_step);
  auto gated_model = model_on(kGpu), ref_model = model_on(kGpu);
  if (flat) {
    gated_model->flatten_parameters();
    ref_model->flatten_parameters();
  }
  Optim gated(gated_model->parameters(), options), ref(ref_model->parameters(), options);
  const std::vector<bool> skips = {true, false, true, false, false};
  for (int t = 0; t < static_cast<int>(skips.size()); ++t) {
    if (skips[t]) {
      for (Parameter* p : gated_model->parameters()) p->grad.fill_(std::nanf(""));
    } else {
      set_grads(*gated_model, t);
      set_grads(*ref_model, t);
      ref.step();
    }
    const Tensor skip = skip_flag_on_gpu(*gated_model, skips[t]);
    EXPECT_EQ(skip.device(), kGpu);
    if (skips[t] && read_every_step) {
      const auto model_before = bytes_of(gated_model->state_dict());
      const auto state_before = bytes_of(gated.state_dict());
      gated.step(skip);
      EXPECT_EQ(bytes_of(gated_model->state_dict()), model_before) << "call " << t;
      EXPECT_EQ(bytes_of(gated.state_dict()), state_before) << "call " << t;
    } else {
      gated.step(skip);
    }
  }
  EXPECT_EQ(gated.last_step_was_flat(), flat);
  EXPECT_EQ(bytes_of(gated_model->state_dict()), bytes_of(ref_model->state_dict()));
  EXPECT_EQ(bytes_of(gated.state_dict()), bytes_of(ref.state_dict()));
  EXPECT_EQ(gated.skipped_steps(), 2);
  EXPECT_EQ(gated.steps(), 3);
}

TEST(OptimGpu, SgdSkipsOnTheDevice) {
  CUDP_REQUIRE_GPU();
  const SGDOptions o{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 5e-4};
  for (const bool flat : {false, true}) {
    for (const bool read : {false, true}) expect_gpu_skips<SGD>(o, flat, read);
  }
}

TEST(OptimGpu, AdamWSkipsOnTheDevice) {
  CUDP_REQUIRE_GPU();
  const AdamWOptions o{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.95, .weight_decay = 0.05};
  for (const bool flat : {false, true}) {
    for (const bool read : {false, true}) expect_gpu_skips<AdamW>(o, flat, read);
  }
}

// The optimizer's state is allocated at the first step; when it does not fit, the error names the
// optimizer, its state and what to change.
TEST(OptimGpu, OutOfMemoryForTheStateNamesTheOptimizer) {
  CUDP_REQUIRE_GPU();
  auto model = std::make_shared<Linear>(4096, 4096, true, 3);  // 64 MiB of weights
  model->to(kGpu);
  AdamW adamw(model->parameters(), {.lr = 1e-3});
  std::string what;
  {
    testing::MemoryHog hog(0, size_t{16} << 20);
    ASSERT_LT(hog.free_bytes(), size_t{64} << 20);
    try {
      adamw.step();
      ADD_FAILURE() << "the state fitted in " << hog.free_bytes() << " free bytes";
    } catch (const OutOfMemoryError& e) {
      what = e.what();
    }
  }
  for (const std::string part : {"CUDA out of memory on cuda:0", "67108864 bytes",
                                 "for AdamW's exp_avg and exp_avg_sq (2 fp32 copies of the "
                                 "parameters)",
                                 "SGD without momentum"}) {
    EXPECT_NE(what.find(part), std::string::npos) << "lacks \"" << part << "\": " << what;
  }
}

TEST(OptimGpu, ASkipFlagOnAnotherDeviceIsRefused) {
  CUDP_REQUIRE_GPU();
  auto model = model_on(kGpu);
  SGD sgd(model->parameters(), {.lr = 0.1});
  set_grads(*model, 0);
  try {
    sgd.step(Tensor::from_vector<int32_t>({0}, {1}));  // on the host
    ADD_FAILURE() << "a host flag was accepted for GPU parameters";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("but the skip flag is on cpu"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace cudp
