// An exact-resume check shared by the host and GPU checkpoint tests: a small network with every
// kind of state (Conv2d, BatchNorm2d's running statistics and batch count, Linear, SGD's momentum)
// trains K steps on a device under a precision policy, is saved, is loaded into a fresh model and
// optimizer, and trains K more; the truth is the same network trained 2K steps without a stop. The
// two must agree bit for bit: parameters, buffers, momentum, step count and every loss of the last
// K steps. Under bf16 the weights are stored fp32 (the master copy) and the bf16 copies are made
// from them at each forward, so a resume that restores the fp32 state restores the run.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/compare.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/checkpoint.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/temp_dir.h"

namespace cudp::testing {

struct ResumeRun {
  std::shared_ptr<Sequential> model;
  std::unique_ptr<SGD> sgd;
  std::vector<float> losses;  // one per step taken by this object
};

// NHWC [8, 8, 8, 8] -> 3 classes. 8 input channels, so that the bf16 convolution needs no padding.
inline ResumeRun make_resume_run(uint64_t seed, Device device, Precision precision) {
  ResumeRun run;
  run.model = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(8, 16, 3, 1, 1, true, seed), std::make_shared<BatchNorm2d>(16),
      std::make_shared<ReLU>(), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(16 * 4 * 4, 3, true, seed + 1)});
  run.model->to(device);
  run.model->set_precision(precision);
  run.sgd = std::make_unique<SGD>(run.model->parameters(),
                                  SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4});
  return run;
}

// Step `step` of the run: its own batch (a function of the step alone, as a resumed loader's) and
// its own rate (a schedule's), forward, loss, backward, SGD.
inline void train_step(ResumeRun& run, int step, Device device) {
  const Tensor x =
      Tensor::from_vector(random_vector(8 * 8 * 8 * 8, 1000 + step), {8, 8, 8, 8}).to(device);
  std::vector<int32_t> y(8);
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>((i * 7 + step) % 3);
  const Tensor labels = Tensor::from_vector(y, {8}).to(device);
  run.sgd->set_lr(0.05 / (1.0 + 0.1 * step));
  run.model->train();
  CrossEntropyLoss loss;
  loss.forward(run.model->forward(x), labels);
  run.sgd->zero_grad();
  run.model->backward(loss.backward());
  run.sgd->step();
  run.losses.push_back(loss.item());
}

inline std::vector<float> as_floats(const Tensor& t) {
  const Tensor host = t.cpu();
  std::vector<float> out((host.nbytes() + 3) / 4, 0.0f);
  std::memcpy(out.data(), host.data_ptr(), host.nbytes());  // i64 counters compared as raw bits
  return out;
}

inline void expect_bitwise_same(const TensorMap& a, const TensorMap& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << what << ": " << name << " is missing";
    EXPECT_EQ(t.dtype(), b.at(name).dtype()) << what << ": " << name;
    EXPECT_TRUE(bitwise_equal(as_floats(t), as_floats(b.at(name)))) << what << ": " << name;
  }
}

inline std::vector<std::string> parameter_names(Module& model) {
  std::vector<std::string> out;
  for (const auto& [name, p] : model.named_parameters()) out.push_back(name);
  return out;
}

// K steps, save, resume into a fresh model (other initial weights), K steps ≡ 2K steps straight.
inline void expect_exact_resume(Device device, Precision precision, int k) {
  SCOPED_TRACE(::testing::Message() << "on " << device << " under " << precision_name(precision));
  ResumeRun straight = make_resume_run(7, device, precision);
  for (int step = 0; step < 2 * k; ++step) train_step(straight, step, device);

  TempDir dir;
  const std::string path = dir.file("run.safetensors");
  ResumeRun first = make_resume_run(7, device, precision);
  for (int step = 0; step < k; ++step) train_step(first, step, device);
  save_checkpoint(path, *first.model, first.sgd.get(), {{"step", std::to_string(k)}});

  ResumeRun resumed = make_resume_run(99, device, precision);  // overwritten by the load
  resumed.sgd->set_lr(1.0);
  EXPECT_EQ(load_checkpoint(path, *resumed.model, resumed.sgd.get()).at("step"), std::to_string(k));
  EXPECT_EQ(resumed.sgd->steps(), k);
  for (int step = k; step < 2 * k; ++step) train_step(resumed, step, device);

  EXPECT_EQ(resumed.sgd->steps(), 2 * k);
  expect_bitwise_same(resumed.model->state_dict(), straight.model->state_dict(), "the model");
  expect_bitwise_same(resumed.sgd->state_dict(parameter_names(*resumed.model)),
                      straight.sgd->state_dict(parameter_names(*straight.model)),
                      "the optimizer's state");
  const std::vector<float> last_k(straight.losses.begin() + k, straight.losses.end());
  EXPECT_TRUE(bitwise_equal(resumed.losses, last_k)) << "the losses of the last " << k << " steps";
}

// The same 2K steps under fp32 and under `precision` end with different weights: the policy
// reached the layers, so a resume under it checks that precision's arithmetic.
inline void expect_precision_changes_training(Device device, Precision precision, int k) {
  ResumeRun fp32 = make_resume_run(7, device, Precision::fp32);
  ResumeRun other = make_resume_run(7, device, precision);
  for (int step = 0; step < 2 * k; ++step) {
    train_step(fp32, step, device);
    train_step(other, step, device);
  }
  const std::vector<float> a = as_floats(fp32.model->state_dict().at("0.weight"));
  const std::vector<float> b = as_floats(other.model->state_dict().at("0.weight"));
  EXPECT_FALSE(bitwise_equal(a, b)) << precision_name(precision) << " trained as fp32 did";
}

// A staged checkpoint (stage_checkpoint: copies where the state lives, brought to the host later,
// on another thread) holds the moment it was staged: after K steps, staged, then one more step
// taken at once (on a GPU without waiting for the copies: the step's kernels queue behind them on
// the same stream), its host snapshot equals snapshot_checkpoint's of that moment bit for bit, and
// a writer saving it from its own thread writes that moment; first_non_finite finds a NaN or an
// infinity where one was planted.
inline void expect_staged_checkpoint_holds_its_moment(Device device, Precision precision, int k) {
  SCOPED_TRACE(::testing::Message() << "on " << device << " under " << precision_name(precision));
  ResumeRun run = make_resume_run(7, device, precision);
  for (int step = 0; step < k; ++step) train_step(run, step, device);
  const Metadata meta = {{"step", std::to_string(k)}};
  const CheckpointSnapshot then = snapshot_checkpoint(*run.model, run.sgd.get(), meta);
  StagedCheckpoint staged = stage_checkpoint(*run.model, run.sgd.get(), meta);
  StagedCheckpoint written = stage_checkpoint(*run.model, run.sgd.get(), meta);
  train_step(run, k, device);  // the live state moves on
  const CheckpointSnapshot later = staged.to_host();
  expect_bitwise_same(later.model, then.model, "the staged model");
  expect_bitwise_same(later.train, then.train, "the staged optimizer state");
  EXPECT_EQ(later.train_metadata, then.train_metadata);
  EXPECT_FALSE(bitwise_equal(as_floats(later.model.at("0.weight")),
                             as_floats(run.model->state_dict().at("0.weight"))))
      << "the step after staging changed nothing: the test would not see a copy that followed it";

  TempDir dir;
  CheckpointWriter writer;
  const std::string path = dir.file("staged.safetensors");
  writer.save({path}, std::move(written));
  writer.wait();
  ResumeRun loaded = make_resume_run(99, device, precision);
  EXPECT_EQ(load_checkpoint(path, *loaded.model, loaded.sgd.get()).at("step"), std::to_string(k));
  expect_bitwise_same(loaded.model->state_dict(), then.model, "the model written");
  expect_bitwise_same(loaded.sgd->state_dict(parameter_names(*loaded.model)), then.train,
                      "the optimizer state written");
  // A second save through the same writer (on a GPU, through the page-locked buffer the first
  // one left it): the second moment's values.
  train_step(run, k + 1, device);
  const CheckpointSnapshot second = snapshot_checkpoint(*run.model, run.sgd.get(), meta);
  EXPECT_FALSE(
      bitwise_equal(as_floats(second.model.at("0.weight")), as_floats(then.model.at("0.weight"))))
      << "the step changed nothing: a buffer holding the first save would go unseen";
  writer.save({path}, stage_checkpoint(*run.model, run.sgd.get(), meta));
  writer.wait();
  ResumeRun reloaded = make_resume_run(98, device, precision);
  load_checkpoint(path, *reloaded.model, reloaded.sgd.get());
  expect_bitwise_same(reloaded.model->state_dict(), second.model, "the second save's model");
  expect_bitwise_same(reloaded.sgd->state_dict(parameter_names(*reloaded.model)), second.train,
                      "the second save's optimizer state");

  // first_non_finite: "" for this model; with an infinity planted in Linear's weight and a NaN in
  // BatchNorm's running variance, the first of them in state_dict order.
  EXPECT_EQ(stage_checkpoint(*run.model, run.sgd.get()).first_non_finite(), "");
  const auto plant = [&](Tensor& t, float value) {
    std::vector<float> v = as_floats(t);
    v[v.size() / 2] = value;
    t.copy_from(Tensor::from_vector(v, t.shape()));
  };
  BatchNorm2d& bn = static_cast<BatchNorm2d&>(*(*run.model)[1]);
  Linear& fc = static_cast<Linear&>(*(*run.model)[5]);
  plant(fc.weight().data, std::numeric_limits<float>::infinity());
  EXPECT_EQ(stage_checkpoint(*run.model, run.sgd.get()).first_non_finite(), "5.weight");
  plant(bn.running_var(), std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(stage_checkpoint(*run.model, run.sgd.get()).first_non_finite(), "1.running_var");
}

}  // namespace cudp::testing
