#include "layers/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <random>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/core/file.h"
#include "engine/core/memory.h"
#include "kernels/elementwise.h"

namespace cudp {
namespace {

constexpr const char* kIdKey = "cudp.checkpoint_id";
constexpr const char* kOptimizerPrefix = "optimizer.";
constexpr const char* kTypeKey = "optimizer.type";

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// A fresh 128-bit id in hex: the two files of one save share it.
std::string new_checkpoint_id() {
  std::random_device device;
  std::string id;
  for (int i = 0; i < 4; ++i) {
    id += detail::str(std::hex, std::setw(8), std::setfill('0'), device());
  }
  return id;
}

// The model's name of each optimizer parameter, by index. Throws for one the model does not own.
std::vector<std::string> parameter_names(Module& model, const Optimizer& optimizer) {
  std::unordered_map<const Parameter*, std::string> names;
  for (const auto& [name, p] : model.named_parameters()) {
    names.emplace(p, name);
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < optimizer.params().size(); ++i) {
    const auto it = names.find(optimizer.params()[i]);
    CUDP_CHECK(it != names.end(), "checkpoint: parameter ", i, " of the ", optimizer.type_name(),
               " optimizer is not a parameter of the ", model.type_name(), " model");
    out.push_back(it->second);
  }
  return out;
}

// `path` without a ".safetensors" suffix.
std::string stem(const std::string& path) {
  const std::string suffix = ".safetensors";
  const bool has_suffix = path.size() > suffix.size() &&
                          path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
  return has_suffix ? path.substr(0, path.size() - suffix.size()) : path;
}

void (*fault_hook)(const char*) = nullptr;

void print_warning(const std::string& message) {
  std::fprintf(stderr, "warning: %s\n", message.c_str());
}
void (*warning_handler)(const std::string&) = print_warning;

// A point between two steps of a save where the kill test stops the process.
void fault(const char* stage) {
  if (fault_hook) fault_hook(stage);
}

// What is wrong with one file of a possible pair: it decides the wording of find_checkpoint's
// error, never which pair it chooses (that depends on the ids alone).
enum class Problem {
  none,             // a checkpoint file with an id
  missing,          // no file at the path
  not_safetensors,  // the first bytes are not a safetensors header
  cut_short,        // a safetensors header, but the file ends before the header or the data does
  other,            // no id, trailing data, a bad tensor entry, a directory, no permission, ...
};

// One file of a possible pair: its checkpoint id, or why it has none.
struct Candidate {
  std::string path;
  std::string id;     // empty when the file is absent, unreadable or has no id
  std::string error;  // why, naming the file
  Problem problem = Problem::none;
};

// Why `path` has no id, from the reader's error: whether it is there at all, and what kind of
// damage the reader found (SafetensorsDamage). It words find_checkpoint's error, never decides
// which pair it chooses (that depends on the ids alone).
std::pair<Problem, std::string> classify(const std::string& path, const IoError& error) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return {Problem::missing, detail::str("'", path, "' does not exist")};
    }
  } else if (S_ISDIR(st.st_mode)) {
    return {Problem::not_safetensors,
            detail::str("'", path, "' is a directory, not a safetensors file; give the path of ",
                        "the checkpoint's model file")};
  }
  const auto* damaged = dynamic_cast<const SafetensorsError*>(&error);
  if (damaged == nullptr) return {Problem::other, error.message()};
  // The reader's reason, without its "safetensors file '<path>': ".
  const std::string prefix = detail::str("safetensors file '", path, "': ");
  const std::string& message = error.message();
  std::string reason = starts_with(message, prefix) ? message.substr(prefix.size()) : message;
  // "'<path>' is not a safetensors file (<reason>)" below says it once.
  const std::string not_safetensors = "not a safetensors file: ";
  if (starts_with(reason, not_safetensors)) reason.erase(0, not_safetensors.size());
  switch (damaged->damage()) {
    case SafetensorsDamage::not_safetensors:
      return {Problem::not_safetensors,
              detail::str("'", path, "' is not a safetensors file (", reason, ")")};
    case SafetensorsDamage::cut_short:
      return {Problem::cut_short, detail::str("'", path, "' is cut short: ", reason)};
    case SafetensorsDamage::invalid:
      break;
  }
  return {Problem::other, message};
}

Candidate read_id(const std::string& path) {
  Candidate c{path, {}, {}, Problem::none};
  try {
    const Metadata metadata = load_safetensors_metadata(path);
    const auto it = metadata.find(kIdKey);
    if (it == metadata.end() || it->second.empty()) {
      c.error =
          detail::str("'", path, "' has no checkpoint id (it was not written by save_checkpoint)");
      c.problem = Problem::other;
    } else {
      c.id = it->second;
    }
  } catch (const IoError& e) {
    std::tie(c.problem, c.error) = classify(path, e);
  }
  return c;
}

bool matches(const Candidate& model, const Candidate& train) {
  return !model.id.empty() && model.id == train.id;
}

// Why two files are not a pair.
std::string describe(const Candidate& model, const Candidate& train) {
  if (!model.error.empty() || !train.error.empty()) {
    std::string out;
    if (!model.error.empty()) out = detail::str("the model file: ", model.error);
    if (!train.error.empty()) {
      out += detail::str(out.empty() ? "" : "; ", "the training-state file: ", train.error);
    }
    return out;
  }
  return detail::str("the model file '", model.path, "' and the training-state file '", train.path,
                     "' do not belong to the same save (checkpoint ids ", model.id, " and ",
                     train.id, " differ)");
}

// What is wrong with the pair at `path` (model, train), in a sentence that begins "checkpoint
// '<path>' ...", and whether a save interrupted between its steps (or, on a file system that lost
// writes, during one) would explain it: a file missing, files of two saves, a file cut short. Only
// then does the sentence ask whether a save was interrupted; a file that is not safetensors, or is
// damaged otherwise, is said to be just that.
struct PairProblem {
  std::string why;
  bool interrupted;  // the likely cause is an interrupted save
};

PairProblem why_not_a_pair(const std::string& path, const Candidate& model, const Candidate& train,
                           bool earlier_save_present) {
  if (model.problem == Problem::missing && train.problem == Problem::missing) {
    return {
        detail::str("checkpoint '", path, "' does not exist",
                    earlier_save_present ? detail::str(", nor does its training-state file '",
                                                       train.path, "' (was a save interrupted?)")
                                         : ""),
        earlier_save_present};
  }
  if (model.problem == Problem::not_safetensors) {
    return {detail::str("checkpoint ", model.error), false};
  }
  const auto interrupted = [](Problem p) {
    return p == Problem::none || p == Problem::missing || p == Problem::cut_short;
  };
  if (interrupted(model.problem) && interrupted(train.problem)) {
    return {detail::str("checkpoint '", path, "' is incomplete: ", describe(model, train),
                        " (was a save interrupted?)"),
            true};
  }
  return {detail::str("checkpoint '", path, "' cannot be loaded: ", describe(model, train)), false};
}

// The caller's entries of a training-state file's metadata.
Metadata user_metadata(const Metadata& metadata) {
  Metadata user;
  for (const auto& [key, value] : metadata) {
    if (!starts_with(key, "cudp.") && !starts_with(key, kOptimizerPrefix)) {
      user.emplace(key, value);
    }
  }
  return user;
}

// Runs `load`; a ValueError or IoError it throws (a shape that does not fit the model, a damaged
// optimizer tensor) comes back as the same type with the file it came from named in front.
template <typename F>
void naming_file(const std::string& file, F&& load) {
  try {
    load();
  } catch (const IoError& e) {
    throw IoError(detail::str("checkpoint file '", file, "': ", e.message()), e.file(), e.line());
  } catch (const ValueError& e) {
    throw ValueError(detail::str("checkpoint file '", file, "': ", e.message()), e.file(), e.line());
  }
}

// The first NaN or infinity of a floating-point tensor on the host: its index and what it is, or
// index -1 (an integer tensor, or every value finite). An IEEE value is not finite when its
// exponent bits are all ones; it is a NaN when its mantissa is not zero.
struct NonFinite {
  int64_t index = -1;
  const char* what = "";
};
template <typename Bits>
NonFinite first_non_finite(const Tensor& t, Bits exponent, Bits sign) {
  const auto* bits = static_cast<const Bits*>(t.data_ptr());
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    if ((bits[i] & exponent) != exponent) continue;
    const bool nan = (bits[i] & Bits(~(exponent | sign))) != 0;
    return {i, nan ? "NaN" : (bits[i] & sign) != 0 ? "-inf" : "inf"};
  }
  return {};
}

// A model file read for loading holds finite values only: NaN or infinity there means the run
// that saved it had diverged (a save refuses such a model, StagedCheckpoint::first_non_finite,
// but a file written elsewhere or before that check was made may hold them). One pass over the
// host copies the reader just made, before anything is loaded.
void check_finite(const std::string& file, const TensorMap& tensors) {
  for (const auto& [name, t] : tensors) {
    NonFinite found;
    if (t.dtype() == DType::f32) {
      found = first_non_finite<uint32_t>(t, 0x7f800000u, 0x80000000u);
    } else if (t.dtype() == DType::bf16) {
      found = first_non_finite<uint16_t>(t, 0x7f80u, 0x8000u);
    } else if (t.dtype() == DType::f16) {
      found = first_non_finite<uint16_t>(t, 0x7c00u, 0x8000u);
    }
    if (found.index >= 0) {
      CUDP_THROW(IoError, "checkpoint file '", file, "': tensor '", name,
                 "' holds NaN/Inf values (element ", found.index, " is ", found.what,
                 "); the run that saved it had diverged: resume from or evaluate an earlier "
                 "checkpoint");
    }
  }
}

[[noreturn]] void bad_metadata(const Metadata& metadata, const std::string& key,
                               const std::string& file, const std::string& expected) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) {
    CUDP_THROW(IoError, "checkpoint '", file, "': metadata \"", key, "\" is missing (expected ",
               expected, ")");
  }
  const std::string shown = it->second.size() <= 64 ? it->second : it->second.substr(0, 61) + "...";
  CUDP_THROW(IoError, "checkpoint '", file, "': metadata \"", key, "\" is '", shown, "', not ",
             expected);
}

}  // namespace

namespace {

// The value of `key` as a whole number of type T (std::from_chars: no sign for an unsigned, no
// spaces, nothing after it) that `accept` takes; otherwise bad_metadata with `expected`.
template <typename T, typename Accept>
T metadata_number(const Metadata& metadata, const std::string& key, const std::string& file,
                  const std::string& expected, Accept accept) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) bad_metadata(metadata, key, file, expected);
  const std::string& text = it->second;
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() || !accept(value)) {
    bad_metadata(metadata, key, file, expected);
  }
  return value;
}

}  // namespace

int64_t metadata_int(const Metadata& metadata, const std::string& key, int64_t min, int64_t max,
                     const std::string& file) {
  return metadata_number<int64_t>(metadata, key, file,
                                  detail::str("an integer in [", min, ", ", max, "]"),
                                  [&](int64_t v) { return v >= min && v <= max; });
}

uint64_t metadata_uint(const Metadata& metadata, const std::string& key, const std::string& file) {
  return metadata_number<uint64_t>(metadata, key, file, "an integer in [0, 2^64 - 1]",
                                   [](uint64_t) { return true; });
}

double metadata_double(const Metadata& metadata, const std::string& key, double min, double max,
                       const std::string& file) {
  return metadata_number<double>(
      metadata, key, file, detail::str("a finite number in [", min, ", ", max, "]"),
      [&](double v) { return std::isfinite(v) && v >= min && v <= max; });
}

const std::string& metadata_choice(const Metadata& metadata, const std::string& key,
                                   std::initializer_list<std::string_view> allowed,
                                   const std::string& file) {
  std::string expected = "one of";
  for (std::string_view a : allowed) expected += detail::str(" '", a, "'");
  const auto it = metadata.find(key);
  if (it == metadata.end()) bad_metadata(metadata, key, file, expected);
  for (std::string_view a : allowed) {
    if (it->second == a) return it->second;
  }
  bad_metadata(metadata, key, file, expected);
}

std::string optimizer_state_path(const std::string& path) {
  return stem(path) + ".train.safetensors";
}

std::string previous_checkpoint_path(const std::string& path) {
  return stem(path) + ".prev.safetensors";
}

namespace detail {
void set_checkpoint_fault_hook(void (*hook)(const char* stage)) { fault_hook = hook; }
void set_checkpoint_warning_handler(void (*handler)(const std::string& message)) {
  warning_handler = handler ? handler : print_warning;
}
}  // namespace detail

CheckpointFiles find_checkpoint(const std::string& path) {
  const std::string prev = previous_checkpoint_path(path);
  const Candidate model = read_id(path), train = read_id(optimizer_state_path(path));
  const Candidate prev_model = read_id(prev), prev_train = read_id(optimizer_state_path(prev));
  if (matches(model, train)) {
    return {path, model.path, train.path, false, {}};
  }
  const bool earlier_save_present =
      prev_model.problem != Problem::missing || prev_train.problem != Problem::missing;
  const PairProblem problem = why_not_a_pair(path, model, train, earlier_save_present);
  const std::string& why = problem.why;
  // The pairs a save can leave behind, newest first (save_checkpoint's steps, in checkpoint.h).
  for (const auto& [m, t] : {std::pair{&model, &prev_train}, std::pair{&prev_model, &prev_train}}) {
    if (matches(*m, *t)) {
      return {
          path, m->path, t->path, true,
          detail::str(why, "; using the last complete save, '", m->path, "' with '", t->path, "'")};
    }
  }
  if (!earlier_save_present) {
    // Nothing at the .prev names. Where the save at `path` looks interrupted, say that there is no
    // earlier one to go back to; where it is not there at all, or is no checkpoint, that is all.
    if (!problem.interrupted) CUDP_THROW(IoError, why);
    CUDP_THROW(IoError, why, ", and no complete earlier save is beside it (neither '",
               prev_model.path, "' nor '", prev_train.path,
               "' exists). Resume from another checkpoint or start afresh");
  }
  const auto state = [](const Candidate& c) {
    return c.error.empty() ? detail::str("'", c.path, "' has checkpoint id ", c.id) : c.error;
  };
  CUDP_THROW(IoError, why, ", and no complete earlier save is beside it (", state(prev_model), "; ",
             state(prev_train), "). Resume from another checkpoint or start afresh");
}

Metadata load_checkpoint_metadata(const std::string& path) {
  const CheckpointFiles files = find_checkpoint(path);
  return user_metadata(load_safetensors_metadata(files.train));
}

namespace {

// The training state file's metadata: the caller's (checked for the reserved prefixes), then the
// optimizer's type and hyperparameters.
Metadata train_metadata_of(const Optimizer* optimizer, const Metadata& metadata) {
  for (const auto& [key, value] : metadata) {
    CUDP_CHECK(!starts_with(key, "cudp.") && !starts_with(key, kOptimizerPrefix),
               "save_checkpoint: metadata key '", key,
               "' uses a reserved prefix (\"cudp.\" or \"optimizer.\")");
  }
  Metadata out = metadata;
  if (optimizer) {
    out[kTypeKey] = optimizer->type_name();
    for (const auto& [key, value] : optimizer->hyperparameters()) {
      out[kOptimizerPrefix + key] = value;
    }
  }
  return out;
}

}  // namespace

CheckpointSnapshot snapshot_checkpoint(Module& model, const Optimizer* optimizer,
                                       const Metadata& metadata) {
  // Module::state_dict and Optimizer::state_dict return fresh host tensors that never alias the
  // live state (a model on the CPU included): the snapshot is theirs.
  CheckpointSnapshot snapshot;
  snapshot.train_metadata = train_metadata_of(optimizer, metadata);
  if (optimizer) snapshot.train = optimizer->state_dict(parameter_names(model, *optimizer));
  snapshot.model = model.state_dict();
  return snapshot;
}

StagedCheckpoint stage_checkpoint(Module& model, const Optimizer* optimizer,
                                  const Metadata& metadata) {
  StagedCheckpoint staged;
  staged.train_metadata = train_metadata_of(optimizer, metadata);
  const cuda::AllocationPurpose purpose(
      "a checkpoint's copy of the model and optimizer state on the device (brought to the host "
      "while training goes on)",
      "Free device memory, or save checkpoints less often.");
  if (optimizer) staged.train = optimizer->state_copy(parameter_names(model, *optimizer));
  staged.model = model.copy_state();
  // The optimizer's state lives with the parameters, on the model's device.
  if (model.device().is_cuda()) {
    staged.device = model.device().index;
    staged.copies_done = cuda::Event::create(staged.device);
    staged.copies_done.record(cuda::current_stream(staged.device));
  }
  return staged;
}

PinnedStaging::PinnedStaging(size_t half_bytes) : half_bytes_(half_bytes) {
  CUDP_CHECK(half_bytes >= 256 && half_bytes % 256 == 0,
             "PinnedStaging: a half must be a positive multiple of 256 bytes, got ", half_bytes);
}

PinnedStaging::~PinnedStaging() {
  cuda::host_free(data_, /*pinned=*/true);
}

char* PinnedStaging::get(size_t bytes) {
  if (data_ == nullptr) {
    // Halves of at most half the bytes to stage, so that a small state pins little.
    half_bytes_ = std::min(half_bytes_, std::max<size_t>(256, (bytes / 2 + 255) / 256 * 256));
    const cuda::AllocationPurpose purpose(kPinnedStagingPurpose);
    data_ = static_cast<char*>(
        cuda::host_allocate(2 * half_bytes_, /*pinned=*/true, kPinnedStagingPurpose));
  }
  return data_;
}

namespace {

// `tensors` on the host: the device ones copied on `stream` through the two halves of
// `half_bytes` at `base` (PinnedStaging::get). The tensors' bytes are cut into pieces that fill one
// half (a piece at a 256-byte aligned offset; a tensor larger than a half takes several); a full
// half's copies are followed by an event, and before the copies into a half start again its last
// pieces are waited for and copied out to their host tensors, so the DMA into one half runs while
// the host copies out of the other. Host tensors are taken as they are.
std::vector<Tensor> to_host_through(const std::vector<const Tensor*>& tensors, char* base,
                                    size_t half_bytes, cudaStream_t stream, int device) {
  char* const halves[2] = {base, base + half_bytes};
  const cuda::Event filled[2] = {cuda::Event::create(device), cuda::Event::create(device)};
  struct Piece {
    char* to;     // in the host tensor
    size_t from;  // offset in the half
    size_t bytes;
  };
  std::vector<Piece> pieces[2];
  size_t used[2] = {0, 0};
  // Waits for half k's copies and moves its pieces to their host tensors.
  const auto drain = [&](int k) {
    if (pieces[k].empty()) return;
    filled[k].synchronize();
    for (const Piece& p : pieces[k]) std::memcpy(p.to, halves[k] + p.from, p.bytes);
    pieces[k].clear();
    used[k] = 0;
  };
  int h = 0;  // the half being filled
  std::vector<Tensor> host;
  host.reserve(tensors.size());
  for (const Tensor* t : tensors) {
    if (!t->is_cuda()) {
      host.push_back(*t);
      continue;
    }
    Tensor h_t = Tensor::empty(t->shape(), t->dtype());
    const char* from = static_cast<const char*>(t->data_ptr());
    char* to = static_cast<char*>(h_t.data_ptr());
    for (size_t done = 0, bytes = t->nbytes(); done < bytes;) {
      if (used[h] == half_bytes) {  // full: on to the other half once its copies are out
        filled[h].record(stream);
        h ^= 1;
        drain(h);
      }
      const size_t n = std::min(bytes - done, half_bytes - used[h]);
      CUDP_CUDA_CHECK(
          cudaMemcpyAsync(halves[h] + used[h], from + done, n, cudaMemcpyDeviceToHost, stream));
      pieces[h].push_back({to + done, used[h], n});
      used[h] = std::min(half_bytes, (used[h] + n + 255) / 256 * 256);
      done += n;
    }
    host.push_back(std::move(h_t));
  }
  filled[h].record(stream);
  drain(h ^ 1);  // recorded when the copies moved on to half h
  drain(h);
  return host;
}

// The same without page-locked memory to spare: a pageable copy a tensor (the driver stages each
// through its own buffers), the same bits.
std::vector<Tensor> to_host_pageable(const std::vector<const Tensor*>& tensors,
                                     cudaStream_t stream) {
  std::vector<Tensor> host;
  host.reserve(tensors.size());
  for (const Tensor* t : tensors) {
    if (!t->is_cuda()) {
      host.push_back(*t);
      continue;
    }
    Tensor h = Tensor::empty(t->shape(), t->dtype());
    // On `stream` alone (not Tensor::copy_from, which would order it after the caller's stream).
    if (h.nbytes() > 0) {
      CUDP_CUDA_CHECK(
          cudaMemcpyAsync(h.data_ptr(), t->data_ptr(), h.nbytes(), cudaMemcpyDeviceToHost, stream));
    }
    host.push_back(std::move(h));
  }
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

}  // namespace

CheckpointSnapshot StagedCheckpoint::to_host(PinnedStaging* staging) const {
  CheckpointSnapshot snapshot;
  snapshot.train_metadata = train_metadata;
  if (device < 0) {
    snapshot.model = model.to_host();
    snapshot.train = train;
    return snapshot;
  }
  // On a stream of this thread's own: the device's default stream is the caller's, which runs on.
  // The device current first: a runtime call from this (writer) thread on its default device 0
  // would make a CUDA context there, on a GPU the run may not use.
  const cuda::DeviceGuard on_device(device);
  copies_done.synchronize();
  // Before the stream: on an error the stream's destructor waits for the copies into it, and only
  // then is the buffer freed.
  PinnedStaging own;
  PinnedStaging& buffer = staging ? *staging : own;
  const cuda::Stream stream = cuda::Stream::create(device);
  std::vector<const Tensor*> tensors;
  for (const Module::StateCopy::Item& item : model.items) tensors.push_back(&item.copy);
  for (const auto& [key, t] : train) tensors.push_back(&t);
  size_t bytes = 0;  // to stage: the first get() sizes the halves from it
  for (const Tensor* t : tensors) bytes += t->is_cuda() ? t->nbytes() : 0;
  char* base = nullptr;
  try {
    base = buffer.get(bytes);
  } catch (const OutOfMemoryError&) {  // no page-locked memory to spare
  }
  std::vector<Tensor> host =
      base ? to_host_through(tensors, base, buffer.half_bytes(), stream.get(), device)
           : to_host_pageable(tensors, stream.get());
  // The model's entries through their owners' export hooks, now on host copies.
  Module::StateCopy on_host;
  on_host.items = model.items;
  size_t i = 0;
  for (Module::StateCopy::Item& item : on_host.items) item.copy = std::move(host[i++]);
  snapshot.model = on_host.to_host();
  for (const auto& [key, t] : train) snapshot.train[key] = std::move(host[i++]);
  return snapshot;
}

std::string StagedCheckpoint::first_non_finite() const {
  std::vector<kernels::FloatSpan> spans;
  std::vector<const std::string*> names;
  for (const auto& item : model.items) {
    if (item.copy.dtype() != DType::f32 || item.copy.numel() == 0) continue;
    spans.push_back({item.copy.data<float>(), item.copy.numel()});
    names.push_back(&item.name);
  }
  std::vector<int32_t> flags(spans.size(), 0);
  if (device < 0) {
    kernels::flag_non_finite_cpu(spans.data(), int64_t(spans.size()), flags.data());
  } else if (!spans.empty()) {
    const cuda::DeviceGuard guard(device);
    Tensor device_flags = Tensor::zeros({int64_t(spans.size())}, DType::i32, Device::cuda(device));
    kernels::flag_non_finite(spans.data(), int64_t(spans.size()), device_flags.data<int32_t>(),
                             cuda::current_stream(device));
    flags = device_flags.to_vector<int32_t>();  // waits for the copies and the check
  }
  for (size_t i = 0; i < flags.size(); ++i) {
    if (flags[i] != 0) return *names[i];
  }
  return "";
}

namespace {

// Files a save moved aside (move_aside): the .prev pairs it replaced, removed once the new pairs
// are in place (removing a file frees its blocks, what made replacing it slow).
using SetAside = std::vector<std::string>;

void remove_set_aside(SetAside& files) {
  for (const std::string& file : files) ::unlink(file.c_str());
  files.clear();
}

// Puts a file moved aside back at `original` unless that name is taken again, and removes the aside
// name. True when it is back. By a hard link, which never replaces a file; where the file system
// has none (or no room for one), by a rename, once `original` is seen to be free (a file there now
// is newer and must stay).
bool put_back(const std::string& aside, const std::string& original) {
  if (::link(aside.c_str(), original.c_str()) == 0) {
    ::unlink(aside.c_str());
    return true;
  }
  const int link_error = errno;
  struct stat st {};
  if (link_error != EEXIST && ::lstat(original.c_str(), &st) != 0 && errno == ENOENT &&
      ::rename(aside.c_str(), original.c_str()) == 0) {
    return true;
  }
  ::unlink(aside.c_str());
  return false;
}

// Steps 2 and 3 of a save (checkpoint.h) at `path`, whose new pair is staged: complete and durable
// under temporary names beside it.
void replace_pair(const std::string& path, StagedFile& new_train, StagedFile& new_model,
                  SetAside& set_aside) {
  const std::string train_path = optimizer_state_path(path);
  const std::string prev = previous_checkpoint_path(path), prev_train = optimizer_state_path(prev);
  remove_stale_temporaries(prev);  // files killed saves moved aside
  remove_stale_temporaries(prev_train);

  // 2. The last complete save moves to the .prev names, training state first, so that at every
  //    moment one complete pair exists: (path, train) -> (path, prev train) -> (prev, prev train).
  //    Where it already is at .prev (the last save was interrupted) or there is none, nothing moves.
  const Candidate model_now = read_id(path), train_now = read_id(train_path);
  const Candidate prev_train_now = read_id(prev_train);
  if (matches(model_now, train_now)) {
    // The pair at `path` is complete, so the .prev pair is not the last complete save: it moves
    // aside to fresh names first (a kill from here on leaves the pair at `path` or the moved one),
    // the moves below replace nothing, and its blocks are freed once the new pair is in place.
    // Should the first move fail, it goes back to the .prev names if they are still free.
    const std::string old_train = move_aside(prev_train), old_model = move_aside(prev);
    fault("moved previous save aside");
    try {
      rename_durably(train_path, prev_train, "checkpoint");
    } catch (...) {
      const bool train_back = old_train.empty() || put_back(old_train, prev_train);
      if (!old_model.empty() && !(train_back && put_back(old_model, prev))) {
        ::unlink(old_model.c_str());
      }
      throw;
    }
    for (const std::string& aside : {old_train, old_model}) {
      if (!aside.empty()) set_aside.push_back(aside);
    }
    fault("moved training state");
    rename_durably(path, prev, "checkpoint");
    fault("moved model");
  } else if (matches(model_now, prev_train_now)) {
    rename_durably(path, prev, "checkpoint");
    fault("moved model");
  }

  // 3. The new pair goes in, training state first: until the model follows, the pair at `path` is
  //    torn and find_checkpoint uses the .prev pair.
  new_train.publish();
  fault("published training state");
  new_model.publish();
  fault("published model");
}

// A save of `snapshot` at `path`, both files written.
void write_pair(const std::string& path, const CheckpointSnapshot& snapshot, SetAside& set_aside) {
  const std::string id = new_checkpoint_id();
  Metadata train_metadata = snapshot.train_metadata;
  train_metadata[kIdKey] = id;
  // 1. Both new files, complete and durable under temporary names (staging first removes what
  //    killed saves left behind). A failure here (a full disk) throws with nothing replaced; the
  //    temporaries go with the StagedFiles.
  const auto new_train =
      stage_safetensors(optimizer_state_path(path), snapshot.train, train_metadata);
  const auto new_model = stage_safetensors(path, snapshot.model, {{"format", "pt"}, {kIdKey, id}});
  fault("staged");
  replace_pair(path, *new_train, *new_model, set_aside);
}

// A save at `path` of the pair just published at `source` (same save, same snapshot): step 1 is
// hard links to it under temporary names beside `path` instead of written copies; steps 2 and 3 are
// write_pair's. False, with nothing changed, where the file system cannot link them there.
bool link_pair(const std::string& source, const std::string& path, SetAside& set_aside) {
  const std::string train_path = optimizer_state_path(path);
  remove_stale_temporaries(train_path);
  remove_stale_temporaries(path);
  const auto new_train =
      StagedFile::link(optimizer_state_path(source), train_path, "safetensors file");
  if (!new_train) return false;
  const auto new_model = StagedFile::link(source, path, "safetensors file");
  if (!new_model) return false;  // new_train's link goes with it
  fault("staged");
  replace_pair(path, *new_train, *new_model, set_aside);
  return true;
}

// Each of `paths` in turn: the first written, each further one linked to a target written before it
// (the first, or where that file system cannot link, the next written one), or written where none
// can be linked.
void write_targets(const std::vector<std::string>& paths, const CheckpointSnapshot& snapshot,
                   SetAside& set_aside) {
  std::vector<const std::string*> written;
  for (const std::string& path : paths) {
    bool linked = false;
    for (size_t i = 0; i < written.size() && !linked; ++i) {
      linked = link_pair(*written[i], path, set_aside);
    }
    if (!linked) {
      write_pair(path, snapshot, set_aside);
      written.push_back(&path);
    }
  }
}

}  // namespace

void write_checkpoints(const std::vector<std::string>& paths, const CheckpointSnapshot& snapshot) {
  SetAside set_aside;
  try {
    write_targets(paths, snapshot, set_aside);
  } catch (...) {
    remove_set_aside(set_aside);
    throw;
  }
  remove_set_aside(set_aside);
}

void write_checkpoint(const std::string& path, const CheckpointSnapshot& snapshot) {
  write_checkpoints({path}, snapshot);
}

void save_checkpoint(const std::string& path, Module& model, const Optimizer* optimizer,
                     const Metadata& metadata) {
  write_checkpoint(path, snapshot_checkpoint(model, optimizer, metadata));
}

CheckpointWriter::~CheckpointWriter() {
  if (thread_.joinable()) thread_.join();
  staged_.reset();
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: a checkpoint save did not complete: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "error: a checkpoint save did not complete\n");
    }
  }
}

void CheckpointWriter::save(std::vector<std::string> paths, CheckpointSnapshot snapshot) {
  wait();
  start(std::move(paths), [snapshot = std::move(snapshot)] { return snapshot; });
}

void CheckpointWriter::save(std::vector<std::string> paths, StagedCheckpoint staged) {
  wait();
  staged_ = std::make_unique<StagedCheckpoint>(std::move(staged));
  start(std::move(paths), [this, copies = staged_.get()] { return copies->to_host(&staging_); });
}

void CheckpointWriter::start(std::vector<std::string> paths,
                             std::function<CheckpointSnapshot()> snapshot) {
  if (thread_.joinable()) thread_.join();  // the last save's removals (wait() saw it complete)
  done_ = false;
  try {
    thread_ = std::thread([this, paths = std::move(paths), snapshot = std::move(snapshot)] {
      SetAside set_aside;
      std::exception_ptr error;
      try {
        const CheckpointSnapshot taken = snapshot();
        write_targets(paths, taken, set_aside);
      } catch (...) {
        error = std::current_exception();
      }
      {
        const std::lock_guard<std::mutex> lock(mutex_);
        error_ = error;  // read by wait() once done_ is set
        done_ = true;
      }
      done_changed_.notify_all();
      // The save is complete (or failed): wait() returns while the files it set aside are removed
      // here, the freeing of their blocks off the caller's path.
      remove_set_aside(set_aside);
    });
  } catch (...) {  // no thread (std::system_error): no save in flight, nothing for wait() to await
    done_ = true;
    staged_.reset();
    throw;
  }
}

void CheckpointWriter::wait() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_changed_.wait(lock, [this] { return done_; });
  }
  staged_.reset();  // here, on the caller's thread (save's note)
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

Metadata load_checkpoint(const std::string& path, Module& model, Optimizer* optimizer) {
  const CheckpointFiles files = find_checkpoint(path);
  if (files.fallback) {
    warning_handler(files.note);
  }
  return load_checkpoint(read_checkpoint(files), model, optimizer);
}

CheckpointContents read_checkpoint(const CheckpointFiles& files) {
  CheckpointContents contents{files, load_safetensors(files.model), load_safetensors(files.train)};
  const Metadata& model_metadata = contents.model.metadata;
  const Metadata& train_metadata = contents.train.metadata;
  const auto model_id = model_metadata.find(kIdKey);
  const auto train_id = train_metadata.find(kIdKey);
  if (model_id == model_metadata.end() || train_id == train_metadata.end() ||
      model_id->second != train_id->second) {  // replaced since find_checkpoint looked
    CUDP_THROW(IoError, "checkpoint '", files.path, "': '", files.model, "' and '", files.train,
               "' changed while being read (is another process saving this checkpoint?)");
  }
  check_finite(files.model, contents.model.tensors);
  return contents;
}

Metadata load_checkpoint(const CheckpointContents& contents, Module& model, Optimizer* optimizer) {
  const CheckpointFiles& files = contents.files;
  const std::string& path = files.path;
  const std::string& train_path = files.train;
  const SafetensorsFile& model_file = contents.model;
  const SafetensorsFile& train_file = contents.train;

  // Check that the training state fits the optimizer before loading anything.
  Metadata hyperparameters;
  std::vector<std::string> names;
  if (optimizer) {
    const auto type = train_file.metadata.find(kTypeKey);
    if (type == train_file.metadata.end()) {
      CUDP_THROW(IoError, "checkpoint '", path, "': '", train_path,
                 "' holds no optimizer state, but a ", optimizer->type_name(),
                 " optimizer was given to load it into");
    }
    if (type->second != optimizer->type_name()) {
      CUDP_THROW(IoError, "checkpoint '", path, "': '", train_path, "' holds ", type->second,
                 " state, but the optimizer is ", optimizer->type_name());
    }
    names = parameter_names(model, *optimizer);
    for (const auto& [key, value] : train_file.metadata) {
      if (starts_with(key, kOptimizerPrefix)) {
        hyperparameters[key.substr(std::string(kOptimizerPrefix).size())] = value;
      }
    }
  }

  naming_file(files.model, [&] { model.load_state_dict(model_file.tensors, /*strict=*/true); });
  if (optimizer) {
    naming_file(train_path, [&] {
      optimizer->load_state_dict(train_file.tensors, names);
      optimizer->load_hyperparameters(hyperparameters);
    });
  }
  return user_metadata(train_file.metadata);
}

void save_weights(const std::string& path, Module& model, const Metadata& metadata) {
  Metadata with_format = metadata;
  with_format.emplace("format", "pt");
  save_safetensors(path, model.state_dict(), with_format);
}

void load_weights(const std::string& path, Module& model, bool strict) {
  const SafetensorsFile file = load_safetensors(path);
  check_finite(path, file.tensors);
  naming_file(path, [&] { model.load_state_dict(file.tensors, strict); });
}

}  // namespace cudp
