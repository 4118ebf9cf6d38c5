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
//
// Where the pair at `path` is complete, the pair at the .prev names, which step 2 replaces, is not
// the last complete checkpoint: it is first renamed aside (".<name>.old-<pid>-<n>", file.h's
// move_aside), so that the moves of step 2 replace nothing, and removed after step 3, so that the
// freeing of its blocks (~24 ms for a VGG-16 pair on ext4) comes after the new pair is in place
// (CheckpointWriter: after wait() has returned). A kill leaves those files behind as it leaves
// temporaries, and the next save removes them; should the first move of step 2 fail, they go back
// to the .prev names (where the file system has hard links). Where the pair at `path` is torn,
// nothing is set aside: the .prev names may then hold part of the last complete pair.
//
// One save to several paths (write_checkpoints, CheckpointWriter) writes the files once, at the
// first path, and gives each further path the pair just published there as hard links: step 1 links
// the two files to temporary names beside the target (and fsyncs them) instead of writing copies,
// and steps 2 and 3 are the same. So targets of one save, and their .prev pairs, may share inodes.
// That is safe because no file of a checkpoint is ever modified in place: every save writes new
// files and renames them over the old names, and a rename or removal of one name leaves the other
// names of the inode as they were, with the same complete, fsync'ed bytes. (A tool that edits a
// checkpoint file in place would change every target that shares it; copy the file first.) Where a
// target's file system cannot link to the first (another file system, no hard links: EXDEV, EPERM,
// ...), that target is written in full, and later targets may link to it instead.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
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
// `snapshot` to each of `paths` in turn, one checkpoint each: written at the first, hard-linked at
// the others where their file system allows (above). The first failure throws; the targets before
// it are complete, the one that failed and those after it hold their last complete checkpoint.
void write_checkpoints(const std::vector<std::string>& paths, const CheckpointSnapshot& snapshot);

// Page-locked host memory that a staged checkpoint is copied through on its way to the host
// (StagedCheckpoint::to_host, below): two halves, the copies from the device into one while the
// host copies out of the other, allocated at the first get() and kept from one save to the next.
// Its allocation runs under the cuda::AllocationPurpose kPinnedStagingPurpose.
inline constexpr const char* kPinnedStagingPurpose =
    "a checkpoint's page-locked staging buffer (device to host)";
class PinnedStaging {
 public:
  // 8 MiB a half, whatever the state's size: page-locked memory is slow to allocate, and a buffer
  // of the state's size (VGG-16-BN's 122 MB) allocated at the first save slowed the training
  // beside it (bench/NOTES-tensor-cores.md, session 37).
  static constexpr size_t kDefaultHalfBytes = size_t(8) << 20;
  // `half_bytes`: a multiple of 256 (smaller in tests, to cut tensors into several pieces).
  explicit PinnedStaging(size_t half_bytes = kDefaultHalfBytes);
  ~PinnedStaging();
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;
  // The two halves, one after the other. The first call allocates them, each of half_bytes() or,
  // for a state of fewer `bytes`, of about half of them (a multiple of 256); OutOfMemoryError
  // where the page-locked memory cannot be had.
  char* get(size_t bytes);
  size_t half_bytes() const { return half_bytes_; }

 private:
  size_t half_bytes_;
  char* data_ = nullptr;
};

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
//
// to_host() brings the copies over through a page-locked PinnedStaging on its own stream: the
// tensors cut into pieces of at most a half, the DMA into one half beside the host copies out of
// the other. With pageable copies (an allocation and a wait a tensor) the epochs that trained
// beside a save ran 2-4% slower than without checkpoints (Fashion-MNIST on an H100: 111,500-114,000
// img/s against 115,500-116,100); through a page-locked buffer of the state's size they ran at
// 115,300-116,300, but the epoch of the first save, which allocated that buffer, ran ~10% slower.
// The two halves keep the first gain without that loss (the first save's epoch within 1% of the
// others, H100, 2026-12-07), and hold 16 MiB for the writer's life whatever the state's size
// (VGG-16's is 1.1 GB with momentum). The buffer is
// `staging` when given (a CheckpointWriter keeps one), else its own. Where no page-locked memory
// can be had, the copies go through pageable memory, with the same bits.
struct StagedCheckpoint {
  Module::StateCopy model;
  TensorMap train;  // Optimizer::state_copy
  Metadata train_metadata;
  int device = -1;          // the GPU the copies are on, or -1
  cuda::Event copies_done;  // recorded on that GPU's current stream after the copies
  CheckpointSnapshot to_host(PinnedStaging* staging = nullptr) const;
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
  // in turn (one checkpoint each, as write_checkpoints: the others hard-linked to the first) on the
  // writer's thread.
  void save(std::vector<std::string> paths, CheckpointSnapshot snapshot);
  // The same from a staged checkpoint: the writer's thread brings it to the host (to_host), then
  // writes it. The staged copies are released by the next save() or wait() (or the destructor),
  // on the caller's thread: their frees go to the stream they were made on, the caller's, and
  // from the writer's thread they could land in a CUDA graph the caller is capturing meanwhile.
  void save(std::vector<std::string> paths, StagedCheckpoint staged);
  // Waits for the save in flight, if any, to be complete (every target in place) or to fail;
  // rethrows its error (once). The .prev pairs the save replaced (checkpoint.h's step 2) may still
  // be being removed on the writer's thread; the next save() and the destructor wait for that.
  void wait();

 private:
  // Takes `snapshot()` and writes it to each of `paths` on the writer's thread (save() has waited
  // for the previous save).
  void start(std::vector<std::string> paths, std::function<CheckpointSnapshot()> snapshot);

  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable done_changed_;
  bool done_ = true;  // no save in flight; with error_, under mutex_ while a thread runs
  std::exception_ptr error_;
  std::unique_ptr<StagedCheckpoint> staged_;  // the save in flight's, read by its thread
  PinnedStaging staging_;                     // its page-locked buffer, used by its thread
};

// Loads the last complete save of the checkpoint at `path` (find_checkpoint): the model strictly
// (every key, no extra: Module::load_state_dict) and, when `optimizer` is given, its state and
// lr/steps (the checkpoint must hold state of the same optimizer type). Errors name the file and
// the tensor; a model file holding a NaN or an infinity (the run that saved it had diverged) is
// refused as it is read, naming the tensor and the element. Returns the caller's metadata as saved.
// Both files are read and checked against each other before anything is loaded; the model is loaded
// before the optimizer, so an error in the optimizer state leaves the model loaded and the
// optimizer as it was.
Metadata load_checkpoint(const std::string& path, Module& model, Optimizer* optimizer = nullptr);

// Where the last complete save of the checkpoint at `path` is.
struct CheckpointFiles {
  std::string path;          // the checkpoint asked for
  std::string model, train;  // its last complete save's two files
  bool fallback = false;     // not the pair at `path`: the last save there did not complete
  std::string note;          // when fallback: what was wrong and which pair is used instead
};
// The pair find_checkpoint found, read into host memory and checked as load_checkpoint checks it
// (the two files of one save, the model's values finite; the same errors), nothing loaded yet: for
// a caller that loads one checkpoint more than once (a trainer: the model, then the model and its
// optimizer) and says itself which save it uses. Each load from it is load_checkpoint's without
// looking at the files again, so every load gets the same save and the files are read and scanned
// once.
struct CheckpointContents {
  CheckpointFiles files;
  SafetensorsFile model, train;
};
CheckpointContents read_checkpoint(const CheckpointFiles& files);
Metadata load_checkpoint(const CheckpointContents& contents, Module& model,
                         Optimizer* optimizer = nullptr);
// Reads only the headers. Throws IoError when no complete pair exists: "does not exist" where no
// file is at `path` or the .prev names, "is not a safetensors file" where the model file is not
// one; otherwise naming each file and what is wrong with it, asking whether a save was interrupted
// only where that would explain it (a file missing or cut short, files of two saves).
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
// load_weights refuses NaN and infinities as load_checkpoint does.
void save_weights(const std::string& path, Module& model, const Metadata& metadata = {});
void load_weights(const std::string& path, Module& model, bool strict = true);

namespace detail {
// Test hook: called at each step of a save, for each of its targets, with the step's name
// ("staged" (written or linked), "moved previous save aside", "moved training state", "moved
// model", "published training state", "published model"), so the kill test can stop a process
// between any two of them. Null (the default) calls nothing.
void set_checkpoint_fault_hook(void (*hook)(const char* stage));
// Where load_checkpoint's fallback warning goes: stderr ("warning: ...") by default and after
// set_checkpoint_warning_handler(nullptr); tests and the fuzzer catch or silence it.
void set_checkpoint_warning_handler(void (*handler)(const std::string& message));
}  // namespace detail

}  // namespace cudp
