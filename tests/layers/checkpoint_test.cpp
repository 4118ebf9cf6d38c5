// Host tests of checkpoints: the two-file layout, an exact resume of model and optimizer, and every
// way a pair of files can fail to fit.
#include "layers/checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "common/compare.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/temp_dir.h"

namespace cudp {
namespace {

using testing::random_vector;
using testing::TempDir;

// Conv (OIHW on disk), BatchNorm (buffers, an i64 counter), Linear: every kind of state.
std::shared_ptr<Sequential> small_net(uint64_t seed) {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 4, 3, 1, 1, true, seed), std::make_shared<BatchNorm2d>(4),
      std::make_shared<ReLU>(), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(4 * 2 * 2, 3, true, seed + 1)});
}

void set_grads(Module& model, int t) {
  int k = 0;
  for (Parameter* p : model.parameters()) {
    p->grad.copy_from(
        Tensor::from_vector(random_vector(p->grad.numel(), 100 * t + k++), p->grad.shape()));
  }
}

std::vector<std::string> keys(const TensorMap& m) {
  std::vector<std::string> out;
  for (const auto& [key, t] : m) out.push_back(key);
  return out;
}

void expect_same_values(const TensorMap& a, const TensorMap& b) {
  ASSERT_EQ(keys(a), keys(b));
  for (const auto& [name, t] : a) {
    const Tensor& u = b.at(name);
    ASSERT_EQ(t.nbytes(), u.nbytes()) << name;
    EXPECT_EQ(0, std::memcmp(t.data_ptr(), u.data_ptr(), t.nbytes())) << name;
  }
}

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int t = 0; t < 2; ++t) {
      set_grads(*model_, t);
      sgd_.step();
    }
  }

  TempDir dir_;
  const std::string path_ = dir_.file("ckpt.safetensors");
  std::shared_ptr<Sequential> model_ = small_net(7);
  SGD sgd_{model_->parameters(), {.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4}};
  const Metadata metadata_ = {
      {"step", "2"}, {"epoch", "0"}, {"seed", "42"}, {"data_position", "128"}};
};

TEST_F(Checkpoint, WritesAPyTorchModelFileAndATrainingStateFile) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  EXPECT_EQ(dir_.entries(),
            (std::vector<std::string>{"ckpt.safetensors", "ckpt.train.safetensors"}));

  // The model file is exactly the state_dict: a strict torchvision load accepts it.
  const SafetensorsFile model_file = load_safetensors(path_);
  expect_same_values(model_file.tensors, model_->state_dict());
  EXPECT_EQ(model_file.tensors.at("0.weight").shape(), (Shape{4, 1, 3, 3}));  // OIHW
  EXPECT_EQ(model_file.tensors.at("1.num_batches_tracked").dtype(), DType::i64);
  EXPECT_EQ(model_file.metadata.at("format"), "pt");

  const SafetensorsFile train_file = load_safetensors(optimizer_state_path(path_));
  EXPECT_EQ(keys(train_file.tensors),
            (std::vector<std::string>{"0.bias.momentum_buffer", "0.weight.momentum_buffer",
                                      "1.bias.momentum_buffer", "1.weight.momentum_buffer",
                                      "5.bias.momentum_buffer", "5.weight.momentum_buffer"}));
  EXPECT_EQ(train_file.metadata.at("optimizer.type"), "SGD");
  EXPECT_EQ(train_file.metadata.at("optimizer.steps"), "2");
  EXPECT_EQ(train_file.metadata.at("data_position"), "128");
  EXPECT_EQ(train_file.metadata.at("cudp.checkpoint_id"),
            model_file.metadata.at("cudp.checkpoint_id"));
}

TEST_F(Checkpoint, ResumesExactly) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  auto resumed = small_net(99);  // other weights, overwritten by the load
  SGD resumed_sgd(resumed->parameters(), {.lr = 1.0, .momentum = 0.9, .weight_decay = 5e-4});
  EXPECT_EQ(load_checkpoint(path_, *resumed, &resumed_sgd), metadata_);
  EXPECT_EQ(resumed_sgd.lr(), 0.05);
  EXPECT_EQ(resumed_sgd.steps(), 2);
  expect_same_values(resumed->state_dict(), model_->state_dict());

  // The next step is bit-identical: momentum buffers and their history flags came back.
  set_grads(*model_, 2);
  set_grads(*resumed, 2);
  sgd_.step();
  resumed_sgd.step();
  expect_same_values(resumed->state_dict(), model_->state_dict());
}

TEST_F(Checkpoint, ResumesAdamWAndTheModelAlone) {
  AdamW adamw(model_->parameters(), {.lr = 1e-3});
  set_grads(*model_, 5);
  adamw.step();
  save_checkpoint(path_, *model_, &adamw, {});
  auto resumed = small_net(3);
  AdamW resumed_adamw(resumed->parameters(), {.lr = 1e-3});
  EXPECT_TRUE(load_checkpoint(path_, *resumed, &resumed_adamw).empty());
  expect_same_values(resumed_adamw.state_dict(), adamw.state_dict());

  auto model_only = small_net(4);
  load_checkpoint(path_, *model_only);  // no optimizer: the model alone
  expect_same_values(model_only->state_dict(), model_->state_dict());
}

// load_checkpoint throws E whose message contains `part`.
template <typename E>
void expect_load_error(const std::string& path, Module& model, Optimizer* optimizer,
                       const std::string& part) {
  try {
    load_checkpoint(path, model, optimizer);
    ADD_FAILURE() << "expected an error containing " << part;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST_F(Checkpoint, RefusesFilesFromDifferentSaves) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  const std::string train = optimizer_state_path(path_), old = dir_.file("old.train");
  std::filesystem::copy_file(train, old);
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  // As if the second save had died between its two renames: new model, old training state.
  std::filesystem::rename(old, train);
  expect_load_error<IoError>(path_, *model_, &sgd_, "do not belong to the same save");
}

TEST_F(Checkpoint, RefusesAnotherOptimizerOrNone) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  AdamW adamw(model_->parameters(), {});
  expect_load_error<IoError>(path_, *model_, &adamw, "holds SGD state, but the optimizer is AdamW");
  save_checkpoint(path_, *model_, nullptr, metadata_);
  expect_load_error<IoError>(path_, *model_, &sgd_, "holds no optimizer state");
}

TEST_F(Checkpoint, ErrorsNameTheTensor) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  // Another architecture: Module::load_state_dict names the key.
  auto other = std::make_shared<Sequential>(
      std::vector<std::shared_ptr<Module>>{std::make_shared<Conv2d>(1, 5, 3, 1, 1, true, 1)});
  expect_load_error<ValueError>(path_, *other, nullptr, "'0.weight'");

  // A damaged optimizer tensor: the error names it by its parameter.
  const std::string train = optimizer_state_path(path_);
  SafetensorsFile file = load_safetensors(train);
  file.tensors["5.bias.momentum_buffer"] = Tensor::zeros({4});
  save_safetensors(train, file.tensors, file.metadata);
  expect_load_error<ValueError>(
      path_, *model_, &sgd_,
      "key '5.bias.momentum_buffer' has shape [4] but its parameter has shape [3]");
  file.tensors["5.bias.momentum_buffer"] = Tensor::zeros({3});
  file.tensors["5.bogus.momentum_buffer"] = Tensor::zeros({4});
  save_safetensors(train, file.tensors, file.metadata);
  expect_load_error<ValueError>(path_, *model_, &sgd_,
                                "'5.bogus.momentum_buffer' does not name a parameter");
}

TEST_F(Checkpoint, RejectsReservedMetadataAndForeignParameters) {
  EXPECT_THROW(save_checkpoint(path_, *model_, &sgd_, {{"optimizer.lr", "1"}}), ValueError);
  EXPECT_THROW(save_checkpoint(path_, *model_, &sgd_, {{"cudp.x", "1"}}), ValueError);
  Parameter stranger{Tensor::zeros({1}), Tensor::zeros({1})};
  SGD foreign({&stranger}, {});
  EXPECT_THROW(save_checkpoint(path_, *model_, &foreign), ValueError);
  EXPECT_TRUE(dir_.entries().empty());
}

TEST_F(Checkpoint, MissingTrainingStateIsAnIoError) {
  save_weights(path_, *model_);
  expect_load_error<IoError>(path_, *model_, nullptr, "ckpt.train.safetensors");
}

TEST(CheckpointPaths, WeightsAloneRoundTrip) {
  TempDir dir;
  auto model = small_net(1), copy = small_net(2);
  save_weights(dir.file("w.safetensors"), *model, {{"note", "x"}});
  load_weights(dir.file("w.safetensors"), *copy);
  expect_same_values(copy->state_dict(), model->state_dict());
  EXPECT_EQ(load_safetensors(dir.file("w.safetensors")).metadata.at("format"), "pt");
}

TEST(CheckpointPaths, TrainingStatePathSitsBesideTheModel) {
  EXPECT_EQ(optimizer_state_path("runs/vgg.safetensors"), "runs/vgg.train.safetensors");
  EXPECT_EQ(optimizer_state_path("runs/vgg.ckpt"), "runs/vgg.ckpt.train.safetensors");
}

}  // namespace
}  // namespace cudp
