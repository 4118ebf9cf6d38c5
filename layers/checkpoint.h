// Checkpoints: a model, its optimizer and the training position, in safetensors files that PyTorch
// reads (docs/architecture.md §5).
//
// A checkpoint at `path` is two files:
//
//   <path>                     the model file: exactly model.state_dict() (PyTorch's names and
//                              layouts, buffers included) and nothing else, so that
//                                m = torchvision.models.vgg16()
//                                m.load_state_dict(safetensors.torch.load_file(path), strict=True)
//                              works for a VGG-16 with torchvision's head (vgg16_bn() for one
//                              with BatchNorm); cudp-vgg's compact head at 32x32 (layers/vgg.h)
//                              is not torchvision's, so its files load only into the same layout.
//                              Its __metadata__ (which load_file ignores) holds
//                              "format": "pt" and "cudp.checkpoint_id".
//   <stem>.train.safetensors   the training state (optimizer_state_path(path); <stem> is `path`
//                              without a ".safetensors" suffix): the optimizer's tensors named
//                              "<parameter name>.<state>" ("features.0.weight.momentum_buffer",
//                              "classifier.6.bias.exp_avg", "...step"), and in __metadata__ the
//                              caller's metadata (step, epoch, seed, RNG offset, data position:
//                              any string pairs), the optimizer's type and hyperparameters under
//                              "optimizer.*" ("optimizer.type", "optimizer.lr", "optimizer.steps",
//                              ...) and the same "cudp.checkpoint_id".
//
// The model file cannot hold the optimizer state: a strict torchvision load rejects extra keys. The
// training-state file is always written (the caller's metadata lives there), with no optimizer
// entries when no optimizer is given.
//
// Crash safety (why the save is several steps): a save must never destroy the last complete
// checkpoint, yet two files cannot be replaced in one atomic step. So a save
//   1. writes both new files under temporary names and fsyncs them (a full disk fails here, with
//      nothing replaced, and the temporaries removed);
//   2. moves the last complete pair to <stem>.prev.safetensors and <stem>.prev.train.safetensors
//      (previous_checkpoint_path), training state first;
//   3. renames the new training state, then the new model, into place.
// Every rename is followed by an fsync of the directory, so each step is durable before the next.
// At every moment some pair of files with the same checkpoint id exists: the one at `path`, the one
// at the .prev names, or, for the instant between the two moves of step 2, the model at `path`
// with the training state at the .prev name. find_checkpoint() looks for them in that order, so a
// save killed at any point, or failing on a full disk, leaves a loadable checkpoint: the new one,
// or the previous one, which load_checkpoint() then uses and says so (a warning on stderr). The
// previous pair is kept after a successful save (one generation; it costs the disk space of one
// more checkpoint). Temporary files of killed saves are removed by the next save.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "engine/core/stream.h"
#include "layers/module.h"
#include "layers/optim.h"
#include "layers/safetensors.h"

namespace cudp {

// `metadata` keys must not start with "cudp." or "optimizer." (reserved). The optimizer's
// parameters must all be parameters of `model` (their names come from the model).
void save_checkpoint(const std::string& path, Module& model, const Optimizer* optimizer,
                     const Metadata& metadata = {});

// A save in two halves, so that training can go on while the files are written: the snapshot is
// every tensor and value the save writes, copied to host memory now (the device's work so far is
// waited for; later updates of the model do not reach it); write_checkpoint then writes it with the
// crash-safe protocol above, on any thread. save_checkpoint is the two in a row.
struct CheckpointSnapshot {
  TensorMap model;          // model.state_dict(), host copies
  TensorMap train;          // the optimizer's state, host copies (empty without an optimizer)
  Metadata train_metadata;  // the caller's metadata and the optimizer's type and hyperparameters
};
CheckpointSnapshot snapshot_checkpoint(Module& model, const Optimizer* optimizer,
                                       const Metadata& metadata = {});
void write_checkpoint(const std::string& path, const CheckpointSnapshot& snapshot);

// The snapshot itself in two halves, so that the caller's thread does not wait for the copies to
// the host either (a trainer between two epochs: for VGG-16-BN, 122 MB of model and momentum that
// took ~70 ms a Fashion-MNIST epoch with the GPU idle). stage_checkpoint takes private copies of
// the state where it lives (Module::copy_state, Optimizer::state_copy: on a GPU, device to device
// on the current stream, nothing waited for) and records an event after them; to_host(), on any
// thread, waits for that event and brings the copies to the host on a stream of its own (the
// model's and the optimizer's export as in snapshot_checkpoint), giving snapshot_checkpoint's
// result. Later updates of the model do not reach the copies. The model must outlive the staged
// checkpoint (to_host uses its layers' export hooks) and keep its structure; the copies take device
// memory the size of the state until the staged checkpoint is gone. first_non_finite() looks for a
// NaN or an infinity in the model's f32 copies where they are (on a GPU, a launch per 64 tensors
// and a read of one flag per tensor on the current stream, which waits for the copies and the
// check: ~0.1 ms for VGG-16-BN's 61 MB) and names the first such entry, or returns "".
struct StagedCheckpoint {
  Module::StateCopy model;
  TensorMap train;  // Optimizer::state_copy
  Metadata train_metadata;
  int device = -1;          // the GPU the copies are on, or -1
  cuda::Event copies_done;  // recorded on that GPU's current stream after the copies
  CheckpointSnapshot to_host() const;
  std::string first_non_finite() const;
};
StagedCheckpoint stage_checkpoint(Module& model, const Optimizer* optimizer,
                                  const Metadata& metadata = {});

// Writes snapshots on a thread of its own, one save at a time, while the caller trains on: a save
// of two checkpoints of VGG-16 (4 files, 244 MB, each made durable with fsync) took 0.4 s of every
// Fashion-MNIST epoch of 1.2 s on the GPU machine. The crash-safe protocol is unchanged, so a kill
// at any moment still leaves the last complete checkpoint; what changes is when a save's failure
// (a full disk) is seen: at the next save() or at wait(), which rethrow it.
class CheckpointWriter {
 public:
  CheckpointWriter() = default;
  // Waits for the save in flight. Its error, if nobody collected it with wait(), goes to stderr: a
  // destructor cannot throw, and it runs when something else already failed.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Waits for the previous save (rethrowing its error), then writes `snapshot` to each of `paths`
  // in turn (one checkpoint each, as write_checkpoint) on the writer's thread.
  void save(std::vector<std::string> paths, CheckpointSnapshot snapshot);
  // The same from a staged checkpoint: the writer's thread brings it to the host (to_host), then
  // writes it. The staged copies are released by the next save() or wait() (or the destructor),
  // on the caller's thread: their frees go to the stream they were made on, the caller's, and
  // from the writer's thread they could land in a CUDA graph the caller is capturing meanwhile.
  void save(std::vector<std::string> paths, StagedCheckpoint staged);
  // Waits for the save in flight, if any; rethrows its error (once).
  void wait();

 private:
  // Takes `snapshot()` and writes it to each of `paths` on the writer's thread (save() has waited
  // for the previous save).
  void start(std::vector<std::string> paths, std::function<CheckpointSnapshot()> snapshot);

  std::thread thread_;
  std::exception_ptr error_;
  std::unique_ptr<StagedCheckpoint> staged_;  // the save in flight's, read by its thread
};

// Loads the last complete save of the checkpoint at `path` (find_checkpoint): the model strictly
// (every key, no extra: Module::load_state_dict) and, when `optimizer` is given, its state and
// lr/steps (the checkpoint must hold state of the same optimizer type). Errors name the file and the
// tensor. Returns the caller's metadata as saved. Both files are read and checked against each
// other before anything is loaded; the model is loaded before the optimizer, so an error in the
// optimizer state leaves the model loaded and the optimizer as it was.
Metadata load_checkpoint(const std::string& path, Module& model, Optimizer* optimizer = nullptr);

// Where the last complete save of the checkpoint at `path` is.
struct CheckpointFiles {
  std::string model, train;  // its two files
  bool fallback = false;     // not the pair at `path`: the last save there did not complete
  std::string note;          // when fallback: what was wrong and which pair is used instead
};
// Reads only the headers. Throws IoError naming every file when no complete pair exists.
CheckpointFiles find_checkpoint(const std::string& path);
// The caller's metadata of the last complete save, without loading tensors (a trainer reads its
// settings before it builds the model). Validate the values with the metadata_* getters below.
Metadata load_checkpoint_metadata(const std::string& path);

// The training-state file that belongs to a checkpoint at `path`.
std::string optimizer_state_path(const std::string& path);
// Where a save keeps the previous complete checkpoint (its model file; optimizer_state_path of it
// is its training state): <stem>.prev.safetensors.
std::string previous_checkpoint_path(const std::string& path);

// Validated reads of checkpoint metadata: a missing key or a value that is not what is expected
// throws IoError naming `file`, the key and the value (never std::invalid_argument from stoi or
// std::out_of_range from map::at, which would end a program that catches cudp::Error only).
int64_t metadata_int(const Metadata& metadata, const std::string& key, int64_t min, int64_t max,
                     const std::string& file);
uint64_t metadata_uint(const Metadata& metadata, const std::string& key, const std::string& file);
double metadata_double(const Metadata& metadata, const std::string& key, double min, double max,
                       const std::string& file);
// The value, which must be one of `allowed`.
const std::string& metadata_choice(const Metadata& metadata, const std::string& key,
                                   std::initializer_list<std::string_view> allowed,
                                   const std::string& file);

// Just the model: the model file alone, as PyTorch reads and writes it (e.g. weights exported by
// `safetensors.torch.save_file(model.state_dict(), path)`). Atomic; strict unless told otherwise.
void save_weights(const std::string& path, Module& model, const Metadata& metadata = {});
void load_weights(const std::string& path, Module& model, bool strict = true);

namespace detail {
// Test hook: called at each step of save_checkpoint with the step's name ("staged", "moved
// training state", "moved model", "published training state", "published model"), so the kill test
// can stop a process between any two of them. Null (the default) calls nothing.
void set_checkpoint_fault_hook(void (*hook)(const char* stage));
// Where load_checkpoint's fallback warning goes: stderr ("warning: ...") by default and after
// set_checkpoint_warning_handler(nullptr); tests and the fuzzer catch or silence it.
void set_checkpoint_warning_handler(void (*handler)(const std::string& message));
}  // namespace detail

}  // namespace cudp
