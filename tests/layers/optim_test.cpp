// Host tests of SGD, AdamW and clip_grad_norm: several steps against PyTorch's formulas unrolled by
// hand in double, flat (one launch) against per-parameter updates, state export and import, and
// argument checks.
#include "layers/optim.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>

#include "common/compare.h"
#include "common/tensor_bytes.h"
#include "layers/activation.h"
#include "layers/linear.h"
#include "layers/sequential.h"

namespace cudp {
namespace {

using testing::all_close;
using testing::bytes_of;
using testing::random_vector;

constexpr int kSteps = 4;

// Two parameters of different shapes with fixed initial values; gradients differ at every step.
struct Params {
  Parameter a{Tensor::from_vector(random_vector(6, 10), {2, 3}), Tensor::zeros({2, 3})};
  Parameter b{Tensor::from_vector(random_vector(4, 11), {4}), Tensor::zeros({4})};
  std::vector<Parameter*> list() { return {&a, &b}; }

  // The gradients of step t (and their values, for the reference).
  std::vector<std::vector<float>> set_grads(int t) {
    std::vector<std::vector<float>> g = {random_vector(6, 100 + t), random_vector(4, 200 + t)};
    a.grad.copy_from(Tensor::from_vector(g[0], {2, 3}));
    b.grad.copy_from(Tensor::from_vector(g[1], {4}));
    return g;
  }
  std::vector<std::vector<float>> values() const {
    return {a.data.to_vector<float>(), b.data.to_vector<float>()};
  }
};

std::vector<double> as_double(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

// torch.optim.SGD's update for one tensor, in double.
struct SgdReference {
  SGDOptions o;
  std::vector<double> p, buf;
  bool started = false;
  void step(const std::vector<float>& grad) {
    if (buf.empty()) buf.assign(p.size(), 0.0);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = grad[i] + o.weight_decay * p[i];
      if (o.momentum != 0) {
        buf[i] = started ? o.momentum * buf[i] + (1 - o.dampening) * g : g;
        g = o.nesterov ? g + o.momentum * buf[i] : buf[i];
      }
      p[i] -= o.lr * g;
    }
    started = true;
  }
};

// torch.optim.AdamW's update for one tensor, in double.
struct AdamWReference {
  AdamWOptions o;
  std::vector<double> p, m, v;
  int t = 0;
  void step(const std::vector<float>& grad) {
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0);
    ++t;
    const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1 - o.lr * o.weight_decay;
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * grad[i];
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * grad[i] * grad[i];
      p[i] -= o.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + o.eps);
    }
  }
};

template <typename Reference, typename Optim, typename Options>
void expect_matches_reference(const Options& options) {
  Params params;
  Optim optimizer(params.list(), options);
  const auto initial = params.values();
  std::vector<Reference> refs(2);
  for (int k = 0; k < 2; ++k) {
    refs[k].o = options;
    refs[k].p = as_double(initial[k]);
  }
  for (int t = 0; t < kSteps; ++t) {
    const auto grads = params.set_grads(t);
    optimizer.step();
    for (int k = 0; k < 2; ++k) refs[k].step(grads[k]);
    const auto got = params.values();
    for (int k = 0; k < 2; ++k) {
      EXPECT_TRUE(all_close(got[k], refs[k].p, 1e-5, 1e-6)) << "step " << t << ", parameter " << k;
    }
  }
  EXPECT_EQ(optimizer.steps(), kSteps);
  EXPECT_FALSE(optimizer.last_step_was_flat());
}

TEST(SGD, PlainSteps) {
  expect_matches_reference<SgdReference, SGD>(SGDOptions{.lr = 0.1});
}

TEST(SGD, MomentumDampeningAndWeightDecay) {
  expect_matches_reference<SgdReference, SGD>(
      SGDOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 1e-2});
}

TEST(SGD, Nesterov) {
  expect_matches_reference<SgdReference, SGD>(
      SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
}

TEST(AdamW, StepsWithWeightDecay) {
  expect_matches_reference<AdamWReference, AdamW>(
      AdamWOptions{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1});
}

TEST(AdamW, StepsWithoutWeightDecayAndOtherBetas) {
  expect_matches_reference<AdamWReference, AdamW>(
      AdamWOptions{.lr = 3e-3, .beta1 = 0.5, .beta2 = 0.9, .eps = 1e-6, .weight_decay = 0});
}

TEST(Optimizer, ZeroGradZeroesEveryGradient) {
  Params params;
  SGD sgd(params.list(), {.lr = 0.1});
  params.set_grads(0);
  sgd.zero_grad();
  EXPECT_EQ(params.a.grad.to_vector<float>(), std::vector<float>(6, 0.f));
  EXPECT_EQ(params.b.grad.to_vector<float>(), std::vector<float>(4, 0.f));
}

// ---- flat parameters ----------------------------------------------------------------------------

std::shared_ptr<Sequential> small_model() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Linear>(5, 7, true, 1), std::make_shared<ReLU>(),
      std::make_shared<Linear>(7, 3, true, 2)});
}

// Writes the same pseudo-random gradients (by parameter index and step) into a model.
void set_grads(Module& model, int t) {
  int k = 0;
  for (Parameter* p : model.parameters()) {
    p->grad.copy_from(Tensor::from_vector(random_vector(p->grad.numel(), 1000 * t + k++, -1.f, 1.f),
                                          p->grad.shape()));
  }
}

void expect_identical(const TensorMap& a, const TensorMap& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    EXPECT_EQ(t.to_vector<float>(), b.at(name).to_vector<float>()) << name;
  }
}

template <typename Optim, typename Options>
void expect_flat_equals_per_parameter(const Options& options) {
  auto flat_model = small_model();
  auto plain_model = small_model();
  flat_model->flatten_parameters();
  Optim flat(flat_model->parameters(), options);
  Optim plain(plain_model->parameters(), options);
  for (int t = 0; t < 3; ++t) {
    set_grads(*flat_model, t);
    set_grads(*plain_model, t);
    flat.step();
    plain.step();
    EXPECT_TRUE(flat.last_step_was_flat());
    EXPECT_FALSE(plain.last_step_was_flat());
  }
  // Every element's update depends on that element alone: bit-identical results.
  expect_identical(flat_model->state_dict(), plain_model->state_dict());
  expect_identical(flat.state_dict(), plain.state_dict());

  // zero_grad on the flat buffer clears every gradient.
  flat.zero_grad();
  for (Parameter* p : flat_model->parameters()) {
    EXPECT_EQ(p->grad.to_vector<float>(), std::vector<float>(p->grad.numel(), 0.f));
  }
}

// step_and_grad_norm: grad_norm() then step(), bit for bit (the norm from the update's own launch
// where the parameters are flat, from grad_norm otherwise).
template <typename Optim, typename Options>
void expect_step_and_grad_norm_is_norm_then_step(const Options& options, bool flat) {
  SCOPED_TRACE(flat ? "flat" : "per parameter");
  auto with = small_model(), alone = small_model();
  if (flat) {
    with->flatten_parameters();
    alone->flatten_parameters();
  }
  Optim a(with->parameters(), options), b(alone->parameters(), options);
  for (int t = 0; t < 3; ++t) {
    set_grads(*with, t);
    set_grads(*alone, t);
    const Tensor norm = a.step_and_grad_norm();
    const Tensor expected = grad_norm(alone->parameters());
    b.step();
    EXPECT_EQ(a.last_norm_was_fused(), flat);
    EXPECT_EQ(norm.to_vector<float>(), expected.to_vector<float>());
    EXPECT_GT(norm.to_vector<float>()[0], 0.f);
  }
  expect_identical(with->state_dict(), alone->state_dict());
  expect_identical(a.state_dict(), b.state_dict());
}

TEST(Optimizer, StepAndGradNormIsGradNormThenStep) {
  for (const bool flat : {true, false}) {
    expect_step_and_grad_norm_is_norm_then_step<SGD>(
        SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true}, flat);
    expect_step_and_grad_norm_is_norm_then_step<AdamW>(AdamWOptions{.lr = 1e-2}, flat);
  }
}

TEST(Optimizer, FlatSgdEqualsPerParameterSgd) {
  expect_flat_equals_per_parameter<SGD>(
      SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
}

TEST(Optimizer, FlatAdamWEqualsPerParameterAdamW) {
  expect_flat_equals_per_parameter<AdamW>(AdamWOptions{.lr = 1e-2});
}

// ---- state export and import --------------------------------------------------------------------

template <typename Optim, typename Options>
void expect_resume_is_exact(const Options& options, const std::vector<std::string>& expected_keys) {
  Params first;
  Optim original(first.list(), options);
  for (int t = 0; t < 2; ++t) {
    first.set_grads(t);
    original.step();
  }
  const TensorMap state = original.state_dict();
  std::vector<std::string> keys;
  for (const auto& [key, t] : state) keys.push_back(key);
  EXPECT_EQ(keys, expected_keys);

  // A second optimizer over a copy of the parameters, resumed from the state, steps identically.
  Params second;
  second.a.data.copy_from(first.a.data);
  second.b.data.copy_from(first.b.data);
  Optim resumed(second.list(), options);
  resumed.load_state_dict(state);
  resumed.load_hyperparameters(original.hyperparameters());
  EXPECT_EQ(resumed.steps(), 2);
  first.set_grads(2);
  second.set_grads(2);
  original.step();
  resumed.step();
  EXPECT_EQ(first.values(), second.values());
}

TEST(Optimizer, SgdStateRoundTrips) {
  expect_resume_is_exact<SGD>(SGDOptions{.lr = 0.1, .momentum = 0.9},
                              {"0.momentum_buffer", "1.momentum_buffer"});
}

TEST(Optimizer, AdamWStateRoundTrips) {
  expect_resume_is_exact<AdamW>(AdamWOptions{.lr = 1e-2}, {"0.exp_avg", "0.exp_avg_sq", "0.step",
                                                           "1.exp_avg", "1.exp_avg_sq", "1.step"});
}

TEST(Optimizer, StateUsesParameterNamesWhenGiven) {
  Params params;
  AdamW adamw(params.list(), {});
  params.set_grads(0);
  adamw.step();
  const std::vector<std::string> names = {"features.0.weight", "features.0.bias"};
  const TensorMap state = adamw.state_dict(names);
  EXPECT_EQ(state.count("features.0.weight.exp_avg"), 1u);
  EXPECT_EQ(state.at("features.0.bias.step").to_vector<float>()[0], 1.f);
  EXPECT_EQ(state.at("features.0.bias.step").shape(), Shape{});
  EXPECT_NO_THROW(adamw.load_state_dict(state, names));
  EXPECT_THROW(adamw.load_state_dict(state), ValueError);  // index keys expected
}

TEST(Optimizer, SgdWithoutMomentumKeepsNoState) {
  Params params;
  SGD sgd(params.list(), {.lr = 0.1});
  params.set_grads(0);
  sgd.step();
  EXPECT_TRUE(sgd.state_dict().empty());
}

// load_state_dict(state) throws ValueError containing `part`, and leaves the optimizer unchanged.
void expect_load_error(Optimizer& optimizer, const TensorMap& state, const std::string& part) {
  const TensorMap before = optimizer.state_dict();
  try {
    optimizer.load_state_dict(state);
    ADD_FAILURE() << "expected ValueError containing " << part;
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
  expect_identical(before, optimizer.state_dict());
}

TEST(Optimizer, LoadStateDictValidatesEveryKey) {
  Params params;
  AdamW adamw(params.list(), {});
  params.set_grads(0);
  adamw.step();
  TensorMap good = adamw.state_dict();

  TensorMap bad = good;
  bad["7.exp_avg"] = Tensor::zeros({4});
  expect_load_error(adamw, bad, "key '7.exp_avg' does not name a parameter");
  bad = good;
  bad["1.momentum_buffer"] = Tensor::zeros({4});
  expect_load_error(adamw, bad, "unknown state 'momentum_buffer'");
  bad = good;
  bad["0.exp_avg"] = Tensor::zeros({3, 2});
  expect_load_error(adamw, bad,
                    "key '0.exp_avg' has shape [3, 2] but its parameter has shape [2, 3]");
  bad = good;
  bad.erase("1.exp_avg_sq");
  expect_load_error(adamw, bad, "has 2 of its 3 state entries");
  bad = good;
  bad["1.step"] = Tensor::full({}, 0.5f);
  expect_load_error(adamw, bad, "key '1.step' must be a whole number >= 1");
  bad = good;
  bad["1.exp_avg"] = Tensor::zeros({4}, DType::i32);
  expect_load_error(adamw, bad, "must be an f32 tensor");
}

TEST(Optimizer, HyperparametersArePrintedExactly) {
  Params params;
  SGD sgd(params.list(), {.lr = 0.1, .momentum = 0.9, .nesterov = true});
  const Metadata h = sgd.hyperparameters();
  EXPECT_EQ(std::stod(h.at("lr")), 0.1);
  EXPECT_EQ(std::stod(h.at("momentum")), 0.9);
  EXPECT_EQ(h.at("nesterov"), "true");
  EXPECT_EQ(h.at("steps"), "0");

  Params other;
  SGD restored(other.list(), {.lr = 1.0});
  Metadata saved = h;
  saved["steps"] = "17";
  restored.load_hyperparameters(saved);
  EXPECT_EQ(restored.lr(), 0.1);
  EXPECT_EQ(restored.steps(), 17);
  saved["steps"] = "17x";
  EXPECT_THROW(restored.load_hyperparameters(saved), ValueError);
}

// A checkpoint's learning rate is text: std::stod reads "inf" and "nan" as numbers, and an update
// with either spoils every weight. They, and a negative rate, are refused naming the key, and
// nothing is restored.
TEST(Optimizer, LoadedLearningRateMustBeFiniteAndNonNegative) {
  Params params;
  SGD sgd(params.list(), {.lr = 0.5});
  for (const char* lr : {"inf", "-inf", "nan", "-0.25", "1e999"}) {
    const Metadata saved = {{"lr", lr}, {"steps", "3"}};
    try {
      sgd.load_hyperparameters(saved);
      ADD_FAILURE() << "lr '" << lr << "' was accepted";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("hyperparameter \"lr\" is"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(lr), std::string::npos) << e.what();
    }
    EXPECT_EQ(sgd.lr(), 0.5) << lr;
    EXPECT_EQ(sgd.steps(), 0) << lr;
  }
  sgd.load_hyperparameters({{"lr", "0"}, {"steps", "3"}});  // zero is a learning rate
  EXPECT_EQ(sgd.lr(), 0.0);
  EXPECT_EQ(sgd.steps(), 3);
}

// ---- arguments ----------------------------------------------------------------------------------

TEST(Optimizer, ValidatesLikePyTorch) {
  Params params;
  EXPECT_THROW(SGD({}, {}), ValueError);
  EXPECT_THROW(SGD({&params.a, &params.a}, {}), ValueError);
  EXPECT_THROW(SGD(params.list(), {.lr = -1}), ValueError);
  EXPECT_THROW(SGD(params.list(), {.momentum = -0.5}), ValueError);
  EXPECT_THROW(SGD(params.list(), {.momentum = 0.9, .dampening = 0.1, .nesterov = true}),
               ValueError);
  EXPECT_THROW(SGD(params.list(), {.nesterov = true}), ValueError);
  EXPECT_THROW(AdamW(params.list(), {.beta1 = 1.0}), ValueError);
  EXPECT_THROW(AdamW(params.list(), {.eps = -1}), ValueError);
  SGD sgd(params.list(), {});
  EXPECT_THROW(sgd.set_lr(-0.1), ValueError);
}

TEST(Optimizer, StepChecksGradients) {
  Params params;
  SGD sgd(params.list(), {.lr = 0.1});
  params.b.grad = Tensor::zeros({5});
  EXPECT_THROW(sgd.step(), ValueError);
  params.b.grad = Tensor();
  EXPECT_THROW(sgd.step(), ValueError);
}

// ---- clip_grad_norm -----------------------------------------------------------------------------

TEST(ClipGradNorm, ScalesByMaxNormOverTotalNorm) {
  Parameter a{Tensor::zeros({2}), Tensor::from_vector<float>({3.f, 4.f}, {2})};
  Parameter b{Tensor::zeros({1}), Tensor::from_vector<float>({12.f}, {1})};
  // total norm sqrt(9 + 16 + 144) = 13; max_norm 6.5 gives a factor 6.5 / (13 + 1e-6).
  const Tensor norm = clip_grad_norm({&a, &b}, 6.5);
  EXPECT_EQ(norm.shape(), Shape{});
  EXPECT_NEAR(norm.to_vector<float>()[0], 13.0, 1e-6);
  const double coef = 6.5 / (13.0 + 1e-6);
  EXPECT_TRUE(
      all_close(a.grad.to_vector<float>(), std::vector<double>{3 * coef, 4 * coef}, 1e-6, 0));
  EXPECT_TRUE(all_close(b.grad.to_vector<float>(), std::vector<double>{12 * coef}, 1e-6, 0));

  // Below max_norm the factor is exactly 1: nothing changes.
  const std::vector<float> before = a.grad.to_vector<float>();
  clip_grad_norm({&a, &b}, 100.0);
  EXPECT_EQ(a.grad.to_vector<float>(), before);
}

TEST(ClipGradNorm, FlatAgreesWithPerParameter) {
  auto flat_model = small_model();
  auto plain_model = small_model();
  flat_model->flatten_parameters();
  set_grads(*flat_model, 0);
  set_grads(*plain_model, 0);
  const float flat_norm = clip_grad_norm(flat_model->parameters(), 0.5).to_vector<float>()[0];
  const float plain_norm = clip_grad_norm(plain_model->parameters(), 0.5).to_vector<float>()[0];
  EXPECT_NEAR(flat_norm, plain_norm, 1e-6 * plain_norm);
  EXPECT_GT(plain_norm, 0.5f);  // so that clipping happened
  const auto fp = flat_model->parameters(), pp = plain_model->parameters();
  for (size_t i = 0; i < fp.size(); ++i) {
    EXPECT_TRUE(
        all_close(fp[i]->grad.to_vector<float>(), pp[i]->grad.to_vector<float>(), 1e-6, 1e-9));
  }
}

TEST(ClipGradNorm, EmptyListIsZero) {
  EXPECT_EQ(clip_grad_norm({}, 1.0).to_vector<float>()[0], 0.f);
}

// ---- skipping a step on the device: step(skip) --------------------------------------------------

Tensor flag(int32_t value) {
  return Tensor::from_vector<int32_t>({value}, {1});
}

Tensor scalar(float value) {
  return Tensor::from_vector<float>({value}, {});
}


// Non-finite gradients: an update that is not skipped would spoil every parameter.
void set_nan_grads(Module& model) {
  for (Parameter* p : model.parameters()) p->grad.fill_(std::nanf(""));
}

// The gated optimizer is issued steps 0..4 and skips 0 and 2 (the very first, so SGD's first
// momentum step and AdamW's step 1 come after a skip); the reference, ungated, takes only steps 1,
// 3 and 4 with the same gradients. Both run the same per-element formulas, so the parameters and
// the state must agree bit for bit. With read_every_step the test also reads every byte around
// each skipped step (each read folds the device's skip count into the host's); without, three
// steps run on counts the "device" still corrects (StepGate: first step and bias corrections).
template <typename Optim, typename Options>
void expect_skipped_steps_change_nothing(const Options& options, bool flat, bool read_every_step) {
  SCOPED_TRACE(::testing::Message() << "flat " << flat << ", read every step " << read_every_step);
  auto gated_model = small_model(), ref_model = small_model();
  if (flat) {
    gated_model->flatten_parameters();
    ref_model->flatten_parameters();
  }
  Optim gated(gated_model->parameters(), options), ref(ref_model->parameters(), options);
  const std::vector<int32_t> skips = {1, 0, 1, 0, 0};
  int64_t taken = 0;
  for (int t = 0; t < static_cast<int>(skips.size()); ++t) {
    if (skips[t]) {
      set_nan_grads(*gated_model);
      if (!read_every_step) {
        gated.step(flag(1));
        continue;
      }
      const auto model_before = bytes_of(gated_model->state_dict());
      const auto state_before = bytes_of(gated.state_dict());
      gated.step(flag(1));
      EXPECT_EQ(bytes_of(gated_model->state_dict()), model_before) << "step " << t;
      EXPECT_EQ(bytes_of(gated.state_dict()), state_before) << "step " << t;
      EXPECT_EQ(gated.steps(), taken);
      continue;
    }
    set_grads(*gated_model, t);
    set_grads(*ref_model, t);
    gated.step(flag(0));
    ref.step();
    ++taken;
    if (read_every_step) {
      EXPECT_EQ(bytes_of(gated_model->state_dict()), bytes_of(ref_model->state_dict()))
          << "step " << t;
      EXPECT_EQ(bytes_of(gated.state_dict()), bytes_of(ref.state_dict())) << "step " << t;
      EXPECT_EQ(gated.steps(), taken);
    }
  }
  EXPECT_EQ(gated.last_step_was_flat(), flat);
  EXPECT_EQ(bytes_of(gated_model->state_dict()), bytes_of(ref_model->state_dict()));
  EXPECT_EQ(bytes_of(gated.state_dict()), bytes_of(ref.state_dict()));
  EXPECT_EQ(gated.skipped_steps(), 2);
  EXPECT_EQ(gated.steps(), 3);
  EXPECT_EQ(gated.hyperparameters().at("steps"), "3");

  // An ordinary step after gated ones still counts the skips; a checkpoint's state goes on exactly.
  set_grads(*gated_model, 9);
  set_grads(*ref_model, 9);
  gated.step();
  ref.step();
  EXPECT_EQ(bytes_of(gated_model->state_dict()), bytes_of(ref_model->state_dict()));
  EXPECT_EQ(bytes_of(gated.state_dict()), bytes_of(ref.state_dict()));
  EXPECT_EQ(gated.steps(), 4);
}

// A non-finite gradient norm over flat parameters (the trainer's skip-step case) scales the
// gradients by NaN; the zero padding between parameters in the flat buffer must stay zero, or every
// later norm over the buffer would be NaN and every later step skipped.
TEST(OptimizerSkip, ANonFiniteNormLeavesTheFlatPaddingZero) {
  auto model = small_model();
  model->flatten_parameters();  // 35 + 7 + 21 + 3 floats: padding after each
  set_nan_grads(*model);
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isnan(clip_grad_norm(model->parameters(), inf).to_vector<float>()[0]));
  set_grads(*model, 1);
  const float norm = clip_grad_norm(model->parameters(), inf).to_vector<float>()[0];
  EXPECT_TRUE(std::isfinite(norm)) << norm;
  double sum = 0;
  for (Parameter* p : model->parameters()) {
    for (float g : p->grad.to_vector<float>()) sum += double(g) * g;
  }
  EXPECT_NEAR(norm, std::sqrt(sum), 1e-5 * std::sqrt(sum));
}

TensorMap gradient_map(Module& model) {
  TensorMap out;
  for (auto& [name, p] : model.named_parameters()) out.emplace(name, p->grad);
  return out;
}

// grad_norm is clip_grad_norm's norm without the scaling, flat or not: the same value, bit for bit,
// and the gradients untouched, even when the norm is not finite.
TEST(OptimizerSkip, GradNormIsClipGradNormsNormWithoutScaling) {
  for (const bool flat : {false, true}) {
    SCOPED_TRACE(flat ? "flat" : "separate");
    auto a = small_model(), b = small_model();
    if (flat) {
      a->flatten_parameters();
      b->flatten_parameters();
    }
    set_grads(*a, 3);
    set_grads(*b, 3);
    const auto before = bytes_of(gradient_map(*a));
    const float norm = grad_norm(a->parameters()).to_vector<float>()[0];
    EXPECT_EQ(bytes_of(gradient_map(*a)), before) << "grad_norm changed a gradient";
    const float clipped = clip_grad_norm(b->parameters(), 1e30).to_vector<float>()[0];
    EXPECT_EQ(norm, clipped);
    set_nan_grads(*a);
    const auto nan_before = bytes_of(gradient_map(*a));
    EXPECT_TRUE(std::isnan(grad_norm(a->parameters()).to_vector<float>()[0]));
    EXPECT_EQ(bytes_of(gradient_map(*a)), nan_before);
  }
}

TEST(OptimizerSkip, SgdSkippedStepsChangeNothing) {
  const SGDOptions o{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 5e-4};
  for (const bool flat : {false, true}) {
    for (const bool read : {false, true}) expect_skipped_steps_change_nothing<SGD>(o, flat, read);
  }
  const SGDOptions nesterov{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true};
  expect_skipped_steps_change_nothing<SGD>(nesterov, true, false);
  expect_skipped_steps_change_nothing<SGD>(SGDOptions{.lr = 0.1}, true, true);  // no state
}

TEST(OptimizerSkip, AdamWSkippedStepsChangeNothing) {
  const AdamWOptions o{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.95, .weight_decay = 0.05};
  for (const bool flat : {false, true}) {
    for (const bool read : {false, true}) expect_skipped_steps_change_nothing<AdamW>(o, flat, read);
  }
}

// A skipped first step leaves no state behind, as PyTorch's skipped optimizer.step() would.
TEST(OptimizerSkip, ASkippedFirstStepLeavesNoState) {
  auto model = small_model();
  SGD sgd(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  set_nan_grads(*model);
  sgd.step(flag(1));
  EXPECT_TRUE(sgd.state_dict().empty());
  EXPECT_EQ(sgd.steps(), 0);
  AdamW adamw(model->parameters(), {.lr = 1e-3});
  adamw.step(flag(1));
  EXPECT_TRUE(adamw.state_dict().empty());
  EXPECT_EQ(adamw.skipped_steps(), 1);
}

// State loaded after unread skips is not corrected by them.
TEST(OptimizerSkip, LoadingStateAfterSkipsStartsFromTheLoadedCounts) {
  auto a = small_model(), b = small_model();
  AdamW first(a->parameters(), {.lr = 1e-2}), second(b->parameters(), {.lr = 1e-2});
  set_grads(*a, 0);
  first.step();
  set_nan_grads(*b);
  second.step(flag(1));
  second.step(flag(1));
  b->load_state_dict(a->state_dict());
  second.load_state_dict(first.state_dict());
  set_grads(*a, 1);
  set_grads(*b, 1);
  first.step();
  second.step(flag(0));
  EXPECT_EQ(bytes_of(b->state_dict()), bytes_of(a->state_dict()));
  EXPECT_EQ(bytes_of(second.state_dict()), bytes_of(first.state_dict()));
  EXPECT_EQ(second.skipped_steps(), 2);
}

TEST(OptimizerSkip, NonfiniteFlagOfTheLossAndTheGradientNorm) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  const auto value = [](const Tensor& t) { return t.to_vector<int32_t>().at(0); };
  EXPECT_EQ(value(nonfinite_flag(scalar(2.5f), scalar(1e30f))), 0);
  EXPECT_EQ(value(nonfinite_flag(scalar(2.5f))), 0);
  EXPECT_EQ(value(nonfinite_flag(scalar(nan), scalar(1.f))), 1);
  EXPECT_EQ(value(nonfinite_flag(scalar(1.f), scalar(inf))), 1);
  EXPECT_EQ(value(nonfinite_flag(scalar(-inf))), 1);
  EXPECT_EQ(value(nonfinite_flag(scalar(1.f), scalar(-nan))), 1);
  EXPECT_THROW(nonfinite_flag(Tensor::from_vector<int32_t>({1}, {1})), ValueError);
  EXPECT_THROW(nonfinite_flag(Tensor::zeros({2})), ValueError);
}

TEST(OptimizerSkip, ABadSkipFlagIsRefusedNamingIt) {
  auto model = small_model();
  SGD sgd(model->parameters(), {.lr = 0.1});
  set_grads(*model, 0);
  try {
    sgd.step(Tensor::zeros({1}));
    ADD_FAILURE() << "an f32 flag was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("must be one i32 element (nonfinite_flag makes it)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(sgd.step(Tensor()), ValueError);
  EXPECT_THROW(sgd.step(Tensor::from_vector<int32_t>({0, 0}, {2})), ValueError);
  EXPECT_EQ(sgd.steps(), 0);
}

}  // namespace
}  // namespace cudp
