// Host tests of checkpoints: the two-file layout, an exact resume of model and optimizer, and every
// way a pair of files can fail to fit.
#include "layers/checkpoint.h"

#include <sys/stat.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <vector>

#include "common/compare.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/temp_dir.h"
#include "tests/layers/resume_testing.h"

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

TensorMap clone_map(const TensorMap& m) {
  TensorMap out;
  for (const auto& [name, t] : m) out.emplace(name, t.clone());
  return out;
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

// A checkpoint read once loads as the trainer loads it, the model alone and then the model with its
// optimizer, without the files (removed here after the read): the state a load from the path
// gives, and the same refusals. The read itself refuses what a load refuses, in the same words.
TEST_F(Checkpoint, ACheckpointReadOnceLoadsTwiceWithoutTheFiles) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  const CheckpointContents contents = read_checkpoint(find_checkpoint(path_));
  std::filesystem::remove(path_);
  std::filesystem::remove(optimizer_state_path(path_));
  auto resumed = small_net(99);
  SGD resumed_sgd(resumed->parameters(), {.lr = 1.0, .momentum = 0.9, .weight_decay = 5e-4});
  EXPECT_EQ(load_checkpoint(contents, *resumed, nullptr), metadata_);
  expect_same_values(resumed->state_dict(), model_->state_dict());
  EXPECT_EQ(load_checkpoint(contents, *resumed, &resumed_sgd), metadata_);
  expect_same_values(resumed->state_dict(), model_->state_dict());
  expect_same_values(resumed_sgd.state_dict(), sgd_.state_dict());
  EXPECT_EQ(resumed_sgd.lr(), 0.05);
  EXPECT_EQ(resumed_sgd.steps(), 2);
  AdamW adamw(resumed->parameters(), {});
  try {
    load_checkpoint(contents, *resumed, &adamw);
    ADD_FAILURE() << "expected an IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("holds SGD state, but the optimizer is AdamW"),
              std::string::npos)
        << e.what();
  }

  save_checkpoint(path_, *model_, &sgd_, metadata_);
  TensorMap tensors = clone_map(load_safetensors(path_).tensors);
  tensors.at("0.weight").data<float>()[5] = std::numeric_limits<float>::quiet_NaN();
  save_safetensors(path_, tensors, load_safetensors_metadata(path_));  // the same id: still a pair
  try {
    read_checkpoint(find_checkpoint(path_));
    ADD_FAILURE() << "expected an IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint file '" + path_ +
                                         "': tensor '0.weight' holds NaN/Inf values (element 5 "
                                         "is NaN)"),
              std::string::npos)
        << e.what();
  }
}

// A save in two halves (snapshot now, write later, on another thread): the files hold the state of
// the snapshot's moment, not what the model and the optimizer became while they were written (on
// the CPU the tensors are the live storage, so the snapshot must copy them); a second save waits
// for the first, each leaving a complete checkpoint.
TEST_F(Checkpoint, AWriterSavesTheSnapshotsMomentWhileTrainingGoesOn) {
  const TensorMap model_then = clone_map(model_->state_dict());
  const TensorMap state_then = clone_map(sgd_.state_dict());
  // The snapshot alone, written after the step (deterministic: no thread).
  const CheckpointSnapshot then = snapshot_checkpoint(*model_, &sgd_, metadata_);
  CheckpointWriter writer;
  writer.save({dir_.file("best.safetensors")}, snapshot_checkpoint(*model_, &sgd_, metadata_));
  set_grads(*model_, 5);  // training goes on at once: the weights and momentum change
  sgd_.step();
  write_checkpoint(path_, then);
  const std::string later = dir_.file("later.safetensors");
  writer.save({later}, snapshot_checkpoint(*model_, &sgd_, metadata_));
  writer.wait();
  for (const std::string& path : {path_, dir_.file("best.safetensors")}) {
    auto loaded = small_net(99);
    SGD loaded_sgd(loaded->parameters(), {.lr = 1.0, .momentum = 0.9, .weight_decay = 5e-4});
    EXPECT_EQ(load_checkpoint(path, *loaded, &loaded_sgd), metadata_);
    expect_same_values(loaded->state_dict(), model_then);
    expect_same_values(loaded_sgd.state_dict(), state_then);
  }
  auto loaded = small_net(99);
  SGD loaded_sgd(loaded->parameters(), {.lr = 1.0, .momentum = 0.9, .weight_decay = 5e-4});
  load_checkpoint(later, *loaded, &loaded_sgd);
  expect_same_values(loaded->state_dict(), model_->state_dict());
  expect_same_values(loaded_sgd.state_dict(), sgd_.state_dict());
}

// The inode of `path` (0 when it cannot be read).
ino_t inode(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

// Whether `path`'s model file and training state are the same inodes as `other`'s.
bool shares_files(const std::string& path, const std::string& other) {
  return inode(path) != 0 && inode(path) == inode(other) &&
         inode(optimizer_state_path(path)) == inode(optimizer_state_path(other));
}

// Files a save leaves only while it runs: temporaries (".tmp-") and replaced files set aside
// (".old-").
int leftovers(const TempDir& dir) {
  int n = 0;
  for (const std::string& name : dir.entries()) {
    n += name.find(".tmp-") != std::string::npos || name.find(".old-") != std::string::npos;
  }
  return n;
}

// Loads `path` into a fresh model and optimizer and checks it holds `model` and `state`.
void expect_checkpoint_holds(const std::string& path, const TensorMap& model,
                             const TensorMap& state) {
  SCOPED_TRACE(path);
  auto loaded = small_net(99);
  SGD loaded_sgd(loaded->parameters(), {.lr = 1.0, .momentum = 0.9, .weight_decay = 5e-4});
  load_checkpoint(path, *loaded, &loaded_sgd);
  expect_same_values(loaded->state_dict(), model);
  expect_same_values(loaded_sgd.state_dict(), state);
}

// One save to two paths writes the files once: the second path's are hard links to the first's
// (same inodes on one file system), both load the saved state bit for bit, and the next save moves
// each path's pair to its own .prev names, where the previous save stays loadable. The same through
// a CheckpointWriter. Nothing set aside or temporary outlives a save.
TEST_F(Checkpoint, ASaveToSeveralPathsLinksTheSecondToTheFirst) {
  for (const bool writer : {false, true}) {
    SCOPED_TRACE(writer ? "CheckpointWriter" : "write_checkpoints");
    TempDir dir;
    const std::string a = dir.file("last.safetensors"), b = dir.file("best.safetensors");
    const auto save = [&](const std::vector<std::string>& paths) {
      if (!writer) return write_checkpoints(paths, snapshot_checkpoint(*model_, &sgd_, metadata_));
      CheckpointWriter w;
      w.save(paths, snapshot_checkpoint(*model_, &sgd_, metadata_));
      w.wait();
    };
    std::vector<TensorMap> models, states;  // the state each save holds
    for (int i = 0; i < 4; ++i) {
      set_grads(*model_, 10 + i);
      sgd_.step();
      models.push_back(clone_map(model_->state_dict()));
      states.push_back(clone_map(sgd_.state_dict()));
      save({a, b});
      EXPECT_TRUE(shares_files(a, b));
      struct stat st {};
      ASSERT_EQ(::stat(b.c_str(), &st), 0);
      EXPECT_EQ(st.st_nlink, 2u);  // a and b; the .prev pairs hold the previous save's inodes
      EXPECT_EQ(leftovers(dir), 0) << ::testing::PrintToString(dir.entries());
      for (const std::string& path : {a, b}) {
        EXPECT_FALSE(find_checkpoint(path).fallback);
        expect_checkpoint_holds(path, models[i], states[i]);
        if (i > 0) {
          expect_checkpoint_holds(previous_checkpoint_path(path), models[i - 1], states[i - 1]);
        }
      }
      if (i > 0) {
        EXPECT_TRUE(shares_files(previous_checkpoint_path(a), previous_checkpoint_path(b)));
      }
    }
    EXPECT_EQ(dir.entries().size(), 8u) << ::testing::PrintToString(dir.entries());
    // A save to the first path alone replaces its pair and leaves the second's as it was.
    set_grads(*model_, 20);
    sgd_.step();
    save({a});
    EXPECT_FALSE(shares_files(a, b));
    expect_checkpoint_holds(b, models[3], states[3]);
    expect_checkpoint_holds(previous_checkpoint_path(a), models[3], states[3]);
    EXPECT_EQ(leftovers(dir), 0) << ::testing::PrintToString(dir.entries());
  }
}

// The file fault hook's (engine/core/file.h) target: every "link" whose new name contains
// g_link_fails_for fails with g_link_error.
std::string g_link_fails_for;
int g_link_error = 0;

int fail_links(const char* operation, const std::string& path) {
  return std::strcmp(operation, "link") == 0 && path.find(g_link_fails_for) != std::string::npos
             ? g_link_error
             : 0;
}

// Where a path's file system cannot link to the first path's files (another file system: EXDEV;
// none that links: EPERM, EOPNOTSUPP), that path is written in full instead, and a later path links
// to the first; where linking fails otherwise (EIO), the save throws an IoError, the path keeps its
// last complete checkpoint, and no temporary remains.
TEST_F(Checkpoint, APathThatCannotLinkIsWrittenInFull) {
  const std::string a = dir_.file("a.safetensors"), b = dir_.file("b.safetensors"),
                    c = dir_.file("c.safetensors");
  for (const int error : {EXDEV, EPERM, EOPNOTSUPP, EMLINK}) {
    SCOPED_TRACE(std::strerror(error));
    // The first link fails, or the second.
    for (const std::string failing : {"b.safetensors", "b.train"}) {
      g_link_fails_for = failing;
      g_link_error = error;
      detail::set_file_fault_hook(fail_links);
      set_grads(*model_, 3);
      sgd_.step();
      write_checkpoints({a, b, c}, snapshot_checkpoint(*model_, &sgd_, metadata_));
      detail::set_file_fault_hook(nullptr);
      EXPECT_FALSE(shares_files(a, b));
      EXPECT_NE(inode(a), inode(b));
      EXPECT_NE(inode(optimizer_state_path(a)), inode(optimizer_state_path(b)));
      EXPECT_TRUE(shares_files(a, c));
      for (const std::string& path : {a, b, c}) {
        expect_checkpoint_holds(path, model_->state_dict(), sgd_.state_dict());
      }
      EXPECT_EQ(leftovers(dir_), 0) << ::testing::PrintToString(dir_.entries());
    }
  }
  const TensorMap model_then = clone_map(model_->state_dict());
  const TensorMap state_then = clone_map(sgd_.state_dict());
  g_link_fails_for = "b.";
  g_link_error = EIO;
  detail::set_file_fault_hook(fail_links);
  set_grads(*model_, 4);
  sgd_.step();
  try {
    write_checkpoints({a, b, c}, snapshot_checkpoint(*model_, &sgd_, metadata_));
    ADD_FAILURE() << "a failing link went unnoticed";
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot link"), std::string::npos) << what;
    EXPECT_NE(what.find(std::strerror(EIO)), std::string::npos) << what;
  }
  detail::set_file_fault_hook(nullptr);
  expect_checkpoint_holds(a, model_->state_dict(), sgd_.state_dict());  // saved before the failure
  expect_checkpoint_holds(b, model_then, state_then);                   // as it was
  expect_checkpoint_holds(c, model_then, state_then);                   // not reached
  EXPECT_EQ(leftovers(dir_), 0) << ::testing::PrintToString(dir_.entries());
}

// The snapshot in two halves on the CPU path (the GPU's twin is in checkpoint_gpu_test).
TEST(CheckpointStaged, AStagedCheckpointHoldsItsMoment) {
  testing::expect_staged_checkpoint_holds_its_moment(Device::cpu(), Precision::fp32, 2);
  testing::expect_staged_checkpoint_holds_its_moment(Device::cpu(), Precision::bf16, 2);
}

// A save that fails on the writer's thread (here: its directory does not exist) is not lost: the
// next save() or wait() throws its error, once.
TEST_F(Checkpoint, AWritersFailedSaveIsRethrownOnce) {
  CheckpointWriter writer;
  const std::string nowhere = dir_.file("missing/ckpt.safetensors");
  writer.save({nowhere}, snapshot_checkpoint(*model_, &sgd_, metadata_));
  EXPECT_THROW(writer.wait(), IoError);
  EXPECT_NO_THROW(writer.wait());
  writer.save({nowhere}, snapshot_checkpoint(*model_, &sgd_, metadata_));
  EXPECT_THROW(writer.save({path_}, snapshot_checkpoint(*model_, &sgd_, metadata_)), IoError);
  writer.save({path_}, snapshot_checkpoint(*model_, &sgd_, metadata_));
  writer.wait();
  auto loaded = small_net(99);
  load_checkpoint(path_, *loaded);
  expect_same_values(loaded->state_dict(), model_->state_dict());
}

// Real training steps (forward, loss, backward, SGD) resumed from a checkpoint: K + K steps are the
// 2K straight bit for bit, under fp32, bf16 and tf32, whose operand rounding the CPU path emulates
// (tests/layers/resume_testing.h). The GPU twin is in checkpoint_gpu_test.
TEST(CheckpointResume, Fp32TrainingResumesBitExactlyOnTheCpu) {
  testing::expect_exact_resume(Device::cpu(), Precision::fp32, 3);
}

TEST(CheckpointResume, Bf16TrainingResumesBitExactlyOnTheCpu) {
  testing::expect_precision_changes_training(Device::cpu(), Precision::bf16, 3);
  testing::expect_exact_resume(Device::cpu(), Precision::bf16, 3);
}

TEST(CheckpointResume, Tf32TrainingResumesBitExactlyOnTheCpu) {
  testing::expect_precision_changes_training(Device::cpu(), Precision::tf32, 3);
  testing::expect_exact_resume(Device::cpu(), Precision::tf32, 3);
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

TEST_F(Checkpoint, ATornPairFallsBackToThePreviousSave) {
  save_checkpoint(path_, *model_, &sgd_, {{"step", "1"}});
  const std::string train = optimizer_state_path(path_), old = dir_.file("old.train");
  std::filesystem::copy_file(train, old);
  save_checkpoint(path_, *model_, &sgd_, {{"step", "2"}});
  EXPECT_EQ(dir_.entries(),
            (std::vector<std::string>{"ckpt.prev.safetensors", "ckpt.prev.train.safetensors",
                                      "ckpt.safetensors", "ckpt.train.safetensors", "old.train"}));
  EXPECT_EQ(load_checkpoint(path_, *model_, &sgd_).at("step"), "2");
  // As if a save had died between its two renames: new model, another save's training state.
  std::filesystem::rename(old, train);
  const CheckpointFiles files = find_checkpoint(path_);
  EXPECT_TRUE(files.fallback);
  EXPECT_EQ(files.model, previous_checkpoint_path(path_));
  EXPECT_EQ(files.train, optimizer_state_path(previous_checkpoint_path(path_)));
  EXPECT_NE(files.note.find("do not belong to the same save"), std::string::npos) << files.note;
  static std::string warned;
  detail::set_checkpoint_warning_handler([](const std::string& m) { warned = m; });
  EXPECT_EQ(load_checkpoint(path_, *model_, &sgd_).at("step"), "1");
  detail::set_checkpoint_warning_handler(nullptr);
  EXPECT_EQ(warned, files.note);  // the load says which save it used and why
  EXPECT_EQ(load_checkpoint_metadata(path_).at("step"), "1");

  // The next save replaces the torn pair and keeps the complete one as the previous save.
  save_checkpoint(path_, *model_, &sgd_, {{"step", "3"}});
  EXPECT_FALSE(find_checkpoint(path_).fallback);
  EXPECT_EQ(load_checkpoint(path_, *model_, &sgd_).at("step"), "3");
  EXPECT_EQ(load_checkpoint(previous_checkpoint_path(path_), *model_, &sgd_).at("step"), "1");
}

TEST_F(Checkpoint, RefusesATornPairWithNoEarlierSave) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  const std::string train = optimizer_state_path(path_), old = dir_.file("old.train");
  std::filesystem::copy_file(train, old);
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  std::filesystem::rename(old, train);
  std::filesystem::remove(previous_checkpoint_path(path_));
  expect_load_error<IoError>(path_, *model_, &sgd_, "do not belong to the same save");
  expect_load_error<IoError>(path_, *model_, &sgd_, "no complete earlier save");
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

TEST_F(Checkpoint, ModelErrorsNameTheFile) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  auto other = std::make_shared<Sequential>(
      std::vector<std::shared_ptr<Module>>{std::make_shared<Linear>(2, 2, true, 1)});
  expect_load_error<ValueError>(path_, *other, nullptr, "checkpoint file '" + path_ + "'");
  try {
    load_weights(path_, *other);
    ADD_FAILURE() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'" + path_ + "'"), std::string::npos) << e.what();
  }
}

// A model file holding a NaN or an infinity (the save of a run that had diverged) is refused as it
// is read, naming the file, the tensor and the element, and nothing of it is loaded: a parameter,
// a buffer, by load_checkpoint and by load_weights.
TEST_F(Checkpoint, NonFiniteWeightsAreRefusedNamingTheTensor) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  const SafetensorsFile good = load_safetensors(path_);
  const auto save_with = [&](const std::string& name, int64_t element, float value) {
    TensorMap tensors = clone_map(good.tensors);
    tensors.at(name).data<float>()[element] = value;
    save_safetensors(path_, tensors, good.metadata);  // the same id: still a pair
  };
  auto other = small_net(99);
  const TensorMap before = clone_map(other->state_dict());
  save_with("0.weight", 5, std::numeric_limits<float>::quiet_NaN());
  expect_load_error<IoError>(path_, *other, nullptr,
                             "checkpoint file '" + path_ +
                                 "': tensor '0.weight' holds NaN/Inf values (element 5 is NaN); "
                                 "the run that saved it had diverged: resume from or evaluate an "
                                 "earlier checkpoint");
  save_with("1.running_var", 2, -std::numeric_limits<float>::infinity());
  expect_load_error<IoError>(path_, *other, nullptr,
                             "tensor '1.running_var' holds NaN/Inf values (element 2 is -inf)");
  save_with("5.bias", 0, std::numeric_limits<float>::max());  // finite: loads
  load_checkpoint(path_, *other, nullptr);
  other = small_net(99);

  const std::string weights = dir_.file("w.safetensors");
  TensorMap tensors = clone_map(good.tensors);
  tensors.at("5.weight").data<float>()[7] = std::numeric_limits<float>::infinity();
  save_safetensors(weights, tensors, {{"format", "pt"}});
  try {
    load_weights(weights, *other);
    ADD_FAILURE() << "expected an IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint file '" + weights +
                                         "': tensor '5.weight' holds NaN/Inf values (element 7 "
                                         "is inf)"),
              std::string::npos)
        << e.what();
  }
  expect_same_values(other->state_dict(), before);
}

// Half-precision state (a module of one's own may hold it) is checked as f32 is: by its exponent
// bits, the largest finite values passing.
class HalfBuffers : public Module {
 public:
  HalfBuffers() {
    register_buffer("b", Tensor::zeros({4}, DType::bf16));
    register_buffer("h", Tensor::zeros({4}, DType::f16));
  }
  std::string type_name() const override { return "HalfBuffers"; }

 protected:
  Tensor forward_one(const Tensor& x) override { return x; }
  std::shared_ptr<Module> make_empty_copy() const override {
    return std::make_shared<HalfBuffers>();
  }
};

TEST(CheckpointPaths, NonFiniteHalfPrecisionStateIsRefused) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  HalfBuffers model;
  TensorMap state = clone_map(model.state_dict());
  const auto set = [&](const char* name, std::vector<uint16_t> bits) {
    std::memcpy(state.at(name).data_ptr(), bits.data(), bits.size() * sizeof(uint16_t));
    save_safetensors(path, state, {{"format", "pt"}});
  };
  const auto refused = [&](const std::string& part) {
    try {
      load_weights(path, model);
      ADD_FAILURE() << "expected an error containing " << part;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  // The largest finite values of each sign, the smallest subnormal and zero: finite, loaded.
  set("b", {0x7f7f, 0xff7f, 0x0001, 0x0000});
  set("h", {0x7bff, 0xfbff, 0x0001, 0x0000});
  load_weights(path, model);
  set("b", {0x7f7f, 0xff80, 0x0000, 0x0000});
  refused("tensor 'b' holds NaN/Inf values (element 1 is -inf)");
  set("b", {0x0000, 0x0000, 0x7f81, 0x0000});
  refused("tensor 'b' holds NaN/Inf values (element 2 is NaN)");
  set("b", {0x0000, 0x0000, 0x0000, 0x0000});
  set("h", {0x0000, 0x0000, 0x0000, 0x7c00});
  refused("tensor 'h' holds NaN/Inf values (element 3 is inf)");
  set("h", {0x0000, 0xfe00, 0x0000, 0x0000});
  refused("tensor 'h' holds NaN/Inf values (element 1 is NaN)");
}

TEST_F(Checkpoint, ATornPairWithOnlyOneSaveBeforeItLoadsThatSave) {
  // Killed in the middle of step 2 (training state moved, model not yet): the model at `path` and
  // the training state at the .prev name are the last complete save.
  save_checkpoint(path_, *model_, &sgd_, {{"step", "1"}});
  std::filesystem::rename(optimizer_state_path(path_),
                          optimizer_state_path(previous_checkpoint_path(path_)));
  const CheckpointFiles files = find_checkpoint(path_);
  EXPECT_TRUE(files.fallback);
  EXPECT_EQ(files.model, path_);
  EXPECT_EQ(load_checkpoint(path_, *model_, &sgd_).at("step"), "1");
  save_checkpoint(path_, *model_, &sgd_, {{"step", "2"}});  // and a save after it repairs the pair
  EXPECT_FALSE(find_checkpoint(path_).fallback);
  EXPECT_EQ(load_checkpoint(previous_checkpoint_path(path_), *model_, &sgd_).at("step"), "1");
}

// find_checkpoint's error, which must be an IoError.
std::string find_error(const std::string& path) {
  try {
    find_checkpoint(path);
  } catch (const IoError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an IoError for " << path;
  return {};
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// `bytes` at the end of `path`.
void append(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::app) << bytes;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A header length (8 bytes, little-endian) and then `header`.
std::string with_length(const std::string& header) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header;
}

// QA: every bad checkpoint was reported as an interrupted save, a path that does not exist with 700
// characters about an incomplete save and the files of an earlier one.
TEST_F(Checkpoint, APathWithNoCheckpointSaysItDoesNotExist) {
  const std::string nothing = dir_.file("nothing.safetensors");
  std::string e = find_error(nothing);
  EXPECT_TRUE(has(e, "checkpoint '" + nothing + "' does not exist")) << e;
  EXPECT_FALSE(has(e, "interrupted")) << e;
  EXPECT_FALSE(has(e, "incomplete")) << e;
  EXPECT_LT(e.size(), 200u) << e;
  // cudp-vgg --resume FOLDER reads FOLDER/last.safetensors: an empty folder has none.
  std::filesystem::create_directory(dir_.file("run"));
  const std::string last = dir_.file("run/last.safetensors");
  e = find_error(last);
  EXPECT_TRUE(has(e, "checkpoint '" + last + "' does not exist")) << e;
  EXPECT_FALSE(has(e, "interrupted")) << e;
  // The folder itself, given as a checkpoint: a directory, not a safetensors file.
  e = find_error(dir_.file("run"));
  EXPECT_TRUE(has(e, "'" + dir_.file("run") + "' is a directory, not a safetensors file")) << e;
  EXPECT_FALSE(has(e, "interrupted")) << e;
  // The same through load_checkpoint and load_checkpoint_metadata.
  expect_load_error<IoError>(nothing, *model_, &sgd_, "' does not exist");
  try {
    load_checkpoint_metadata(nothing);
    ADD_FAILURE() << "expected IoError";
  } catch (const IoError& error) {
    EXPECT_TRUE(has(error.what(), "does not exist")) << error.what();
  }
}

TEST_F(Checkpoint, AFileThatIsNotSafetensorsSaysSo) {
  const std::string train = optimizer_state_path(path_);
  const auto expect_not_safetensors = [&](const std::string& bad_file, const std::string& detail) {
    const std::string e = find_error(path_);
    EXPECT_TRUE(has(e, "'" + bad_file + "' is not a safetensors file")) << e;
    EXPECT_FALSE(has(e, "(not a safetensors file")) << "said twice: " << e;
    EXPECT_TRUE(has(e, detail)) << e;
    EXPECT_FALSE(has(e, "interrupted")) << e;
    EXPECT_FALSE(has(e, "runs past the end")) << e;
  };
  // Text: its first 8 bytes make an absurd header length (7022349239403356795 for "this is ").
  write_file(path_, "this is not a safetensors file");
  expect_not_safetensors(path_, "");
  write_file(train, "this is not a safetensors file");
  expect_not_safetensors(path_, "");
  std::filesystem::remove(train);
  // A plausible length, but the header is not JSON, not a JSON object, or the file too short.
  write_file(path_, with_length("hello, world"));
  expect_not_safetensors(path_, "");
  write_file(path_, with_length("{\"a\": ") + "xx");
  expect_not_safetensors(path_, "JSON");
  write_file(path_, with_length("[1, 2]"));
  expect_not_safetensors(path_, "");
  write_file(path_, "abc");
  expect_not_safetensors(path_, "3 bytes");
  write_file(path_, "");
  expect_not_safetensors(path_, "0 bytes");

  // A good model file and a training-state file that is not safetensors.
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  write_file(train, "PK\x03\x04 a zip file, say");
  expect_not_safetensors(train, "");
  // With a complete save at the .prev names, that one is used, and the note says what was wrong.
  std::filesystem::remove(train);
  save_checkpoint(path_, *model_, &sgd_, {{"step", "8"}});
  save_checkpoint(path_, *model_, &sgd_, {{"step", "9"}});
  write_file(path_, "this is not a safetensors file");
  const CheckpointFiles files = find_checkpoint(path_);
  EXPECT_TRUE(files.fallback);
  EXPECT_EQ(files.model, previous_checkpoint_path(path_));
  EXPECT_TRUE(has(files.note, "'" + path_ + "' is not a safetensors file")) << files.note;
  EXPECT_FALSE(has(files.note, "interrupted")) << files.note;
}

// A file cut short whose header is whole (or whose header length is plausible and what is there of
// the header begins as one): what a save that died while writing in place would leave.
TEST_F(Checkpoint, AFileCutShortIsCalledAnInterruptedSave) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  const uint64_t size = std::filesystem::file_size(path_);
  std::filesystem::resize_file(path_, size - 10);
  std::string e = find_error(path_);
  EXPECT_TRUE(has(e, "checkpoint '" + path_ + "' is incomplete")) << e;
  EXPECT_TRUE(has(e, "'" + path_ + "' is cut short")) << e;
  EXPECT_TRUE(has(e, "(was a save interrupted?)")) << e;
  EXPECT_FALSE(has(e, "not a safetensors file")) << e;
  std::filesystem::resize_file(path_, 20);  // inside the header
  e = find_error(path_);
  EXPECT_TRUE(has(e, "'" + path_ + "' is cut short")) << e;
  EXPECT_TRUE(has(e, "(was a save interrupted?)")) << e;
  // A pair whose training-state file is missing.
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  std::filesystem::remove(previous_checkpoint_path(path_));
  std::filesystem::remove(optimizer_state_path(previous_checkpoint_path(path_)));
  std::filesystem::remove(optimizer_state_path(path_));
  e = find_error(path_);
  EXPECT_TRUE(has(e, "is incomplete")) << e;
  EXPECT_TRUE(has(e, "'" + optimizer_state_path(path_) + "' does not exist")) << e;
  EXPECT_TRUE(has(e, "(was a save interrupted?)")) << e;
  EXPECT_TRUE(has(e, "no complete earlier save")) << e;
}

// Bytes added after the last tensor: the file was changed, not cut short by a save.
TEST_F(Checkpoint, TrailingDataIsNotCalledAnInterruptedSave) {
  save_checkpoint(path_, *model_, &sgd_, metadata_);
  append(path_, std::string(1000, 'x'));
  const std::string e = find_error(path_);
  EXPECT_TRUE(has(e, "1000 bytes of trailing data")) << e;
  EXPECT_TRUE(has(e, "checkpoint '" + path_ + "' cannot be loaded")) << e;
  EXPECT_FALSE(has(e, "interrupted")) << e;
  EXPECT_FALSE(has(e, "incomplete")) << e;
}

TEST(CheckpointMetadata, ValidatedGettersNameTheKeyAndTheFile) {
  const Metadata m = {{"epoch", "3"},       {"seed", "18446744073709551615"}, {"lr", "0.05"},
                      {"bad", "12abc"},     {"big", "99999999999999999999"},  {"nan", "nan"},
                      {"data", "cifar10"},  {"empty", ""}};
  EXPECT_EQ(metadata_int(m, "epoch", 0, 1000, "c.safetensors"), 3);
  EXPECT_EQ(metadata_uint(m, "seed", "c.safetensors"), UINT64_MAX);
  EXPECT_EQ(metadata_double(m, "lr", 0, 10, "c.safetensors"), 0.05);
  EXPECT_EQ(metadata_choice(m, "data", {"mnist", "cifar10"}, "c.safetensors"), "cifar10");
  const auto fails = [](auto&& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "expected IoError containing " << part;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("'c.safetensors'"), std::string::npos) << e.what();
    }
  };
  fails([&] { metadata_int(m, "bad", 0, 100, "c.safetensors"); }, "\"bad\" is '12abc'");
  fails([&] { metadata_int(m, "big", 0, INT64_MAX, "c.safetensors"); }, "not an integer in");
  fails([&] { metadata_int(m, "epoch", 4, 10, "c.safetensors"); }, "in [4, 10]");
  fails([&] { metadata_int(m, "absent", 0, 1, "c.safetensors"); }, "\"absent\" is missing");
  fails([&] { metadata_int(m, "empty", 0, 1, "c.safetensors"); }, "\"empty\" is ''");
  fails([&] { metadata_uint(m, "bad", "c.safetensors"); }, "not an integer");
  fails([&] { metadata_double(m, "nan", -1, 1, "c.safetensors"); }, "a finite number");
  fails([&] { metadata_double(m, "lr", 1, 2, "c.safetensors"); }, "in [1, 2]");
  fails([&] { metadata_choice(m, "data", {"mnist"}, "c.safetensors"); }, "one of 'mnist'");
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
